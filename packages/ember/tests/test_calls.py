"""`ember.calls`: in-process actors take calls as Ray actors do (in order per concurrency group,
groups beside each other, references resolved, errors raised at `get`), and `ember.runtimes`
picks where a run's roles live."""

from __future__ import annotations

import threading
import time

import pytest
import ray

from ember import calls
from ember.calls import LocalActor, LocalRef
from ember.config import load_config
from ember.runtimes import LocalRuntime, RayRuntime, choose_runtime


class Counter:
    """An actor with a default group and a `side` group, like an engine's health calls."""

    gate = threading.Event()
    """What `slow` waits for (a class attribute: an actor's arguments are copied, as Ray
    copies them, and an event cannot be)."""

    def __init__(self, config: dict) -> None:
        config["seen"] = True  # the caller's dict must not change (Ray copies it)
        self.log: list[str] = []
        self.threads: set[str] = set()

    def slow(self, name: str) -> str:
        self.threads.add(threading.current_thread().name)
        self.gate.wait(5)
        self.log.append(name)
        return name

    def add(self, a: int, b: int) -> int:
        self.threads.add(threading.current_thread().name)
        self.log.append(f"add {a} {b}")
        return a + b

    @ray.method(concurrency_group="side")
    def peek(self) -> list[str]:
        return list(self.log)

    def fail(self) -> None:
        raise ValueError("the actor's own error")


def test_calls_run_in_order_per_group_and_groups_run_beside_each_other():
    gate = Counter.gate
    gate.clear()
    config: dict = {}
    actor = LocalActor(Counter, (config,), {}, name="counter")
    assert config == {}  # the actor got a copy
    first = actor.slow.remote("first")
    second = actor.add.remote(1, 2)
    # The side group answers while the default group is blocked in `slow`.
    assert calls.get(actor.peek.remote(), timeout=5) == []
    ready, waiting = calls.wait([first, second], num_returns=1, timeout=0.2)
    assert ready == [] and waiting == [first, second]
    gate.set()
    assert calls.get([first, second], timeout=5) == ["first", 3]
    assert actor.instance.log == ["first", "add 1 2"]
    assert len(actor.instance.threads) == 1  # one thread for the default group
    actor.close()


def test_references_are_resolved_and_errors_raised_at_get():
    Counter.gate.set()
    actor = LocalActor(Counter, ({},), {}, name="counter")
    three = actor.add.remote(1, 2)
    assert isinstance(three, LocalRef)
    assert calls.get(actor.add.remote(three, 4)) == 7  # a reference argument is its value
    failed = actor.fail.remote()
    ready, _ = calls.wait([failed], timeout=5)
    assert ready == [failed]
    with pytest.raises(ValueError, match="the actor's own error"):
        calls.get(failed)
    with pytest.raises(AttributeError, match="counter has no method 'nope'"):
        actor.nope.remote()
    actor.close()
    with pytest.raises(RuntimeError, match="counter was stopped"):
        actor.add.remote(1, 1)


def test_wait_returns_once_enough_calls_are_done_or_the_timeout_passes():
    gate = Counter.gate
    gate.clear()
    actor = LocalActor(Counter, ({},), {}, name="counter")
    blocked = actor.slow.remote("blocked")
    started = time.monotonic()
    ready, waiting = calls.wait([blocked], num_returns=1, timeout=0.3)
    assert (ready, waiting) == ([], [blocked])
    assert 0.25 <= time.monotonic() - started < 3
    gate.set()
    ready, waiting = calls.wait([blocked], num_returns=1)
    assert (ready, waiting) == ([blocked], [])
    assert calls.get([]) == [] and calls.wait([]) == ([], [])
    assert not calls.is_ray_actor(actor)
    actor.close()


@pytest.mark.parametrize(
    ("overrides", "local", "why"),
    [
        ([], True, "ray.enabled=auto: one training rank, one embedded engine, no GPUs"),
        (["ray.enabled=true"], False, "ray.enabled=true"),
        (["ray.num_engines=2"], False, "ray.num_engines=2: each engine is a process"),
        (["ray.data_parallel=2", "rollout.rollout_batch_size=8"], False, "training rank"),
        (["ray.address=auto", "ray.object_store_mb=null"], False, "joins a cluster"),
        (["engine.kind=sglang"], False, "runs servers that Ray places"),
        (["ray.enabled=false"], True, "ray.enabled=false"),
    ],
)
def test_the_runtime_follows_ray_enabled_and_what_the_run_needs(overrides, local, why):
    config, _ = load_config("default", overrides=overrides)
    runtime, reason = choose_runtime(config)
    assert isinstance(runtime, LocalRuntime if local else RayRuntime)
    assert why in reason
