"""Two torch answers that a CPU SGLang server needs (sglang 0.5.23, PyPI's CUDA build of torch).

Python imports this module at start-up in every process of a server that Ember launches on CPU
(the directory is first on its PYTHONPATH); it changes nothing unless `SGLANG_USE_CPU_ENGINE=1`.

1. `torch.get_device_module()` answers `torch.cpu`. With no device argument torch picks the
   build's accelerator, torch.cuda, even when no GPU exists, and
   `scheduler_components/weight_updater.py` 379 calls `.synchronize()` on it after every
   /release_memory_occupation: the scheduler died there.
2. `torch.cuda.cudart()` answers a runtime whose host-memory registration is a no-op.
   `--enable-return-routed-experts` allocates its host buffer pinned
   (`state_capturer/base.py` 67-73 -> `mem_cache/pool_host/common.py` 349, 147), and pinning
   calls `cudaHostRegister`, which needs the CUDA driver. Pinning only speeds copies from a
   device; with no device there are none.
"""

import os

if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    import torch

    _get_device_module = torch.get_device_module

    def _device_module(device=None):
        return torch.cpu if device is None else _get_device_module(device)

    class _HostOnlyRuntime:
        """The calls `mem_cache/pool_host/common.py` makes on `torch.cuda.cudart()`."""

        @staticmethod
        def cudaHostRegister(ptr: int, size: int, flags: int) -> int:  # noqa: N802
            return 0

        @staticmethod
        def cudaHostUnregister(ptr: int) -> int:  # noqa: N802
            return 0

        @staticmethod
        def cudaGetErrorString(code: int) -> str:  # noqa: N802
            return f"error {code} (no CUDA device)"

    torch.get_device_module = _device_module
    torch.cuda.cudart = _HostOnlyRuntime
