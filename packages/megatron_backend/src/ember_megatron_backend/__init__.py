"""Ember training backend on megatron-core: models, weight mapping, scoring, training, checkpoints.

Submodules are imported on demand (``ember_megatron_backend.model``, ``.weights``, ...), so
importing the package itself does not import megatron-core.
"""

import contextlib
import ctypes
import importlib.util
import sys
from collections.abc import Iterator


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


@contextlib.contextmanager
def _hidden(module: str) -> Iterator[None]:
    """Make `import module` raise ImportError inside the block (unless it is already loaded)."""
    if module in sys.modules:
        yield
        return
    sys.modules[module] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if sys.modules.get(module, 0) is None:
            del sys.modules[module]


@contextlib.contextmanager
def _eager_compile() -> Iterator[None]:
    """`torch.compile` returns the function unchanged inside the block."""
    import torch

    def eager(model=None, **_):
        return model if model is not None else (lambda fn: fn)

    compile_ = torch.compile
    torch.compile = eager
    try:
        yield
    finally:
        torch.compile = compile_


def import_megatron_core() -> None:
    """Import megatron-core without the parts training never runs; a no-op once imported.

    On a 2-core AMD EPYC without CUDA, `import megatron.core` with torch took 18.5-20.3 s, against
    8.0-9.7 s this way (tools/README.md, start-up). Two things made up the difference:

    - megatron-core 0.16.1 binds `jit_fuser = torch.compile` (core/jit.py) and decorates its
      fusions with it at import. Each decoration imports torch._dynamo and torch._inductor,
      about 6 s. On CPU the fusions are off (model.py) or tiny, so they are imported eager:
      the same functions, uncompiled. With CUDA they stay compiled.
    - Its inference context (inference/contexts/dynamic_context.py) imports flashinfer when
      it is installed (the sglang extra installs it), about 6 s. Training never uses it.
      flashinfer is hidden during the import only, so SGLang code in the same process still
      imports it.
    """
    if "megatron.core" in sys.modules:
        return
    import torch

    with contextlib.ExitStack() as stack:
        stack.enter_context(_hidden("flashinfer"))
        if not torch.cuda.is_available():
            stack.enter_context(_eager_compile())
        import megatron.core  # noqa: F401
