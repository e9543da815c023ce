"""Run megatron-core 0.16.1 on CPU: the CUDA-only spots it has, handled one by one.

megatron-core assumes a CUDA device in a handful of places that a tiny GPTModel (local spec,
SequentialMLP, RMSNorm, QK-norm, RoPE, SwiGLU experts) reaches on its forward and backward
pass. ``apply_cpu_patches()`` replaces exactly those spots and nothing else; it is idempotent
and refuses to run when CUDA is available, so GPU runs always use megatron-core unchanged.

The spots (megatron-core 0.16.1, torch 2.14 CPU build):

1. ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to ``torch.cuda.current_device()`` on the
   first forward. Replaced by the same computation left on the device ``inv_freq`` lives on.
2. ``GlobalMemoryBuffer.get_tensor`` allocates its scratch buffer on
   ``torch.cuda.current_device()``. Replaced by the same buffer on CPU.
3. ``CudaRNGStatesTracker.add`` / ``fork`` read and write the CUDA generator state (used for
   weight init and dropout under model parallelism, and by the MoE router). Replaced by the same
   named-state bookkeeping over the CPU generator, so ``fork(name)`` still gives each name its
   own reproducible stream.
4. ``get_default_causal_mask`` (``transformer.utils``, imported by name into
   ``fusions.fused_softmax``) builds its mask with ``device="cuda"``; the softmax calls it when
   the attention mask is ``None``. The backend always passes an explicit mask on CPU (a padded
   [B, S] batch and one causal mask); both names are still rebound to a CPU version so
   a call without a mask behaves as on GPU instead of failing on the driver.
5. ``moe.moe_utils.te_general_gemm`` is only bound when Transformer Engine imports, yet
   ``RouterGatingLinearFunction`` reads it on every router forward, so every MoE forward without
   TE raises ``NameError``. Bound to ``None``, which selects the plain ``torch.mm`` path. This one
   is not CPU specific, so ``patch_missing_te_names()`` is applied on GPU too when TE is absent.
   Likewise ``transformer.multi_latent_attention`` sets ``HAVE_TE = True`` whenever megatron's
   TE extension module imports, which it does without TE (binding ``TELinear`` to a mock), and
   then ``isinstance(..., TELinear)`` fails building any MLA layer: it is set to whether
   Transformer Engine imports.
6. ``moe.router.Router.gating`` moves the router weight (and bias) to
   ``torch.cuda.current_device()`` whenever it finds them on CPU, on every forward. Replaced by
   the same gating without the move (router dtype ``moe_router_dtype`` still honoured).
7. ``DistributedDataParallel`` allocates its contiguous gradient buffers (``main_grad``) with
   ``device=torch.cuda.current_device()`` in ``_ParamAndGradBuffer.__init__``, and ``TopKRouter``
   its expert-bias buffers (sigmoid routers with a bias: DeepSeek-V3, GLM-4.5) the same way. Not
   patched globally: ``cuda_device_is_cpu()`` makes ``torch.cuda.current_device`` answer
   ``"cpu"`` only while a DDP wrapper or a model is being built (the call would raise there
   otherwise). Gradient
   reduction itself (gloo all-reduce of the buffers) needs nothing. megatron-core's optimizer
   wrappers allocate on CUDA in many places, so CPU runs use torch's AdamW instead
   (``ember_megatron_backend.optimizer``).
8. Activation recompute (``recompute_granularity``) runs through
   ``tensor_parallel.random.CheckpointFunction``, which saves the CUDA generator state with
   ``_get_cuda_rng_state`` in the forward and restores it with ``_set_cuda_rng_state`` before
   recomputing in the backward; both initialise CUDA. Replaced by a no-op pair: on CPU there is
   no CUDA generator, and the CPU generator and the tracker's named states (spot 3) are still
   saved and restored by the same code, so a recompute draws what the forward drew.

9. ``tensor_parallel.mappings`` allocates the outputs of its gathers and scatters (the MoE
   allgather dispatcher's token gather under TP/EP, sequence-parallel regions) with
   ``device=torch.cuda.current_device()``, and ``YarnRotaryEmbedding.get_emb`` (YaRN under
   multi-latent attention) moves its frequencies there on the first forward. Those two modules
   alone see a ``torch`` whose ``cuda.current_device()`` is the CPU; everything else they read
   is torch itself.
10. The pipeline schedules (``pipeline_parallel/schedules.py``) count tokens in a
   ``torch.zeros(..., device="cuda")``, and their point-to-point layer
   (``pipeline_parallel/p2p_communication.py``) allocates its receive buffers and exchanged
   shapes on ``torch.cuda.current_device()`` and calls ``torch.cuda.synchronize()`` after each
   shape exchange (and after batched sends, ``batch_p2p_sync``). Those two modules see the
   ``torch`` of spot 9, whose ``cuda.synchronize()`` does nothing and whose ``zeros`` puts a
   tensor asked for on ``"cuda"`` on the CPU. The sends and receives themselves are gloo's:
   gloo has no coalescing, so torch's ``batch_isend_irecv`` (megatron-core's default
   ``batch_p2p_comm``) issues the same ``isend``/``irecv`` one by one (torch 2.14
   ``distributed_c10d.py``), which gloo runs asynchronously; that default stays.
11. ``LanguageModule.setup_embeddings_and_output_layer`` (tied input and output embeddings
   under pipeline parallelism: the last stage keeps a copy of the embedding, zeroed, then
   all-reduced with the first stage's over the embedding group) moves that weight with
   ``weight.data.cuda()`` before the all-reduce. Replaced by megatron-core's method with the
   embedding group hidden from it, followed by the same all-reduce on the CPU tensor. The
   training-time reduction of the two copies' gradients (``finalize_model_grads``) needs
   nothing.

Model options that megatron-core only supports on CUDA are chosen in ``model.py``, not patched:
``moe_token_dispatcher_type="allgather"`` (the alltoall dispatcher creates a ``torch.cuda.Stream``
in its constructor), ``use_cpu_initialization=True`` and local ``DotProductAttention`` (which
refuses ``PackedSeqParams``, so without TE the samples go in as a right-padded [B, S] batch
with one causal mask instead of a packed "thd" one).
"""

