#!/usr/bin/env bash
# GPU runner entry point: the locked environment with the [sglang] extra, then every test marked
# `gpu` under integration_tests/. Arguments go to pytest (for example -x, or -k sglang).
# Transformer Engine is not in uv.lock (and `uv sync` removes what the lock does not list), so
# the TE-only paths stay untested here and the tests that need TE skip with that reason.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v uv >/dev/null 2>&1; then
    # PEP 668: a distribution's python3 refuses `pip install` outside a virtual environment
    # (externally-managed-environment), so uv goes into a throwaway one of its own.
    uv_env="${TMPDIR:-/tmp}/ember-uv"
    if python3 -m venv "$uv_env" && "$uv_env/bin/python" -m pip install --quiet uv; then
        export PATH="$uv_env/bin:$PATH"
    else
        # No venv module (Debian without python3-venv): a user install, past the marker.
        echo "gpu_suite: no virtual environment for uv; installing it with pip --user" >&2
        python3 -m pip install --quiet --user --break-system-packages uv
        export PATH="$HOME/.local/bin:$PATH"
    fi
fi
# The suite writes every model it serves itself; nothing comes from a model hub.
export HF_HUB_OFFLINE=1
uv sync --locked --extra sglang
# Every test here skips without a GPU or sglang, so a run that could only skip must fail.
uv run --locked --extra sglang python - <<'PY'
import importlib.util
import sys

import torch

if not torch.cuda.is_available():
    sys.exit("gpu_suite: torch sees no CUDA GPU")
if importlib.util.find_spec("sglang") is None:
    sys.exit("gpu_suite: sglang is not installed")
name = torch.cuda.get_device_name(0)
print(f"gpu_suite: {torch.cuda.device_count()} x {name}, torch {torch.__version__}")
PY
exec uv run --locked --extra sglang pytest -m gpu integration_tests -rs "$@"
