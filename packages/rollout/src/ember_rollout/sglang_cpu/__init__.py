"""The real SGLang server on a machine without a GPU (sglang 0.5.23, PyPI's torch 2.14.1).

sglang's own CPU path (`SGLANG_USE_CPU_ENGINE=1`, `--device cpu`) runs the torch-native layers,
but two things of PyPI's builds are missing on such a machine, and `site/` supplies them:
`site/sgl_kernel` stands in for the CUDA-only kernel package, and `site/sitecustomize.py` makes
two torch calls answer for the CPU. `server_env` puts that directory first on the server's path;
`server_args` adds the flags a CPU server needs. Only the launched server sees any of it.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

SITE_DIR = Path(__file__).resolve().parent / "site"
"""First on a CPU server's PYTHONPATH: the `sgl_kernel` stand-in and `sitecustomize`."""

SERVER_ARGS: dict[str, str | None] = {
    "--device": "cpu",
    # The CUDA attention backends (flashinfer, triton) need a GPU.
    "--attention-backend": "torch_native",
    "--disable-cuda-graph": None,
    # Without a cap the KV cache is sized to the machine's RAM (14.5 GB, 49 s on 24 GB).
    "--max-total-tokens": "16384",
    "--max-running-requests": "256",
    # The warm-up request only compiles CUDA kernels; on CPU it costs start-up time.
    "--skip-server-warmup": None,
    # An idle scheduler otherwise polls for requests and keeps a whole core busy.
    "--sleep-on-idle": None,
}
"""Flags of a CPU server, each added unless `server_args` sets it already."""

EXTRA_HINT = (
    "install the sglang extra: `uv sync --extra sglang` in this repository "
    "(or `pip install 'ember-rollout[sglang]'`)"
)


def sglang_installed() -> bool:
    """Whether this interpreter can import sglang (without importing it: that takes a minute)."""
    return importlib.util.find_spec("sglang") is not None


def server_args(args: Sequence[str]) -> list[str]:
    """`args` plus every flag of `SERVER_ARGS` that `args` does not set itself."""
    given = {a.split("=", 1)[0] for a in args if a.startswith("--")}
    extra: list[str] = []
    for flag, value in SERVER_ARGS.items():
        if flag not in given:
            extra += [flag] if value is None else [flag, value]
    return [*args, *extra]


def server_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a CPU server: `base` (default: this process's) with sglang's CPU
    switch on, `SITE_DIR` first on PYTHONPATH, and one OpenMP thread unless `base` says how
    many (`OMP_NUM_THREADS`; Ember's engine actors set their share).

    Without sgl_kernel's CPU thread binding (`init_cpu_threads_env`, which needs its C++ ops)
    the model runs with torch's default of one thread per core, and on a shared 2-core machine
    its OpenMP threads wait on each other at every small op: 64 default-task requests took
    7.9-14 s there, and 0.34 s with one thread (AMD EPYC, 2 cores, load 2-3).
    """
    env = dict(os.environ if base is None else base)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(SITE_DIR) + (os.pathsep + path if path else "")
    return env