from __future__ import annotations

import contextlib
import logging
from functools import reduce
from operator import mul

import torch

from ember_megatron_backend import comm

__all__ = [
    "apply_cpu_patches",
    "cpu_patches_applied",
    "cuda_device_is_cpu",
    "patch_missing_te_names",
]

_log = logging.getLogger(__name__)
_APPLIED = False


def cpu_patches_applied() -> bool:
    """Whether ``apply_cpu_patches`` has run in this process."""
    return _APPLIED


def patch_missing_te_names() -> None:
    """Bind the names megatron-core reads as if Transformer Engine were there (spot 5)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    from megatron.core.transformer import multi_latent_attention

    if not isinstance(multi_latent_attention.TELinear, type):
        multi_latent_attention.HAVE_TE = False


def apply_cpu_patches() -> None:
    """Make megatron-core run on CPU. Idempotent; raises if CUDA is available.

    Raises:
        RuntimeError: if a CUDA device is available (GPU runs must not be patched).
    """
    global _APPLIED
    if _APPLIED:
        return
    if torch.cuda.is_available():
        raise RuntimeError("apply_cpu_patches() is for CPU-only runs; CUDA is available here")

    from megatron.core import utils as mcore_utils
    from megatron.core.fusions import fused_softmax
    from megatron.core.models.common.embeddings import (
        rotary_pos_embedding,
        yarn_rotary_pos_embedding,
    )
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.pipeline_parallel import p2p_communication, schedules
    from megatron.core.tensor_parallel import mappings
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer import utils as transformer_utils
    from megatron.core.transformer.moe import router

    rotary_pos_embedding.RotaryEmbedding.get_emb = _rotary_get_emb
    mcore_utils.GlobalMemoryBuffer.get_tensor = _global_buffer_get_tensor
    mcore_random.CudaRNGStatesTracker.add = _tracker_add
    mcore_random.CudaRNGStatesTracker.fork = _tracker_fork
    transformer_utils.get_default_causal_mask = _default_causal_mask
    fused_softmax.get_default_causal_mask = _default_causal_mask  # imported there by name
    router.Router.gating = _router_gating
    mappings.torch = _TorchOnCpu()
    yarn_rotary_pos_embedding.torch = _TorchOnCpu()
    p2p_communication.torch = schedules.torch = _TorchOnCpu()
    mcore_random._get_cuda_rng_state = _no_cuda_rng_state
    mcore_random._set_cuda_rng_state = _set_no_cuda_rng_state
    global _MCORE_SETUP_EMBEDDINGS
    _MCORE_SETUP_EMBEDDINGS = LanguageModule.setup_embeddings_and_output_layer
    LanguageModule.setup_embeddings_and_output_layer = _setup_embeddings_and_output_layer
    patch_missing_te_names()
    _APPLIED = True
    _log.info("megatron-core CPU patches applied")


@contextlib.contextmanager
def cuda_device_is_cpu():
    """While held, ``torch.cuda.current_device()`` returns ``"cpu"`` (spot 7); CPU runs only.

    Raises:
        RuntimeError: if a CUDA device is available.
    """
    if torch.cuda.is_available():
        raise RuntimeError("cuda_device_is_cpu() is for CPU-only runs; CUDA is available here")
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = original


# Spot 1 ------------------------------------------------------------------------------------------
def _rotary_get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)  # [S, dim/2]
    if not self.rotary_interleaved:
        emb = torch.cat((freqs, freqs), dim=-1)
    else:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    return emb[:, None, None, :]  # [S, 1, 1, dim]


# Spot 2 ------------------------------------------------------------------------------------------
def _global_buffer_get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
    required_len = reduce(mul, tensor_shape, 1)
    buf = self.buffer.get((name, dtype))
    if buf is None or buf.numel() < required_len:
        buf = torch.empty(required_len, dtype=dtype, device="cpu", requires_grad=False)
        self.buffer[(name, dtype)] = buf
    return buf[0:required_len].view(*tensor_shape)


# Spot 3 ------------------------------------------------------------------------------------------
def _tracker_add(self, name: str, seed: int) -> None:
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    if name in self.states_:
        raise Exception(f"rng state {name} already exists")
    self.seeds_.add(seed)
    self.states_[name] = torch.Generator(device="cpu").manual_seed(seed).get_state()


@contextlib.contextmanager
def _tracker_fork(self, name: str = "model-parallel-rng"):  # megatron's default name
    if name not in self.states_:
        raise Exception(f"rng state {name} is not added")
    outer_state = torch.get_rng_state()
    torch.set_rng_state(self.states_[name])
    try:
        yield
    finally:
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outer_state)


# Spot 4 ------------------------------------------------------------------------------------------
def _default_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


# Spot 6 ------------------------------------------------------------------------------------------
_ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


def _router_gating(self, input: torch.Tensor) -> torch.Tensor:
    from megatron.core.transformer.moe.moe_utils import router_gating_linear

    router_dtype = _ROUTER_DTYPES.get(self.config.moe_router_dtype, input.dtype)
    return router_gating_linear(input, self.weight, self.bias, router_dtype)


# Spot 8 ------------------------------------------------------------------------------------------
def _no_cuda_rng_state(device=None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


def _set_no_cuda_rng_state(new_state: torch.Tensor, device=None, graph_safe: bool = False) -> None:
    return None


# Spots 9 and 10 -----------------------------------------------------------------------------------
class _CpuCuda:
    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def synchronize(device: object = None) -> None:
        return None

    def __getattr__(self, name: str) -> object:
        return getattr(torch.cuda, name)


class _TorchOnCpu:
    """``torch`` as the modules of spots 9 and 10 see it on CPU: the current device is the CPU,
    synchronising it does nothing, and ``zeros`` asked for ``"cuda"`` allocate there."""

    cuda = _CpuCuda()

    @staticmethod
    def zeros(*args: object, **kwargs: object) -> torch.Tensor:
        where = kwargs.get("device")
        if where is not None and torch.device(where).type == "cuda":
            kwargs["device"] = "cpu"
        return torch.zeros(*args, **kwargs)

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)


# Spot 11 -----------------------------------------------------------------------------------------
_MCORE_SETUP_EMBEDDINGS = None
"""megatron-core's ``LanguageModule.setup_embeddings_and_output_layer``."""


def _setup_embeddings_and_output_layer(self) -> None:
    # megatron-core asks `_is_in_embd_group` once, only where it then moves the weight and
    # all-reduces it (tied, or multi-token prediction, under PP): answer no, and remember.
    reached: list[bool] = []

    def in_embedding_group() -> bool:
        reached.append(type(self)._is_in_embd_group(self))
        return False

    self._is_in_embd_group = in_embedding_group
    try:
        _MCORE_SETUP_EMBEDDINGS(self)
    finally:
        del self._is_in_embd_group
    if any(reached):
        comm.all_reduce(self.shared_embedding_or_output_weight().data, group=self.embd_group)
