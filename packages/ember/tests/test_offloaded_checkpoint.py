"""A colocated training rank saves its checkpoint while offloaded (the driver saves after
`MemoryHandoff.after_training`), and that checkpoint must load.

The real `TrainRank` class runs in this process on CPU. Its offload moves "cuda" storages on a
GPU; here it is given the same offload over "cpu" storages, so every tensor really has zero
bytes while the rank saves, as on a GPU.
"""

from __future__ import annotations

import pytest
import torch

import ember.actors
from ember.config import load_config
from ember_core.types import Sample
from ember_megatron_backend.offload import TrainerOffload
from ember_megatron_backend.parallel import destroy_distributed

pytestmark = pytest.mark.slow

SMALL = ["train.model_overrides.num_layers=2", "train.num_steps_per_rollout=1"]


def samples(vocab: int) -> list[Sample]:
    g = torch.Generator().manual_seed(3)
    out = []
    for k in range(4):
        length = int(torch.randint(8, 14, (1,), generator=g))
        response = 4
        out.append(
            Sample(
                tokens=torch.randint(0, vocab, (length,), generator=g).tolist(),
                response_length=response,
                index=k,
                group_index=k // 2,
                reward=float(k % 2),
                rollout_log_probs=(-torch.rand(response, generator=g)).tolist(),
            )
        )
    return out


@pytest.fixture
def rank():
    had_group = torch.distributed.is_initialized()
    config, _ = load_config("default", overrides=SMALL)
    actor = ember.actors.TrainRank(config.to_dict(), rank=0, world_size=1, threads=None)
    actor.setup(None)
    try:
        yield actor
    finally:
        if not had_group:
            destroy_distributed()


def test_an_offloaded_rank_writes_a_checkpoint_that_loads_bit_for_bit(rank, tmp_path):
    worker = rank.worker
    rank.prepare(0, samples(worker.model_config.vocab_size))
    rank.train(0)
    params = [p.detach().clone() for p in worker.actor.parameters()]
    # items(), as the offload does: on a GPU `optimizer.state` is megatron-core 0.16.1's
    # ChainedOptimizer ProxyDict, which has no values() (optimizer/optimizer.py 1038-1073).
    moments = [
        t.clone()
        for _, s in worker.actor_optimizer.optimizer.state.items()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    ]
    assert moments, "a step ran, so the optimizer holds state"
    rank._offload = TrainerOffload(worker, device_type="cpu")  # what "cuda" does on a GPU
    assert rank.offload("training_state") > 0 and rank.offload("weights") > 0

    rank.save(str(tmp_path / "train"))
    assert all(p.untyped_storage().nbytes() == 0 for p in worker.actor.parameters())

    rank.reload()
    with torch.no_grad():
        for p in worker.actor.parameters():
            p.add_(1.0)
    rank.load(str(tmp_path / "train"))
    for a, b in zip(worker.actor.parameters(), params, strict=True):
        assert torch.equal(a, b)
    loaded = [
        t
        for _, s in worker.actor_optimizer.optimizer.state.items()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    ]
    assert len(loaded) == len(moments)
    assert all(torch.equal(a, b) for a, b in zip(loaded, moments, strict=True))
