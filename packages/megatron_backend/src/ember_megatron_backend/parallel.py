"""torch.distributed and megatron-core parallel-state setup: NCCL on GPUs, gloo on CPU."""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "ParallelConfig",
    "destroy_distributed",
    "device",
    "free_port",
    "init_distributed",
    "require_no_context_parallel",
    "uses_gpu",
]


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """Model-parallel sizes; data parallelism takes whatever the world size leaves."""

    tensor_parallel: int = 1
    """TP: attention heads and MLP columns split across ranks."""
    pipeline_parallel: int = 1
    """PP: layers split across ranks, run by megatron-core's 1F1B schedule (CPU and GPU)."""
    expert_parallel: int = 1
    """EP: MoE experts split across ranks."""
    expert_tensor_parallel: int | None = None
    """ETP: expert weights split across ranks; None means the same as tensor_parallel."""
    context_parallel: int = 1
    """CP: the sequence split across ranks (zigzag). Needs Transformer Engine attention (GPUs),
    refused without it; the worker does not split micro-batches over CP ranks yet."""
    seed: int = 1234
    """Seed of megatron-core's runtime RNG streams (its tracker's named streams and the GPU's
    default generator, with megatron-core's per-TP/EP-rank offsets): dropout and any other
    draw during training. Initial weights come from ``train.seed`` instead, which reseeds
    these streams for the duration of each model build only."""
    timeout_minutes: int = 30
    """Collective timeout."""

    def __post_init__(self) -> None:
        for key in (
            "tensor_parallel",
            "pipeline_parallel",
            "expert_parallel",
            "context_parallel",
            "timeout_minutes",
        ):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"parallel.{key} must be an int >= 1, got {value!r}")
        etp = self.expert_tensor_parallel
        if etp is not None and (not isinstance(etp, int) or isinstance(etp, bool) or etp < 1):
            raise ValueError(f"parallel.expert_tensor_parallel must be None or >= 1, got {etp!r}")

    @property
    def model_parallel_size(self) -> int:
        """Ranks one model replica spans outside the expert layers (TP x PP x CP)."""
        return self.tensor_parallel * self.pipeline_parallel * self.context_parallel


def uses_gpu() -> bool:
    """Whether this process computes on CUDA (the backend's single device switch)."""
    return torch.cuda.is_available()


