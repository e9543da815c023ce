"""Collectives placed on the device a process group's backend accepts: every one the backend runs.

torch 2.14 ``distributed_c10d.py`` (``Backend.backend_capability``, ``BackendConfig``): a group
made for ``"nccl"`` registers the ``cuda`` device type only, so a CPU tensor handed to one of
its collectives raises "No backend type associated with device type cpu"; gloo groups take CPU
tensors. On GPUs every megatron-core group is NCCL (``parallel_state.create_group`` inherits
the default backend; only its ``*_GLOO`` data-parallel groups are gloo), while the worker's
bookkeeping (flags, step plans, metric sums, whitening statistics) lives on the CPU. So each
collective here moves its tensor to ``collective_device(group)``, runs there and brings the
result back to where the tensor came from. Object collectives and barriers need no placement
(torch picks the current CUDA device for NCCL itself); they are here too so that this module is
the backend's only caller of ``torch.distributed`` collectives.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "collective_device",
]


def _nccl_device() -> torch.device:
    # init_distributed() made LOCAL_RANK's GPU current; NCCL communicates on it.
    return torch.device("cuda", torch.cuda.current_device())


def collective_device(group: Any = None) -> torch.device:
    """The device `group`'s backend takes tensors on: this rank's GPU for NCCL, else the CPU.

    Args:
        group: A process group (None: the default group).
    """
    # megatron-core 0.16.1 utils.py (StragglerDetector) chooses the same way: "nccl" -> the
    # current CUDA device, anything else -> CPU.
    if dist.get_backend(group) == dist.Backend.NCCL:
        return _nccl_device()
    return torch.device("cpu")


def all_reduce(tensor: Tensor, *, op: Any = dist.ReduceOp.SUM, group: Any = None) -> Tensor:
    """Reduce `tensor` in place over `group`, on the device the group's backend accepts.

    Args:
        tensor: The local values; it keeps its device, dtype and identity.
        op: The reduction (``torch.distributed.ReduceOp``).
        group: The process group (None: the default group).

    Returns:
        `tensor`, now holding the reduced values.
    """
    target = collective_device(group)
    work = tensor if tensor.device == target else tensor.to(target)
    dist.all_reduce(work, op=op, group=group)
    if work is not tensor:
        tensor.copy_(work.to(tensor.device))
    return tensor


def all_gather(tensor: Tensor, group: Any = None) -> list[Tensor]:
    """Every rank's `tensor` (same shape and dtype on all ranks), in rank order of `group`.

    The pieces come back on `tensor`'s device whatever device the gather ran on.
    """
    target = collective_device(group)
    work = tensor.contiguous().to(target)
    pieces = [torch.empty_like(work) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, work, group=group)
    if target == tensor.device:
        return pieces
    return [piece.to(tensor.device) for piece in pieces]


def broadcast(tensor: Tensor, *, src: int, group: Any = None) -> Tensor:
    """Overwrite `tensor` with global rank `src`'s values on every rank of `group`, on the device
    the group's backend accepts.

    Args:
        tensor: The source's values on `src`, a buffer of the same shape and dtype elsewhere; it
            keeps its device, dtype and identity.
        src: The global rank that sends.
        group: The process group (None: the default group).

    Returns:
        `tensor`, now holding the source's values.
    """
    target = collective_device(group)
    work = tensor if tensor.device == target else tensor.to(target)
    dist.broadcast(work, src=src, group=group)
    if work is not tensor:
        tensor.copy_(work.to(tensor.device))
    return tensor


def all_gather_object(objects: list[Any], obj: Any, group: Any = None) -> None:
    """``torch.distributed.all_gather_object``: `objects[r]` becomes rank r's `obj`."""
    # torch 2.14 distributed_c10d.py _get_object_coll_device: NCCL groups serialise through the
    # current CUDA device (set by init_distributed), gloo groups through the CPU.
    dist.all_gather_object(objects, obj, group=group)


def broadcast_object_list(objects: list[Any], *, src: int, group: Any = None) -> None:
    """``torch.distributed.broadcast_object_list``: every rank's `objects` become global rank
    `src`'s."""
    # As all_gather_object: NCCL groups serialise through the current CUDA device.
    dist.broadcast_object_list(objects, src=src, group=group)


def barrier(group: Any = None) -> None:
    """``torch.distributed.barrier`` over `group`."""
    dist.barrier(group=group)
