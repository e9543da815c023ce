"""A broadcast push that loses an engine mid-bucket: the driver's `WeightPush` returns within
its bound and hands the engines that cannot close their session to engine mending.

Over NCCL, the surviving members of the weight group stay blocked in the bucket's broadcast
when one member dies (the sender's abort reaches only its own communicator), each until its
watchdog's timeout; their actors answer no weight call meanwhile. The real `Driver` and
`WeightPush` run; the actors are in-process stand-ins: a sending rank that sends one bucket and
fails as the real one does when an engine dies (`_wait_all`), an engine that dies mid-bucket,
and one left blocked in the broadcast.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from engine_standins import AsRayActor, ManagerStandIn

import ember.weight_push as weight_push
from ember import calls
from ember.calls import LocalActor
from ember.config import load_config
from ember.driver import Actors, Driver

RELEASE = threading.Event()
"""Set when the test is over: the blocked stand-in's thread may go."""


class Died(Exception):
    """What a call to an engine that died raises (Ray's RayActorError, in the real run)."""


class Engine:
    def __init__(self, fate: str) -> None:
        self.fate = fate
        self.session = False

    def begin_weight_update(self) -> None:
        self.session = True

    def update_weights_from_distributed(self, *args: Any) -> None:
        if self.fate == "dies":
            raise Died("rollout engine died mid-bucket")
        if self.fate == "blocked":  # in a broadcast whose sender gave up
            RELEASE.wait()

    def end_weight_update(self) -> None:
        if self.fate == "dies":
            raise Died("rollout engine died")
        self.session = False


class SendingRank:
    def send_weights(self, engines: list[Any], version: str, one_off: bool = False) -> None:
        loaded = [e.update_weights_from_distributed.remote([], [], [], "g", version, True)
                  for e in engines]  # fmt: skip
        pending = loaded
        while pending:  # the first failure ends the push (actors.py `_wait_all`)
            done, pending = calls.wait(pending, num_returns=1)
            calls.get(done)


def test_a_member_dying_mid_bucket_ends_the_push_within_its_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(weight_push, "ABORTED_PUSH_WAIT_S", 1.0, raising=False)
    RELEASE.clear()
    engines = [
        LocalActor(Engine, (fate,), {}, name=f"rollout engine {i}")
        for i, fate in enumerate(("lives", "dies", "blocked"))
    ]
    manager = LocalActor(ManagerStandIn, (), {}, name="the rollout manager")
    config, _ = load_config("default", overrides=["weights.transport=broadcast"])
    driver = Driver(config, tmp_path / "run")
    driver.actors = Actors(
        train=[LocalActor(SendingRank, (), {}, name="training rank 0")],
        engines=engines,
        manager=AsRayActor(manager),
    )
    outcome: dict[str, Any] = {}

    def push() -> None:
        try:
            driver.pusher.in_session("3", "broadcast")
        except Exception as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=push, daemon=True)
    start = time.monotonic()
    thread.start()
    thread.join(10)
    took = time.monotonic() - start
    RELEASE.set()  # let the stand-in's thread go
    assert not thread.is_alive(), "the push still waits on an engine blocked in a broadcast"
    assert took < 5
    assert isinstance(outcome.get("error"), Died)  # the push's own error
    assert not engines[0].instance.session  # a live engine's session is closed
    failed = manager.instance.failed
    assert list(failed) == [2] and "weight-update session" in failed[2]