def device() -> torch.device:
    """The device this rank computes on: its local CUDA device, or the CPU."""
    if uses_gpu():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (for a single-process rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_distributed(
    parallel: ParallelConfig | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
) -> None:
    """Initialise torch.distributed and megatron-core's parallel state for this process.

    On GPUs the backend is NCCL and the local CUDA device is ``LOCAL_RANK``; on CPU it is gloo
    and megatron-core's CUDA-only spots are patched (``ember_megatron_backend.cpu``). Rank and
    world size default to ``RANK``/``WORLD_SIZE`` from the environment; with neither set, a
    single-process group rendezvouses on a free port of 127.0.0.1. Calling it again after a
    successful call with the same layout is a no-op; another layout is an error (call
    ``destroy_distributed`` first).

    Args:
        parallel: Model-parallel sizes; defaults to no model parallelism.
        rank: This process's global rank.
        world_size: Number of processes.
        init_method: torch.distributed init method URL; defaults to ``env://`` when
            ``MASTER_ADDR`` is set, else a fresh ``tcp://127.0.0.1:<port>``.

    Raises:
        ValueError: if the world size is not a multiple of the model-parallel sizes, if context
            parallelism is asked for without Transformer Engine attention, or if this process is
            already initialised with another layout (both are named).
    """
    from ember_megatron_backend import import_megatron_core

    import_megatron_core()
    from megatron.core import parallel_state, tensor_parallel

    from ember_megatron_backend import cpu

    parallel = parallel or ParallelConfig()
    _check_context_parallel(parallel)
    if dist.is_initialized() and parallel_state.model_parallel_is_initialized():
        _check_same_layout(parallel, rank, world_size)
        return
    gpu = uses_gpu()
    if gpu:
        cpu.patch_missing_te_names()
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        cpu.apply_cpu_patches()

    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    _check_world(parallel, world_size)
    if not dist.is_initialized():
        if init_method is None:
            init_method = (
                "env://" if "MASTER_ADDR" in os.environ else f"tcp://127.0.0.1:{free_port()}"
            )
        dist.init_process_group(
            backend="nccl" if gpu else "gloo",
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(minutes=parallel.timeout_minutes),
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_parallel,
        pipeline_model_parallel_size=parallel.pipeline_parallel,
        context_parallel_size=parallel.context_parallel,
        expert_model_parallel_size=parallel.expert_parallel,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel,
        distributed_timeout_minutes=parallel.timeout_minutes,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(parallel.seed, force_reset_rng=True)


def _layout(parallel: ParallelConfig, rank: int, world_size: int) -> str:
    etp = parallel.expert_tensor_parallel or parallel.tensor_parallel
    return (
        f"rank {rank} of {world_size}, tensor_parallel={parallel.tensor_parallel}, "
        f"pipeline_parallel={parallel.pipeline_parallel}, "
        f"context_parallel={parallel.context_parallel}, "
        f"expert_parallel={parallel.expert_parallel}, expert_tensor_parallel={etp}"
    )


def _check_same_layout(parallel: ParallelConfig, rank: int | None, world_size: int | None) -> None:
    """Raise unless the initialised process group and parallel state match the request."""
    from megatron.core import parallel_state as ps

    current = ParallelConfig(
        tensor_parallel=ps.get_tensor_model_parallel_world_size(),
        pipeline_parallel=ps.get_pipeline_model_parallel_world_size(),
        context_parallel=ps.get_context_parallel_world_size(),
        expert_parallel=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel=ps.get_expert_tensor_parallel_world_size(),
    )
    have_rank, have_world = dist.get_rank(), dist.get_world_size()
    want_rank = have_rank if rank is None else rank
    want_world = have_world if world_size is None else world_size
    have = _layout(current, have_rank, have_world)
    want = _layout(parallel, want_rank, want_world)
    if have != want:
        raise ValueError(
            f"init_distributed: this process is already initialised as {have}; asked for {want} "
            "(call destroy_distributed() before changing the layout)"
        )


def destroy_distributed() -> None:
    """Tear down megatron-core's parallel state and the default process group."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _check_world(parallel: ParallelConfig, world_size: int) -> None:
    mp = parallel.model_parallel_size
    if world_size % mp:
        raise ValueError(
            f"world size {world_size} is not a multiple of tensor_parallel x pipeline_parallel x "
            f"context_parallel = {mp}"
        )
    etp = parallel.expert_tensor_parallel or parallel.tensor_parallel
    expert_mp = etp * parallel.expert_parallel * parallel.pipeline_parallel
    if world_size % expert_mp:
        raise ValueError(
            f"world size {world_size} is not a multiple of expert_tensor_parallel x "
            f"expert_parallel x pipeline_parallel = {expert_mp}"
        )


def _check_context_parallel(parallel: ParallelConfig) -> None:
    from ember_megatron_backend.model import uses_te_spec

    cp = parallel.context_parallel
    if cp > 1 and not uses_te_spec():
        # megatron-core 0.16.1 splits attention over CP ranks in TEDotProductAttention only; the
        # local DotProductAttention that runs without Transformer Engine has no CP path.
        where = "Transformer Engine is not installed" if uses_gpu() else "this rank has no GPU"
        raise ValueError(
            f"train.parallel.context_parallel={cp}: context parallelism needs Transformer "
            f"Engine attention on GPUs, and {where}; set train.parallel.context_parallel=1"
        )


def require_no_context_parallel() -> None:
    """Raise while the worker's context-parallel data path is missing (CP > 1 on GPUs with TE).

    Raises:
        NotImplementedError: under context parallelism.
    """
    from megatron.core import parallel_state as ps

    cp = ps.get_context_parallel_world_size()
    if cp > 1:
        # TODO: the zigzag split of packed micro-batches (ember_core.heads.zigzag_split) and the
        # gather of the heads' outputs over CP ranks; megatron-core runs CP with Transformer
        # Engine attention, which no machine of this project has to test them on.
        raise NotImplementedError(
            f"train.parallel.context_parallel={cp}: the worker does not split micro-batches "
            "over context-parallel ranks yet; set train.parallel.context_parallel=1"
        )
