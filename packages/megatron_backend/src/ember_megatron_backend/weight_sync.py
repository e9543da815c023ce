"""Trainer -> rollout engine weight transfer: flattened buckets and the group that carries them.

The sending rank packs the actor's weights (HF names, as ``iter_hf_weights`` yields them) into
flattened buckets: one uint8 tensor holding the bytes of several tensors back to back, with
their names, dtypes and shapes on the side. That is the layout of sglang 0.5.23's
``FlattenedTensorBucket`` (weight_sync/tensor_bucket.py): a receiver that knows the names,
dtypes and shapes allocates the same buffer (``FlattenedTensorBucket.empty``), receives it in
one broadcast and cuts it back into tensors. Tensors sit at byte offsets that their dtype's
item size divides (sglang refuses others), so a bucket holds one dtype.

The bucket travels over a process group of its own, ``WeightGroup``: this rank (rank 0, the
source) plus every engine rank, rendezvousing at a TCP store on the sender's node. The store
keys follow what sglang's `/init_weights_update_group` builds on the engine side (see
``group_store``), so SGLang servers, the embedded engine and this rank meet in one group.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "BUCKET_LOAD_FORMAT",
    "WeightBucket",
    "WeightGroup",
    "bucket_weights",
    "dtype_name",
    "group_store",
    "is_weight_sender",
]

BUCKET_LOAD_FORMAT = "flattened_bucket"
"""The `load_format` that tells a receiver one broadcast carries a whole flattened bucket
(sglang 0.5.23 weight_updater.py `receive_weights_from_distributed`)."""

BACKEND_DEVICES = {"gloo": "cpu", "nccl": "cuda"}
"""The device whose backend a process group of each kind holds: torch 2.14
(distributed_c10d.py `_new_process_group_helper`) creates a single backend for the first
device the backend supports and keys its store under `<device>/`."""


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype as sglang's receivers name it (`getattr(torch, name)`): "bfloat16", ..."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class WeightBucket:
    """Tensors flattened into one buffer, in order, with what a receiver needs to cut it."""

    names: list[str]
    """HF names."""
    dtypes: list[str]
    """`dtype_name` of each tensor (all the same within a bucket)."""
    shapes: list[list[int]]
    """Shape of each tensor."""
    flat: Tensor
    """uint8 [sum of the tensors' bytes]: tensor i's bytes start where tensor i-1's end."""

    @property
    def nbytes(self) -> int:
        return self.flat.numel()


def _flatten(
    pending: list[tuple[str, Tensor]], dtype: torch.dtype | None, device: torch.device | None
) -> WeightBucket:
    """Copy the tensors, cast to `dtype`, into one buffer: one pass over each tensor."""
    wire = dtype or pending[0][1].dtype
    where = device if device is not None else pending[0][1].device
    sizes = [t.numel() * wire.itemsize for _, t in pending]
    flat = torch.empty(sum(sizes), dtype=torch.uint8, device=where)
    offset = 0
    for (_, tensor), size in zip(pending, sizes, strict=True):
        flat[offset : offset + size].view(wire).view(tensor.shape).copy_(tensor)
        offset += size
    return WeightBucket(
        names=[name for name, _ in pending],
        dtypes=[dtype_name(wire)] * len(pending),
        shapes=[list(t.shape) for _, t in pending],
        flat=flat,
    )


def bucket_weights(
    named_tensors: Iterable[tuple[str, Tensor]],
    bucket_bytes: int,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> Iterator[WeightBucket]:
    """Group (name, tensor) pairs, in order, into flattened buckets of at most `bucket_bytes`.

    A tensor larger than `bucket_bytes` gets a bucket of its own, and a change of dtype starts
    a new bucket. At most one bucket's tensors are held at a time (plus the buffer they are
    copied into), so the iterator can be fed straight from the gathers of ``iter_hf_weights``.

    Args:
        named_tensors: (name, tensor) pairs.
        bucket_bytes: Most bytes one bucket holds (unless one tensor alone is larger).
        dtype: Cast every tensor to this dtype (the engine's) as it is copied into the bucket;
            None keeps each tensor's.
        device: Where the buffers live (default: the first tensor's device of each bucket).

    Raises:
        ValueError: `bucket_bytes` < 1, or a name that appears twice.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes}: expected >= 1")
    target = torch.device(device) if device is not None else None
    seen: set[str] = set()
    pending: list[tuple[str, Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        if name in seen:
            raise ValueError(f"weight {name!r} appears twice in one transfer")
        seen.add(name)
        tensor = tensor.detach()
        wire = dtype or tensor.dtype
        nbytes = tensor.numel() * wire.itemsize
        if pending and (wire != (dtype or pending[0][1].dtype) or size + nbytes > bucket_bytes):
            yield _flatten(pending, dtype, target)
            pending, size = [], 0
        pending.append((name, tensor))
        size += nbytes
    if pending:
        yield _flatten(pending, dtype, target)


def is_weight_sender() -> bool:
    """Whether this rank broadcasts the weights: the rank with tensor-, context- and
    data-parallel rank 0 (and pipeline rank 0), which holds every weight once the worker's
    ``hf_weights`` has gathered them over TP/ETP/EP (and, under pipeline parallelism, brought
    every stage's to every rank of the pipeline group). The other ranks iterate in step (the
    gathers are collective) and send nothing.
    """
    from megatron.core import parallel_state as ps

    return (
        ps.get_tensor_model_parallel_rank() == 0
        and ps.get_data_parallel_rank(with_context_parallel=True) == 0
        and ps.get_pipeline_model_parallel_rank() == 0
    )


def group_store(store: Any, group_name: str, backend: str) -> Any:
    """The store view a backend of weight group `group_name` keys its rendezvous under.

    sglang 0.5.23 joins with `init_custom_process_group` (utils/common.py): the rendezvous
    store, wrapped in `PrefixStore(group_name)`, passed to torch's `_new_process_group_helper`,
    which adds `PrefixStore(f"{group_name}/")` and then `PrefixStore(f"{device}/")` for the
    backend it creates (`BACKEND_DEVICES`). Every member must build the same chain.
    """
    if backend not in BACKEND_DEVICES:
        raise ValueError(f"backend={backend!r}: expected one of {sorted(BACKEND_DEVICES)}")
    inner = dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store))
    return dist.PrefixStore(f"{BACKEND_DEVICES[backend]}/", inner)


def _broadcast_options() -> Any:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    return options


class WeightGroup:
    """Rank 0 (the source) of a process group with the engines, outside the default group.

    The group is a backend object of its own (no `torch.distributed` default group is needed
    or touched), so the training ranks' own group is unaffected and a rank can build a new
    weight group whenever the engines change.
    """

    def __init__(self, name: str, backend: str, world_size: int, pg: Any, store: Any) -> None:
        self.name = name
        self.backend = backend
        self.world_size = world_size
        self._pg = pg
        self._store = store  # the TCP store server lives as long as the group

    @classmethod
    def create(
        cls,
        *,
        master_address: str,
        master_port: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout: datetime.timedelta,
    ) -> WeightGroup:
        """Host the rendezvous at `master_address:master_port` and join as rank 0.

        Blocks until all `world_size` members have joined: start the engines' joins
        (`/init_weights_update_group`, or the embedded engine's) before calling it.

        Raises:
            ValueError: An unknown backend, or a world of fewer than two members.
        """
        if world_size < 2:
            raise ValueError(f"world_size={world_size}: a weight group needs engines to send to")
        if backend not in BACKEND_DEVICES:
            raise ValueError(f"backend={backend!r}: expected one of {sorted(BACKEND_DEVICES)}")
        # torch 2.14 rendezvous.py `_create_c10d_store`: rank 0 hosts the TCP store; the server
        # listens on every interface of this node, the members connect to master_address.
        store = dist.TCPStore(
            host_name=master_address,
            port=master_port,
            world_size=world_size,
            is_master=True,
            timeout=timeout,
            multi_tenant=True,
        )
        keyed = group_store(store, group_name, backend)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = False
            options._timeout = timeout
            pg = dist.ProcessGroupNCCL(keyed, 0, world_size, options)
        else:
            pg = dist.ProcessGroupGloo(keyed, 0, world_size, timeout)
        return cls(group_name, backend, world_size, pg, store)

    def broadcast(self, bucket: WeightBucket) -> Any:
        """Start broadcasting `bucket.flat` to every member; returns the torch `Work` to wait on.

        The receivers must know the bucket's names, dtypes and shapes beforehand (they allocate
        the buffer from them). `bucket.flat` must be on the backend's device: CPU for gloo, the
        rank's GPU for NCCL.
        """
        device = BACKEND_DEVICES[self.backend]
        if bucket.flat.device.type != device:
            raise ValueError(
                f"weight group {self.name} ({self.backend}) sends {device} tensors; the bucket "
                f"is on {bucket.flat.device}"
            )
        if self._pg is None:
            raise ValueError(f"weight group {self.name} was aborted; form a new one")
        return self._pg.broadcast([bucket.flat], _broadcast_options())

    def abort(self) -> None:
        """Abort the group after a failed broadcast: its pending work is dropped and its
        connections closed, so members blocked receiving from this rank fail instead of
        waiting for the group's timeout (over gloo; an NCCL member still waits for its own
        watchdog, as ncclCommAbort reaches only this rank's communicator). Later calls do
        nothing.

        torch 2.14's ProcessGroupGloo.abort (and .shutdown) leave the connections open: a
        member blocked receiving fails only once the group's last reference is gone, the group
        and every Work it returned (measured: 17 s later when the sender process exited, at
        once when it dropped them). This drops the group's; the caller must hold no Work of
        it (`TrainRank._broadcast`)."""
        if self._pg is None:
            return
        pg, self._pg = self._pg, None
        pg.abort()  # torch 2.14: ProcessGroupGloo.abort / ProcessGroupNCCL.abort
        self._store = None

    @property
    def device(self) -> torch.device:
        """Where `broadcast` expects the buckets."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
