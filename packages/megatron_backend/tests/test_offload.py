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
    # items(), as the offload does: on a GPU `optimizer.state` is megatron-core 0.16.1's
    # ChainedOptimizer ProxyDict, which has no values() (optimizer/optimizer.py 1038-1073).
    return [
        t
        for o in (worker.actor_optimizer, worker.critic_optimizer)
        for _, s in o.optimizer.state.items()
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


def _optimizer_state(worker: MegatronWorker) -> dict:
    return {
        role: o.state_dict()
        for role, o in (("actor", worker.actor_optimizer), ("critic", worker.critic_optimizer))
    }


def _equal_nests(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal_nests(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_equal_nests(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_an_offloaded_trainer_saves_from_its_host_copies_and_loads_bit_for_bit(dist_env, tmp_path):
    samples = make_samples()
    torch.manual_seed(0)
    moved, still = _worker(), _worker()
    for worker in (moved, still):
        worker.train(0, worker.prepare(0, samples))
    offload = TrainerOffload(moved, device_type="cpu")
    offload.offload("training_state")
    offload.offload("weights")
    assert offload.offloaded

    # What a colocated run does after training: the trainer stays offloaded while it saves.
    moved.save_checkpoint(tmp_path / "ckpt", host_view=offload.host_view)
    assert all(p.untyped_storage().nbytes() == 0 for p in _params(moved)), "nothing reloaded"
    assert all(t.untyped_storage().nbytes() == 0 for t in _state(moved))

    loaded = _worker()
    loaded.load_checkpoint(tmp_path / "ckpt")
    for a, b in zip(_params(loaded), _params(still), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert _equal_nests(_optimizer_state(loaded), _optimizer_state(still))
    assert loaded.accumulated_step == still.accumulated_step == 2
    after = [w.train(1, w.prepare(1, samples)) for w in (loaded, still)]
    assert after[0] == after[1]
    offload.reload()  # and the offloaded trainer itself is intact
    for a, b in zip(_params(moved), _params(loaded), strict=False):
        assert a.shape == b.shape


def test_host_views_keep_views_offsets_and_dropped_zeros():
    base = torch.arange(12.0)
    view = base[4:8].view(2, 2)
    grad = torch.ones(3)
    offload = StorageOffload("cpu")
    offload.offload([base], [grad])
    nest = {"a": [view, base], "b": (grad, 7), "c": torch.tensor([1.5])}
    seen = offload.host_view(nest)
    assert seen["a"][0].tolist() == [[4.0, 5.0], [6.0, 7.0]] and seen["a"][1].tolist() == list(
        map(float, range(12))
    )
    assert seen["a"][0].untyped_storage()._cdata == seen["a"][1].untyped_storage()._cdata
    assert seen["b"] == (seen["b"][0], 7) and seen["b"][0].tolist() == [0.0] * 3
    assert seen["c"] is nest["c"], "a tensor that is not offloaded is itself"
    assert view.untyped_storage().nbytes() == 0
