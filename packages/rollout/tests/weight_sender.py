"""A trainer stand-in that broadcasts flattened weight buckets to engines over gloo.

Run as `python weight_sender.py PORT WORLD_SIZE GROUP BUCKETS_PT`: it hosts the rendezvous on
127.0.0.1:PORT, joins group GROUP as rank 0, and broadcasts each uint8 tensor of the list saved
in BUCKETS_PT, in order. `join_group` is also how the CPU stand-in for an SGLang server
(`packages/ember/tests/fake_sglang_server.py`) joins as a receiver.
"""

from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist

TIMEOUT = datetime.timedelta(seconds=120)


def join_group(address: str, port: int, rank: int, world_size: int, group_name: str):
    """Join weight group `group_name` over gloo the way sglang 0.5.23 joins one
    (utils/common.py `init_custom_process_group`): torch's tcp:// rendezvous, the group's keys
    under `PrefixStore(group_name)`, torch's process-group helper, ranks mapped to themselves.
    Rank 0 hosts the store and returns once all `world_size` ranks have joined."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    store, rank, world_size = next(
        rendezvous(f"tcp://{address}:{port}", rank, world_size, timeout=TIMEOUT)
    )
    store.set_timeout(TIMEOUT)
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend("gloo"),
        PrefixStore(group_name, store),
        group_name=group_name,
        timeout=TIMEOUT,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def main(port: str, world_size: str, group_name: str, buckets: str) -> None:
    pg = join_group("127.0.0.1", int(port), 0, int(world_size), group_name)
    for flat in torch.load(buckets):
        dist.broadcast(flat, src=0, group=pg)
    # Tear the group down before exiting: gloo threads still alive at interpreter exit can
    # abort the process ("terminate called without an active exception").
    dist.destroy_process_group(pg)


if __name__ == "__main__":
    main(*sys.argv[1:])
