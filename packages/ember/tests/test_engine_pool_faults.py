"""The engine pool under failing engines, on real Ray: actor processes that exit, stop (hang) or
lose their server mid-call, a pool whose every engine failed waiting for a replacement, and a
replacement installed while a round runs. Then the driver's push around failed engines: pushed
again after a replacement, and checked for every engine serving the same weights."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from types import SimpleNamespace

import psutil
import pytest
import ray
import torch

import ember.calls
from ember.actors import HEALTH_CALLS, RolloutEngine
from ember.calls import LocalActor
from ember.config import FaultToleranceSection
from ember.driver import Actors
from ember.failures import probe
from ember.rollout_manager import EnginePool


@ray.remote(concurrency_groups={HEALTH_CALLS: 1})
class ScriptedEngine:
    """An engine actor that answers `generate` with "<name>:<group>" per group, or fails the way
    its script says: "exit" (the process dies), "stop" (SIGSTOP: the process hangs), "server"
    (the call fails and the probe reports a dead server), "bad" (the call fails, the probe
    reports nothing: an error of the call's own); "slow" answers its first call after 4 s."""

    def __init__(self, name: str, script: str = "ok") -> None:
        self.name, self.script = name, script

    def generate(self, groups: list) -> list:
        if self.script == "exit":
            os._exit(1)
        if self.script == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        if self.script in ("server", "bad"):
            raise RuntimeError("POST /generate failed: connection refused")
        if self.script == "slow":
            self.script = "ok"
            time.sleep(4.0)
        time.sleep(0.05)
        return [[f"{self.name}:{g.index}"] * len(g.requests) for g in groups]

    @ray.method(concurrency_group=HEALTH_CALLS)
    def health(self, timeout_s: float = 10.0) -> str | None:
        return (
            "SGLang server http://127.0.0.1:1 exited with code -9"
            if self.script == "server"
            else None
        )

    @ray.method(concurrency_group=HEALTH_CALLS)
    def pid(self) -> int:
        return os.getpid()


@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING")
    try:
        yield
    finally:
        ray.shutdown()


def engine(name: str, script: str = "ok") -> tuple:
    """A started engine actor (as the driver hands the pool only started ones) and its pid."""
    actor = ScriptedEngine.remote(name, script)
    return actor, ray.get(actor.pid.remote(), timeout=120)


def groups(count: int, size: int = 2) -> list:
    return [SimpleNamespace(index=i, requests=[None] * size) for i in range(count)]


def pool_of(*engines, **ft) -> EnginePool:
    settings = {"health_check_interval_s": 0.5, "health_check_timeout_s": 1.0, **ft}
    return EnginePool(engines, kind="hf", fault_tolerance=FaultToleranceSection(**settings))


def gone(pid: int, within: float = 30.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.parametrize("script", ["exit", "stop", "server"])
def test_a_failed_engine_leaves_the_pool_and_its_groups_are_generated_again(ray_session, script):
    (good, _), (bad, bad_pid) = engine("good"), engine("bad", script)
    pool = pool_of(good, bad)
    pool.start_rollout()
    out = asyncio.run(pool.generate_groups(groups(6)))
    # Every group, whole, from the live engine (the failed one's were sent again).
    assert out == [[f"good:{i}"] * 2 for i in range(6)]
    assert list(pool.failed) == [1]
    why = pool.failed[1]
    if script == "exit":
        assert why.startswith(f"died (pid {bad_pid} on ") and "exits" in why, why
    elif script == "stop":
        assert why == "did not answer a health probe within 1 s (hung)"
    else:
        assert why.startswith("SGLang server http://127.0.0.1:1 exited with code -9 (its generate")
    assert gone(bad_pid)  # killed, even when stopped
    metrics = pool.metrics()
    assert metrics["rollout/engine_failures"] == 1.0
    assert metrics["rollout/resent_requests"] == 6.0  # its 3 groups of 2
    assert metrics["rollout/engine0_requests"] == 12.0 and metrics["rollout/engine1_requests"] == 6
    # Counted once: the next rollout's metrics start from zero.
    assert pool.metrics()["rollout/engine_failures"] == 0.0
    # The next round goes to the live engine only.
    assert asyncio.run(pool.generate_groups(groups(2))) == [["good:0"] * 2, ["good:1"] * 2]


def test_a_pool_without_a_live_engine_waits_for_the_replacement(ray_session):
    pool = pool_of(engine("first", "exit")[0])
    replacement = engine("second")[0]

    def replace_when_failed() -> None:
        deadline = time.monotonic() + 60
        while 0 not in pool.failed and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the round waits meanwhile
        pool.install(0, replacement)

    installer = threading.Thread(target=replace_when_failed)
    installer.start()
    out = asyncio.run(pool.generate_groups(groups(3)))
    installer.join()
    assert out == [[f"second:{i}"] * 2 for i in range(3)]
    assert pool.failed == {} and pool.engines == [replacement]


@pytest.mark.slow
def test_a_failure_found_after_a_mid_round_replacement_leaves_the_replacement_serving(
    ray_session,
):
    """The driver's probe finds an engine dead while the round waits for a slow one, fails it
    and installs a replacement in its slot; the round's own report of that death, handled
    after the round, is the old engine's: the replacement keeps serving, and the failure
    counts once."""
    (slow, _), (dead, _) = engine("slow", "slow"), engine("dead", "exit")
    replacement, _ = engine("second")
    pool = pool_of(slow, dead)
    pool.start_rollout()
    started = time.monotonic()
    installed: list[float] = []

    def mend_as_the_driver_does() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            why = probe(dead, 1.0)
            if why is not None:
                pool.fail(1, dead, why)
                pool.install(1, replacement)
                installed.append(time.monotonic() - started)
                return
            time.sleep(0.05)

    mender = threading.Thread(target=mend_as_the_driver_does)
    mender.start()
    out = asyncio.run(pool.generate_groups(groups(6)))
    mender.join()
    # Installed while the slow engine's call (4 s) kept the round's results from being handled.
    assert installed and installed[0] < 3.0, installed
    assert probe(replacement, 10.0) is None
    assert pool.failed == {} and pool.engines == [slow, replacement]
    # The dead engine's groups (1, 3, 5) went again to the slow one and the replacement.
    names = ["slow", "slow", "slow", "second", "slow", "slow"]
    assert out == [[f"{name}:{i}"] * 2 for i, name in enumerate(names)]
    metrics = pool.metrics()
    assert metrics["rollout/engine_failures"] == 1.0
    assert metrics["rollout/resent_requests"] == 6.0


class Idle:
    """An in-process engine actor that only answers `ping`."""

    def ping(self) -> str:
        return "pong"


def test_a_failure_reported_after_the_slot_was_replaced_leaves_the_replacement_alone():
    """The rule of the test above without Ray: a failure names the engine it was found in,
    counts once, and the old engine's late report does not reach the slot's replacement."""
    first, old, replacement = (LocalActor(Idle, (), {}, name=n) for n in ("a", "b", "c"))
    pool = pool_of(first, old)
    pool.fail(1, old, "died")  # the driver's probe
    pool.fail(1, old, "died")  # the round's own report, before the replacement
    pool.install(1, replacement)
    pool.fail(1, old, "died")  # ... and after it
    assert pool.failed == {} and pool.engines == [first, replacement]
    assert ember.calls.get(replacement.ping.remote()) == "pong"
    with pytest.raises(RuntimeError, match="was stopped"):
        old.ping.remote()
    assert pool.metrics()["rollout/engine_failures"] == 1.0
    for engine in (first, replacement):
        engine.close()


def test_an_error_of_the_call_itself_is_raised(ray_session):
    """A failing call whose engine passes its probe is not an engine failure (bad input, a
    plugin's error): the rollout stops with it."""
    pool = pool_of(engine("good")[0], engine("bad", "bad")[0])
    with pytest.raises(RuntimeError, match="connection refused"):
        asyncio.run(pool.generate_groups(groups(4)))
    assert pool.failed == {}


def test_without_fault_tolerance_the_first_failure_is_raised(ray_session):
    pool = pool_of(engine("good")[0], engine("bad", "exit")[0], enabled=False)
    with pytest.raises(ray.exceptions.RayActorError):
        asyncio.run(pool.generate_groups(groups(4)))


def _driver(tmp_path):
    """A driver of the default run, without Ray: its push and mend steps are set by the test."""
    from ember.config import load_config
    from ember.driver import Driver

    config, _ = load_config("default", overrides=[f"run.dir={tmp_path}"])
    return Driver(config, tmp_path)


def test_a_push_retried_after_a_replacement_ends_in_the_slots_one_line_when_that_fails_too(
    tmp_path, monkeypatch
):
    """The driver's push loop: a push that fails on a failed engine replaces it and pushes
    again; when the replacement fails too (killed during the second push), the slot's
    restarts decide, and a slot past them stops the run with its own line, not the raw death."""
    from ember.failures import EnginesExhausted

    driver = _driver(tmp_path)
    calls: list[str] = []
    mended = iter([False, True])  # before the push: nothing failed; after the first: replaced

    def push(version: str) -> None:
        calls.append(f"push {version}")
        raise RuntimeError(f"rollout engine 0 died during push {len(calls)}")

    def mend(*, probe_all: bool = False) -> bool:
        calls.append("mend")
        replaced = next(mended, None)
        if replaced is None:
            raise EnginesExhausted("rollout engine 0 failed; it was replaced 1 time(s)")
        return replaced

    monkeypatch.setattr(driver.pusher, "send", push)
    monkeypatch.setattr(driver.mender, "mend", mend)
    with pytest.raises(EnginesExhausted, match="replaced 1 time"):
        driver.push_weights(5)
    assert calls == ["mend", "push 5", "mend", "push 5", "mend"]
    assert driver.trained_version != "5"  # no push reached every engine


def test_a_push_that_fails_with_every_engine_healthy_is_the_pushs_own_error(tmp_path, monkeypatch):
    driver = _driver(tmp_path)

    def push(version: str) -> None:
        raise RuntimeError("bucket 3 of 7: shape mismatch")

    monkeypatch.setattr(driver.pusher, "send", push)
    monkeypatch.setattr(driver.mender, "mend", lambda *, probe_all=False: False)
    with pytest.raises(RuntimeError, match="bucket 3 of 7"):
        driver.push_weights(2)


class ServedModel(RolloutEngine):
    """A rollout engine actor serving `model` (None: one that cannot read its weights, as an
    SGLang engine): its weight digests are the real engine's."""

    def __init__(self, model: torch.nn.Module | None) -> None:
        self.engine = SimpleNamespace(model=model)


def _push_after_a_replacement(tmp_path, monkeypatch, models: list, reached: list[int]):
    """Push 5 to one engine per model of `models` after the mend before it replaced one; the
    push copies the trainer's weights into the engines of the slots in `reached`. Returns the
    driver."""
    driver = _driver(tmp_path)
    trained = _trained()
    engines = [
        LocalActor(ServedModel, (model,), {}, name=f"rollout engine {slot}")
        for slot, model in enumerate(models)
    ]
    driver.actors = Actors(train=[], engines=engines)
    mends = iter([True])  # the first mend replaced an engine, any later one finds none

    def mend(*, probe_all: bool = False) -> bool:
        replaced = next(mends, False)
        driver.mender.replaced |= replaced
        return replaced

    def push(version: str) -> None:
        for slot in reached:
            engines[slot].instance.engine.model.load_state_dict(trained.state_dict())

    monkeypatch.setattr(driver.mender, "mend", mend)
    monkeypatch.setattr(driver.pusher, "send", push)
    try:
        driver.push_weights(5)
    finally:
        for engine in engines:
            engine.close()
    return driver


def _trained(seed: int = 0) -> torch.nn.Module:
    """The trainer's model (seed 0), or with another seed an engine's own start weights."""
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 3)


def _models(count: int) -> list[torch.nn.Module]:
    """`count` engines' models, each with weights of its own."""
    return [_trained(seed) for seed in range(1, count + 1)]


def test_a_push_that_missed_a_replacement_is_found_by_the_engines_weight_digests(
    tmp_path, monkeypatch
):
    """The push after a replacement reached engine 0 only: the replacement in slot 1 serves
    the weights it started with, and the check after the push names both digests."""
    models = _models(2)
    expected = {
        0: ServedModel(_trained()).weights_digest(),
        1: ServedModel(models[1]).weights_digest(),
    }
    assert expected[0] != expected[1]
    with pytest.raises(RuntimeError) as raised:
        _push_after_a_replacement(tmp_path, monkeypatch, models, reached=[0])
    assert str(raised.value) == (
        "after replacing a rollout engine, the engines serve different weights "
        f"(SHA-256 per engine slot: {expected}); the push did not reach every engine"
    )


def test_a_push_that_reached_every_engine_passes_the_weight_check(tmp_path, monkeypatch, caplog):
    """Every engine that can hash its weights serves the trainer's; one that cannot (slot 2,
    as an SGLang engine) is left out of the comparison."""
    caplog.set_level(logging.INFO, logger="ember.engine_mending")
    driver = _push_after_a_replacement(tmp_path, monkeypatch, [*_models(2), None], reached=[0, 1])
    assert driver.trained_version == "5" and not driver.mender.replaced
    digest = ServedModel(_trained()).weights_digest()
    assert f"the 2 engines serve the same weights (sha256 {digest[:12]}...)" in caplog.text
