"""Stand-ins of the driver's tests that run engines in this process: the rollout manager's part
in engine mending, and a handle that reads as a Ray actor's."""

from __future__ import annotations

from typing import Any

from ember.calls import LocalActor


class ManagerStandIn:
    """The rollout manager's part in engine mending: the failures it saw (none) and those the
    driver reports (`fail_engine`)."""

    def __init__(self) -> None:
        self.failed: dict[int, str] = {}

    def engine_failures(self) -> dict[int, str]:
        return dict(self.failed)

    def fail_engine(self, slot: int, engine: Any, why: str) -> None:
        self.failed[slot] = why


class AsRayActor:
    """An in-process actor under a handle that reads as a Ray actor's (`calls.is_ray_actor`),
    so that the driver treats engine failures as it does when the engines are processes."""

    _actor_id = None

    def __init__(self, actor: LocalActor) -> None:
        self.actor = actor

    def __getattr__(self, name: str) -> Any:
        return getattr(self.actor, name)
