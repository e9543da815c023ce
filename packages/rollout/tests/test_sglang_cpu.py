"""What Ember adds for the real SGLang server on CPU (`ember_rollout.sglang_cpu`): the
`sgl_kernel` stand-in against a reference computation, the start-up fixes, the command line and
the environment of a CPU server."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ember_rollout import sglang_cpu
from ember_rollout.config import SGLangEngineConfig
from ember_rollout.sglang_engine import SGLangEngine


@pytest.fixture(scope="module")
def standin():
    """The stand-in package, loaded under a name of its own (not `sgl_kernel`)."""
    directory = sglang_cpu.SITE_DIR / "sgl_kernel"
    spec = importlib.util.spec_from_file_location(
        "sgl_kernel_standin", directory / "__init__.py", submodule_search_locations=[]
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reference_table(indices, table, starts, ends, slots):
    """The Triton kernel's result (sglang srt/mem_cache/allocation.py 692-723), token by token:
    slot k belongs to the request whose cumulative length first exceeds k."""
    out = table.clone()
    cumulative = torch.cumsum(ends - starts, 0)
    for k, slot in enumerate(slots.tolist()):
        b = int(torch.searchsorted(cumulative, torch.tensor(k), right=True))
        before = int(cumulative[b - 1]) if b else 0
        out[int(indices[b]), int(starts[b]) + k - before] = slot
    return out


def test_assign_req_to_token_pool_writes_what_the_kernel_writes(standin):
    generator = torch.Generator().manual_seed(0)
    table = torch.randint(0, 99, (6, 12), generator=generator, dtype=torch.int32)
    indices = torch.tensor([4, 0, 2], dtype=torch.int64)
    starts = torch.tensor([3, 0, 5], dtype=torch.int64)
    ends = torch.tensor([7, 1, 12], dtype=torch.int64)  # lengths 4, 1, 7 (one prefix extends)
    slots = torch.arange(100, 112, dtype=torch.int32)
    want = _reference_table(indices, table, starts, ends, slots)
    standin.assign_req_to_token_pool_cpu(indices, table, starts, ends, slots, 12)
    assert torch.equal(table, want)
    with pytest.raises(ValueError, match="rows hold 12 slots, not 16"):
        standin.assign_req_to_token_pool_cpu(indices, table, starts, ends, slots, 16)


def test_ops_a_cpu_server_never_calls_say_so_if_called(standin):
    with pytest.raises(NotImplementedError, match="verify_tree_greedy_cpu .*spec_tree.py"):
        standin.verify_tree_greedy_cpu()
    # Every other submodule comes from the real package's Python files, where it is installed.
    real = importlib.util.find_spec("sgl_kernel")
    if real is not None:
        assert str(Path(real.origin).resolve().parent) in standin.__path__


def test_a_cpu_server_command_adds_the_cpu_flags_it_lacks_and_no_gpu_placement():
    config = SGLangEngineConfig(
        model_path="/m",
        device="cpu",
        dtype="float32",
        mem_fraction_static=0.5,
        base_gpu_id=3,
        server_args=["--max-total-tokens", "2048"],
    )
    command = SGLangEngine(config).server_command(30000)
    joined = " ".join(command)
    assert "--device cpu" in joined and "--attention-backend torch_native" in joined
    assert "--dtype float32" in joined and "--mem-fraction-static 0.5" in joined
    assert command.count("--max-total-tokens") == 1 and "--max-total-tokens 2048" in joined
    assert "--sleep-on-idle" in command and "--skip-server-warmup" in command
    assert "--base-gpu-id" not in command


def test_a_cpu_server_environment():
    env = sglang_cpu.server_env({"PYTHONPATH": "/a", "OMP_NUM_THREADS": "3"})
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert env["PYTHONPATH"] == os.pathsep.join([str(sglang_cpu.SITE_DIR), "/a"])
    assert env["OMP_NUM_THREADS"] == "3"  # the caller's share is kept
    assert sglang_cpu.server_env({})["OMP_NUM_THREADS"] == "1"


_PROBE = (
    "import torch; m = torch.get_device_module(); "
    "print(m.__name__, torch.cuda.cudart().cudaHostRegister(0, 8, 0))"
)


@pytest.mark.slow  # two interpreters importing torch
@pytest.mark.skipif(torch.cuda.is_available(), reason="the fixes are for machines without a GPU")
def test_the_start_up_fixes_apply_in_a_cpu_server_only():
    def probe(env):
        run = subprocess.run(
            [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120
        )
        return run.stdout.strip(), run.returncode

    assert probe(sglang_cpu.server_env()) == ("torch.cpu 0", 0)
    plain = {k: v for k, v in sglang_cpu.server_env().items() if k != "SGLANG_USE_CPU_ENGINE"}
    name, code = probe(plain)
    assert code != 0 or not name.startswith("torch.cpu"), "unchanged outside a CPU server"
