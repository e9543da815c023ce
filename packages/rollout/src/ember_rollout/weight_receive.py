"""How the embedded engine receives the weights a training rank broadcasts: joining its weight
group over gloo, and cutting a flattened bucket into named tensors."""

from __future__ import annotations

import datetime
import math
from collections.abc import Sequence
from typing import Any

import torch

WEIGHT_GROUP_BACKEND = "gloo"
"""The backend the hf engine receives broadcast weights over (into CPU buffers)."""
WEIGHT_GROUP_TIMEOUT = datetime.timedelta(minutes=30)
"""How long joining a weight group, or one broadcast, may wait for the other members."""
BUCKET_LOAD_FORMAT = "flattened_bucket"
"""One broadcast per bucket of tensors laid out back to back (sglang 0.5.23's name)."""


def join_weight_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout: datetime.timedelta = WEIGHT_GROUP_TIMEOUT,
) -> Any:
    """Join weight group `group_name` as `rank` over gloo; returns its backend. Blocks until
    every member has joined.

    The store keys are those sglang 0.5.23's `init_custom_process_group` (utils/common.py)
    leads to, so this engine, the sending training rank and SGLang servers meet in one group:
    the TCP store that rank 0 hosts, under `PrefixStore(group_name)`, then torch 2.14
    `_new_process_group_helper`'s `PrefixStore(f"{group_name}/")` and, for gloo's backend,
    `PrefixStore("cpu/")`. The group is a backend object of its own: no torch.distributed
    default group is needed.
    """
    import torch.distributed as dist

    store = dist.TCPStore(
        host_name=master_address,
        port=master_port,
        world_size=world_size,
        is_master=False,
        timeout=timeout,
    )
    keyed = dist.PrefixStore(
        "cpu/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store))
    )
    return dist.ProcessGroupGloo(keyed, rank, world_size, timeout)


def bucket_layout(
    names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
) -> list[tuple[str, torch.dtype, tuple[int, ...], int, int]]:
    """(name, dtype, shape, start byte, end byte) of each tensor of a flattened bucket.

    The tensors lie back to back, as sglang 0.5.23's `FlattenedTensorBucket.empty`
    (weight_sync/tensor_bucket.py) lays them out; it refuses the same inputs.

    Raises:
        ValueError: Lists of different lengths, an empty bucket, a name that is not a torch
            dtype, a negative dimension, or a tensor at a byte offset its dtype's size does not
            divide; names the tensor.
    """
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(
            f"{len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes: one of each "
            "per tensor"
        )
    if not names:
        raise ValueError("an empty bucket")
    layout = []
    offset = 0
    for name, dtype_name, shape in zip(names, dtypes, shapes, strict=True):
        dtype = getattr(torch, str(dtype_name), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{name}: dtype {dtype_name!r} is not a torch dtype")
        dims = tuple(int(d) for d in shape)
        if any(d < 0 for d in dims):
            raise ValueError(f"{name}: negative dimension in shape {list(dims)}")
        if offset % dtype.itemsize:
            raise ValueError(f"{name}: byte offset {offset} is not aligned for {dtype}")
        size = math.prod(dims) * dtype.itemsize
        layout.append((name, dtype, dims, offset, offset + size))
        offset += size
    return layout


def receive_bucket(group: Any, flat: torch.Tensor) -> None:
    """Receive `flat` from rank 0 of `group` (blocking)."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    group.broadcast([flat], options).wait()
