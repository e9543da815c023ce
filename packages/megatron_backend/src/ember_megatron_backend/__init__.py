"""Ember training backend on megatron-core: models, weight mapping, scoring, training, checkpoints.

Submodules are imported on demand (``ember_megatron_backend.model``, ``.weights``, ...), so
importing the package itself does not import megatron-core.
"""

import ctypes
import importlib.util
import sys


def _hide_flash_mla_without_cuda_driver() -> None:
    """Let megatron-core import next to SGLang on a machine without the CUDA driver.

    The sglang extra installs sgl-flash-mla, whose `flash_mla` package dlopens its CUDA
    extension on import and raises OSError (libcuda.so.1 missing) rather than ImportError;
    megatron-core 0.16.1 (transformer/attention.py 82-89) catches only ImportError around
    `from flash_mla import ...`, so every megatron-core model import failed there. Where the
    driver is missing the kernels could not run anyway: the package is marked absent, which
    makes that import raise ImportError and megatron-core go on without FlashMLA.
    """
    if "flash_mla" in sys.modules or importlib.util.find_spec("flash_mla") is None:
        return
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        sys.modules["flash_mla"] = None


_hide_flash_mla_without_cuda_driver()
