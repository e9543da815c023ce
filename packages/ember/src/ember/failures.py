"""Engine failures: how an actor's death reads, health probes, the error that stops a run, and
actor start-up errors that reach the driver in one piece.

Light on purpose: the rollout manager imports it as well as the driver.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable
from typing import Any

from ember import calls


@dataclasses.dataclass(frozen=True, slots=True)
class ActorDeath:
    """What Ray says of an actor that died."""

    actor_id: str | None
    class_name: str | None
    pid: str | None
    ip: str | None
    detail: str
    """Ray's exit detail ("Worker unexpectedly exits with a connection error code 2. ..."),
    cut at its first sentence; empty when Ray gives none."""

    def where(self) -> str:
        text = f"pid {self.pid}" if self.pid else "pid unknown"
        return f"{text} on {self.ip}" if self.ip else text


def actor_death(exc: BaseException) -> ActorDeath | None:
    """The death a `ray.exceptions.RayActorError` reports (None for any other error, and for
    an actor whose __init__ failed: that is a bad config or input, not a death)."""
    ray = sys.modules.get("ray")  # without Ray imported, no error comes from a Ray actor
    if ray is None or not isinstance(exc, ray.exceptions.RayActorError) or exc.actor_init_failed:
        return None
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    fields = dict(line.split(": ", 1) for line in lines[1:] if ": " in line[:20])
    # Ray's ActorDiedErrorContext: "... Worker exit detail: <why>. <possible causes>".
    exits = [line for line in lines if "exit detail:" in line] or lines[-1:]
    detail = exits[0].split("exit detail:", 1)[-1].split(". ")[0].strip() if exits else ""
    return ActorDeath(
        actor_id=exc.actor_id,
        class_name=fields.get("class_name"),
        pid=fields.get("pid"),
        ip=fields.get("ip"),
        detail=detail,
    )


def is_actor_error(exc: BaseException) -> bool:
    """Whether `exc` is Ray's word that an actor died or never started."""
    ray = sys.modules.get("ray")
    return ray is not None and isinstance(exc, ray.exceptions.RayActorError)


class EngineFailure(Exception):
    """An engine died, hung or lost its servers; `slot` is its index in the pool."""

    def __init__(self, slot: int, reason: str, *, pid: str | None = None) -> None:
        super().__init__(f"rollout engine {slot}: {reason}")
        self.slot = slot
        self.reason = reason
        self.pid = pid


class EnginesExhausted(Exception):
    """An engine slot failed once more than `fault_tolerance.max_restarts` allows (or cannot be
    replaced); the message is the run's one-line error."""


PROBE_GRACE_S = 5.0
"""How much longer than its health call's own timeout a probe waits for the engine actor's
answer, so that an engine whose server timed out says so itself."""


def probe(engine: Any, timeout_s: float) -> str | None:
    """Why `engine` (an engine actor) is not healthy, or None when it is: its health call,
    given `timeout_s` (each SGLang server's GET /health gets as long), answered with nothing
    wrong; an actor that does not answer within `timeout_s` + `PROBE_GRACE_S` is hung."""
    ref = engine.health.remote(timeout_s)
    ready, _ = calls.wait([ref], timeout=timeout_s + PROBE_GRACE_S)
    if not ready:
        return f"did not answer a health probe within {timeout_s:g} s (hung)"
    try:
        return calls.get(ref)
    except Exception as exc:
        if not is_actor_error(exc):
            raise
        death = actor_death(exc)
        if death is None:
            return "died"
        return f"died ({death.where()}): {death.detail or 'Ray gives no reason'}"


def kill(engine: Any) -> None:
    """Stop an engine actor for good (a hung one included: SIGKILL reaches a stopped process).
    Servers it launched go with it (`sglang_launch` ties them to its life)."""
    calls.kill(engine)


def errors_held_for_start(init: Callable[..., None]) -> Callable[..., None]:
    """`init`, the `__init__` of an actor with concurrency groups, with its error kept in
    `init_error` for the actor's `start` to raise. Ray 2.60 aborts the process of such an actor
    whose `__init__` raises (a C++ stack and "Fatal Python error: Aborted" in the run's
    output, over the error itself); raised from a method, the error stops the run in one line."""

    @functools.wraps(init)
    def held(self: Any, *args: Any, **kwargs: Any) -> None:
        self.init_error = None
        try:
            init(self, *args, **kwargs)
        except Exception as exc:  # raised again by `start`, the driver's first call
            self.init_error = exc

    return held
