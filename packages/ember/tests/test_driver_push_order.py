"""`Driver.iteration`: the order of the wait for rollouts generating ahead and the weight push.

Without `rollout.partial_rollouts` the push waits for every rollout that is generating (an
engine never changes weights mid-request); with it the push goes at once and the engines take
the new weights between decode steps. The real driver runs; only the Ray actors are stand-ins,
and `ember.calls`' `get` and `wait` resolve their calls: a rollout started ahead stays
generating until `wait` or `get` waits for it, and the push records which were still
generating when it began. The run is a Ray run's (`ray.enabled=true`: the broadcast push).
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

import ember.calls
from ember.config import load_config
from ember.driver import Actors, Driver
from ember_core.plugins import EmberPlugins
from ember_core.types import Sample
from ember_rollout.rollout import RolloutBatch

BATCH = 2
N = 2


class Ref:
    """An ObjectRef: a finished call's value, or a rollout still generating."""

    def __init__(self, value: Any = None, rollout_id: int | None = None) -> None:
        self.value = value
        self.rollout_id = rollout_id
        self.done = rollout_id is None


class Cluster:
    """The stand-in actors and the `get` and `wait` that resolve their calls, with one event log."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.rollouts: dict[int, Ref] = {}
        self.training_beside: list[list[int]] = []  # per training step: the rollouts generating

    # -- get and wait ----------------------------------------------------------------------------

    def _finish(self, ref: Ref) -> Any:
        if not ref.done:
            ref.done = True
            self.events.append(("generated", ref.rollout_id))
        return ref.value

    def get(self, refs: Any) -> Any:
        return [self._finish(r) for r in refs] if isinstance(refs, list) else self._finish(refs)

    def wait(
        self,
        refs: list[Ref],
        *,
        num_returns: int = 1,
        timeout: float | None = None,
        fetch_local: bool = True,
    ):
        rollouts = sorted(r.rollout_id for r in refs if r.rollout_id is not None)
        if rollouts:  # a wait for finished calls (the push's own) is no wait for rollouts
            self.events.append(("wait", rollouts))
        for ref in refs[:num_returns]:
            self._finish(ref)
        return refs[:num_returns], refs[num_returns:]

    # -- actors --------------------------------------------------------------------------------

    def generating(self) -> list[int]:
        return sorted(i for i, ref in self.rollouts.items() if not ref.done)

    def actors(self) -> Actors:
        def call(name: str, result=None):
            def remote(*args: Any) -> Ref:
                self.events.append((name,))
                return Ref(result(*args) if result else None)

            return SimpleNamespace(remote=remote)

        def generate(rollout_id: int, prompts: Any = None) -> Ref:
            self.events.append(("generate", rollout_id))
            samples = [
                Sample(tokens=[1, 2, 3], response_length=1, weight_version=str(rollout_id - 1))
                for _ in range(BATCH * N)
            ]
            ref = Ref(RolloutBatch(samples=samples, metrics={}), rollout_id)
            self.rollouts[rollout_id] = ref
            return ref

        def begin_weight_update() -> Ref:
            self.events.append(("push begins", self.generating()))
            return Ref()

        def train(*args: Any) -> Ref:
            self.events.append(("train",))
            self.training_beside.append(self.generating())
            return Ref([{}])

        rank = SimpleNamespace(
            prepare=call("prepare", lambda *a: {}),
            train=SimpleNamespace(remote=train),
            send_weights=call("send_weights"),
        )
        engine = SimpleNamespace(
            begin_weight_update=SimpleNamespace(remote=begin_weight_update),
            end_weight_update=call("push ends"),
        )
        manager = SimpleNamespace(generate=SimpleNamespace(remote=generate))
        return Actors(train=[rank], engines=[engine], manager=manager)


def drive(tmp_path, monkeypatch, *, partial: bool, k: int = 2, iterations: int = 2) -> Cluster:
    """The first `iterations` iterations of a run with rollout.max_staleness=k."""
    cluster = Cluster()
    monkeypatch.setattr(ember.calls, "get", cluster.get)
    monkeypatch.setattr(ember.calls, "wait", cluster.wait)
    config, _ = load_config(
        "default",
        overrides=[
            f"run.dir={tmp_path}",
            f"run.num_rollouts={iterations + k + 2}",
            f"rollout.rollout_batch_size={BATCH}",
            f"rollout.n_samples_per_prompt={N}",
            f"rollout.max_staleness={k}",
            f"rollout.partial_rollouts={str(partial).lower()}",
            "ray.enabled=true",
        ],
    )
    driver = Driver(config, tmp_path, plugins=EmberPlugins())
    driver.actors = cluster.actors()
    for rollout_id in range(iterations):
        cluster.events.append(("iteration", rollout_id))
        driver.iteration(rollout_id)
    return cluster


TRAIN = [("prepare",), ("train",)]
PUSH_REST = [("send_weights",), ("push ends",)]


def test_without_partial_rollouts_the_push_waits_for_every_rollout_generating(
    tmp_path, monkeypatch
):
    events = drive(tmp_path, monkeypatch, partial=False).events
    assert events == [
        ("iteration", 0),
        ("generate", 0),
        ("generated", 0),
        ("generate", 1),
        ("generate", 2),
        *TRAIN,
        ("wait", [1, 2]),
        ("generated", 1),
        ("generated", 2),
        ("push begins", []),
        *PUSH_REST,
        ("iteration", 1),
        ("generate", 3),
        *TRAIN,
        ("wait", [2, 3]),
        ("generated", 3),
        ("push begins", []),
        *PUSH_REST,
    ]


def test_with_partial_rollouts_the_push_lands_while_rollouts_generate(tmp_path, monkeypatch):
    events = drive(tmp_path, monkeypatch, partial=True).events
    assert not [e for e in events if e[0] == "wait"]
    assert events == [
        ("iteration", 0),
        ("generate", 0),
        ("generated", 0),
        ("generate", 1),
        ("generate", 2),
        *TRAIN,
        ("push begins", [1, 2]),
        *PUSH_REST,
        ("iteration", 1),
        ("generated", 1),
        ("generate", 3),
        *TRAIN,
        ("push begins", [2, 3]),
        *PUSH_REST,
    ]


@pytest.mark.parametrize("k", [1, 2, 4])
def test_without_partial_rollouts_one_rollout_generates_beside_training_whatever_k(
    tmp_path, monkeypatch, k
):
    """k > 1 adds staleness, not overlap: the first iteration trains beside the k rollouts it
    started; from then on each push has waited for the rollouts ahead, so iteration i trains
    beside rollout i + k alone, as at k = 1 (the manager generates one rollout at a time)."""
    cluster = drive(tmp_path, monkeypatch, partial=False, k=k, iterations=6)
    assert cluster.training_beside == [list(range(1, k + 1))] + [[i + k] for i in range(1, 6)]


def test_with_partial_rollouts_the_rollouts_ahead_stay_queued_across_pushes(tmp_path, monkeypatch):
    cluster = drive(tmp_path, monkeypatch, partial=True, k=4, iterations=6)
    assert cluster.training_beside == [[i + 1, i + 2, i + 3, i + 4] for i in range(6)]


class HeldEngine:
    """An engine whose `generate` is held (as after a push that stopped partway, until a
    complete one that a stopping run never sends), so its `shutdown` queues behind it."""

    release = threading.Event()

    def __init__(self) -> None:
        self.stopped = False

    def generate(self, groups: Any) -> list:
        self.release.wait(60)
        return []

    def shutdown(self) -> None:
        self.stopped = True


def test_shutdown_kills_an_engine_that_does_not_stop_within_its_bound(
    tmp_path, monkeypatch, caplog
):
    import ember.driver

    monkeypatch.setattr(ember.driver, "ENGINE_SHUTDOWN_S", 0.5)
    monkeypatch.setattr(HeldEngine, "release", threading.Event())
    config, _ = load_config("default", overrides=[f"run.dir={tmp_path}"])
    driver = Driver(config, tmp_path, plugins=EmberPlugins())
    held = ember.calls.LocalActor(HeldEngine, (), {}, name="rollout engine 0")
    free = ember.calls.LocalActor(HeldEngine, (), {}, name="rollout engine 1")
    held.generate.remote([])
    driver.actors = SimpleNamespace(engines=[held, free])
    started = time.monotonic()
    try:
        driver.shutdown()
        took = time.monotonic() - started
    finally:
        HeldEngine.release.set()
    assert took < 10, took  # not the held generate's 60 s
    assert free.instance.stopped and not held.instance.stopped
    assert "a rollout engine did not stop within 0.5 s; killing it" in caplog.text
    with pytest.raises(RuntimeError, match="was stopped and takes no more calls"):
        held.shutdown.remote()
