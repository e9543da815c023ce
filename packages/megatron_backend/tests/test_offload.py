"""The trainer's offload for colocated rollouts, on a real MegatronWorker on CPU.

The offload moves only storages of its `device_type`; GPU runs use "cuda". Here the same code
runs with "cpu", so every storage it handles really is freed (resized to zero bytes) and
restored, and training after a round trip must match training without one, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from megatron_samples import algorithm, backend, make_samples, sampling

from ember_megatron_backend.offload import PARTS, StorageOffload, TrainerOffload
from ember_megatron_backend.worker import MegatronWorker


def _worker() -> MegatronWorker:
    # PPO: actor, reference (KL loss) and critic, each with its optimizer where it trains.
    alg = algorithm(advantage_estimator="ppo", use_kl_loss=True, kl_loss_coef=0.1)
    return MegatronWorker(backend(), alg, sampling())


def _params(worker: MegatronWorker) -> list[torch.Tensor]:
    return [p for m in (worker.actor, worker.ref, worker.critic) for p in m.parameters()]


def _state(worker: MegatronWorker) -> list[torch.Tensor]:
    return [
        t
        for o in (worker.actor_optimizer, worker.critic_optimizer)
        for s in o.optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    ]


def test_a_round_trip_frees_every_storage_and_training_continues_bit_for_bit(dist_env):
    samples = make_samples()
    torch.manual_seed(0)
    moved, still = _worker(), _worker()
    for worker in (moved, still):
        worker.train(0, worker.prepare(0, samples))
    params = _params(moved)
    state = _state(moved)
    grads = [p.main_grad for p in moved.actor.parameters()]
    assert state and all(torch.equal(a, b) for a, b in zip(params, _params(still), strict=True))
    kept_ids = [id(t) for t in state]

    offload = TrainerOffload(moved, device_type="cpu")
    freed_state = offload.offload("training_state")
    assert all(t.untyped_storage().nbytes() == 0 for t in state)
    assert all(g.untyped_storage().nbytes() == 0 for g in grads)
    assert all(p.untyped_storage().nbytes() > 0 for p in params)  # still there for a push
    freed_weights = offload.offload("weights")
    assert all(p.untyped_storage().nbytes() == 0 for p in params)
    weight_bytes = sum(
        t.untyped_storage().nbytes()
        for m in (still.actor, still.ref, still.critic)
        for t in {
            id(x.untyped_storage()): x for x in (*m.parameters(), *torch.nn.Module.buffers(m))
        }.values()
    )
    assert freed_weights == weight_bytes
    assert freed_state > sum(s.numel() * s.element_size() for s in _state(still))  # + grads
    assert offload.offload("weights") == 0  # nothing left to free

    assert offload.reload() == freed_state + freed_weights
    assert [id(t) for t in _state(moved)] == kept_ids
    assert all(torch.count_nonzero(g) == 0 for g in grads)
    for a, b in zip(params, _params(still), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(_state(moved), _state(still), strict=True):
        assert torch.equal(a, b)

    after = [w.train(1, w.prepare(1, samples)) for w in (moved, still)]
    assert after[0] == after[1]
    for a, b in zip(_params(moved), _params(still), strict=True):
        assert torch.equal(a, b)


def test_on_cpu_the_default_device_moves_nothing(dist_env):
    worker = _worker()
    worker.train(0, worker.prepare(0, make_samples()))
    offload = TrainerOffload(worker)  # "cuda": what colocated GPU runs use
    assert [offload.offload(part) for part in PARTS] == [0, 0]
    assert all(p.untyped_storage().nbytes() > 0 for p in _params(worker))
    assert offload.reload() == 0
    with pytest.raises(ValueError, match="expected one of"):
        offload.offload("activations")


def test_views_share_one_offload_and_dropped_storages_come_back_as_zeros():
    base = torch.arange(12.0)
    view = base[4:8]
    grad = torch.ones(6)
    offload = StorageOffload("cpu")
    assert offload.offload([base, view], [grad]) == 12 * 4 + 6 * 4
    assert offload.offloaded_bytes == 72 and view.untyped_storage().nbytes() == 0
    assert offload.reload() == 72
    assert view.tolist() == [4.0, 5.0, 6.0, 7.0] and grad.tolist() == [0.0] * 6
    assert offload.offload([base], skip=[view]) == 0  # a skipped storage stays
