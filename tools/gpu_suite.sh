#!/usr/bin/env bash
# GPU runner entry point: the locked environment with the [sglang] extra, then every test marked
# `gpu` under integration_tests/. Arguments go to pytest (for example -x, or -k sglang).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v uv >/dev/null 2>&1; then
    python3 -m pip install --quiet uv
    export PATH="$HOME/.local/bin:$PATH"
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
