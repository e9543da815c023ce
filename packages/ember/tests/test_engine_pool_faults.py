"""The engine pool under failing engines, on real Ray: actor processes that exit, stop (hang) or
lose their server mid-call, and a pool whose every engine failed waiting for a replacement."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from types import SimpleNamespace

import psutil
import pytest
import ray

from ember.actors import HEALTH_CALLS
from ember.config import FaultToleranceSection
from ember.rollout_manager import EnginePool


@ray.remote(concurrency_groups={HEALTH_CALLS: 1})
class ScriptedEngine:
    """An engine actor that answers `generate` with "<name>:<group>" per group, or fails the way
    its script says: "exit" (the process dies), "stop" (SIGSTOP: the process hangs), "server"
    (the call fails and the probe reports a dead server), "bad" (the call fails, the probe
    reports nothing: an error of the call's own)."""

    def __init__(self, name: str, script: str = "ok") -> None:
        self.name, self.script = name, script

    def generate(self, groups: list) -> list:
        if self.script == "exit":
            os._exit(1)
        if self.script == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        if self.script in ("server", "bad"):
            raise RuntimeError("POST /generate failed: connection refused")
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
