"""A weight receiver that joins and receives the way an sglang 0.5.23 server does.

Run as `python sglang_receiver.py ADDRESS PORT RANK WORLD_SIZE GROUP OUT BUCKETS_JSON`: it joins
the group as sglang's `init_custom_process_group` does (utils/common.py: torch's tcp://
rendezvous, `PrefixStore(group_name)`, torch's `_new_process_group_helper`, then the group's
ranks mapped one to one), then for each bucket of BUCKETS_JSON (a list of {names, dtypes,
shapes}) allocates the buffer as `FlattenedTensorBucket.empty` does (weight_sync/
tensor_bucket.py: refusing unaligned offsets), receives it with `broadcast(src=0)` and cuts
it into tensors. It saves {name: tensor} to OUT with torch.save.
"""

from __future__ import annotations

import datetime
import json
import sys

import torch
import torch.distributed as dist


def join(address: str, port: int, rank: int, world_size: int, group_name: str):
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = datetime.timedelta(seconds=60)
    url = f"tcp://{address}:{port}"
    store, rank, world_size = next(rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend("gloo"),
        store,
        group_name=group_name,
        backend_options=None,
        timeout=timeout,
        device_id=None,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def empty_bucket(names, dtypes, shapes):
    offset, spans = 0, []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        dtype = getattr(torch, dtype)
        if offset % dtype.itemsize:
            raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, {dtype}")
        size = torch.Size(shape).numel() * dtype.itemsize
        spans.append((name, dtype, torch.Size(shape), offset, offset + size))
        offset += size
    return torch.empty(offset, dtype=torch.uint8), spans


def main(argv: list[str]) -> None:
    address, port, rank, world_size, group_name, out, buckets = argv
    pg = join(address, int(port), int(rank), int(world_size), group_name)
    received = {}
    for bucket in json.loads(buckets):
        flat, spans = empty_bucket(bucket["names"], bucket["dtypes"], bucket["shapes"])
        dist.broadcast(flat, src=0, group=pg)
        for name, dtype, shape, start, end in spans:
            received[name] = flat[start:end].view(dtype).reshape(shape).clone()
    torch.save(received, out)
    # Tear the group down before exiting: a gloo group left alive at interpreter exit can abort
    # the process from its worker threads ("terminate called without an active exception").
    dist.destroy_process_group(pg)


if __name__ == "__main__":
    main(sys.argv[1:])
