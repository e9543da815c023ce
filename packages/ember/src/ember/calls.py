"""How a call reaches an actor: a Ray actor in a process of its own, or a plain object in this
process. The driver, the rollout manager and the actors make every call the same way, through
`handle.method.remote(...)`, `get` and `wait`; only the runtime that built the handle differs.

- A Ray actor (`ember.runtimes.RayRuntime`): a process of its own, placed by the run's
  placement groups; `get` and `wait` are Ray's.
- A `LocalActor` (`ember.runtimes.LocalRuntime`): the same class as a plain object in this
  process. Each concurrency group of the actor (its default calls, and any group its methods
  name with `concurrency_group`) gets one thread, so calls run in order per group and the roles run
  at the same time as they do under Ray: the overlapped loop trains on one thread while the
  engine generates on another (torch releases the GIL in its kernels). Nothing is serialised:
  a call's arguments and results are the objects themselves.

`get` and `wait` tell the two apart by the reference they are given, so code that runs on both
(the manager, the training rank's weight push) never asks which kind of actor it calls.
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_GROUP = "default"
"""The concurrency group of an actor's methods that name none."""


# --------------------------------------------------------------------------------------------
# References and waiting, for both runtimes
# --------------------------------------------------------------------------------------------


class LocalRef:
    """The pending result of a call to an in-process actor (what a Ray `ObjectRef` is to a Ray
    actor's call)."""

    __slots__ = ("future",)

    def __init__(self, future: cf.Future) -> None:
        self.future = future

    def __deepcopy__(self, memo: dict) -> LocalRef:
        return self


def _is_local(refs: Any) -> bool:
    first = refs[0] if isinstance(refs, list | tuple) and refs else refs
    return isinstance(first, LocalRef)


def get(refs: Any, *, timeout: float | None = None) -> Any:
    """The result of a call (or of each call of a list), once it is done; a call's error is
    raised here. `ray.get` for Ray's references."""
    if _is_local(refs):
        if isinstance(refs, list | tuple):
            return [ref.future.result(timeout) for ref in refs]
        return refs.future.result(timeout)
    if isinstance(refs, list | tuple) and not refs:
        return []
    import ray

    return ray.get(refs, timeout=timeout)


def wait(
    refs: Sequence[Any],
    *,
    num_returns: int = 1,
    timeout: float | None = None,
    fetch_local: bool = True,
) -> tuple[list[Any], list[Any]]:
    """The calls of `refs` that are done (at least `num_returns`, unless `timeout` passes
    first) and those that are not, each in the order given. `ray.wait` for Ray's references."""
    refs = list(refs)
    if not refs:
        return [], []
    if not _is_local(refs):
        import ray

        return ray.wait(refs, num_returns=num_returns, timeout=timeout, fetch_local=fetch_local)
    futures = [ref.future for ref in refs]
    deadline = None if timeout is None else time.monotonic() + timeout
    done: set[cf.Future] = set()
    while len(done) < num_returns:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        newly, _ = cf.wait(
            [f for f in futures if f not in done], timeout=left, return_when=cf.FIRST_COMPLETED
        )
        if not newly:  # the timeout passed
            break
        done |= newly
    ready = [ref for ref in refs if ref.future in done]
    return ready, [ref for ref in refs if ref.future not in done]


def is_ray_actor(handle: Any) -> bool:
    """Whether `handle` is a Ray actor (a process of its own, which can die, hang and be
    replaced), not an in-process one."""
    return not isinstance(handle, LocalActor) and hasattr(handle, "_actor_id")


def kill(handle: Any) -> None:
    """Stop an actor for good: SIGKILL of a Ray actor's process; an in-process actor stops
    taking calls (its running call, if any, finishes)."""
    if isinstance(handle, LocalActor):
        handle.close(wait=False)
        return
    import ray

    try:
        ray.kill(handle, no_restart=True)
    except Exception:  # gone already
        pass


def node_address() -> str:
    """The address of the node this code runs on: Ray's view of it in a Ray process, loopback
    in a run that has no Ray."""
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return ray.util.get_node_ip_address()
    return "127.0.0.1"


# --------------------------------------------------------------------------------------------
# In-process actors
# --------------------------------------------------------------------------------------------


def concurrency_group(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Put an actor method in concurrency group `name`: one thread of its own, beside the
    actor's default calls, in this process and under Ray alike. It sets the attribute
    `ray.method(concurrency_group=...)` sets (ray 2.60 actor.py reads
    `__ray_concurrency_group__` when it makes a class an actor), without importing Ray."""

    def mark(method: Callable[..., Any]) -> Callable[..., Any]:
        method.__ray_concurrency_group__ = name  # type: ignore[attr-defined]
        return method

    return mark


def method_groups(cls: type) -> dict[str, str]:
    """The concurrency group of each method of `cls` that names one (`concurrency_group`)."""
    groups = {}
    for name in dir(cls):
        group = getattr(getattr(cls, name, None), "__ray_concurrency_group__", None)
        if group is not None:
            groups[name] = group
    return groups


_local = threading.local()


def in_local_actor() -> bool:
    """Whether this thread runs an in-process actor's calls (so process-wide settings, such as
    environment variables and logging, belong to the driver, not to the actor)."""
    return getattr(_local, "actor", None) is not None


class _Method:
    __slots__ = ("_actor", "_name")

    def __init__(self, actor: LocalActor, name: str) -> None:
        self._actor, self._name = actor, name

    def remote(self, *args: Any, **kwargs: Any) -> LocalRef:
        return self._actor._submit(self._name, args, kwargs)


class LocalActor:
    """An actor object in this process behind a Ray-like handle: `handle.method.remote(...)`
    queues the call on the thread of the method's concurrency group and returns a `LocalRef`.

    Arguments that are `LocalRef`s are resolved first, as Ray resolves `ObjectRef` arguments.
    The actor's `__init__` runs on its default thread, before the handle is returned.
    """

    def __init__(self, cls: type, args: tuple, kwargs: dict, *, name: str) -> None:
        self.name = name
        self._groups = method_groups(cls)
        self._executors: dict[str, cf.ThreadPoolExecutor] = {}
        self._lock = threading.Lock()
        self._closed = False
        # Like Ray, the actor gets a copy of what it was created with (a config dict it may
        # change); handles and references stay themselves.
        args, kwargs = copy.deepcopy((args, kwargs))
        self.instance = (
            self._executor(DEFAULT_GROUP).submit(self._call, lambda: cls(*args, **kwargs)).result()
        )

    def __deepcopy__(self, memo: dict) -> LocalActor:
        return self

    def __repr__(self) -> str:
        return f"LocalActor({self.name})"

    def _executor(self, group: str) -> cf.ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name} was stopped and takes no more calls")
            executor = self._executors.get(group)
            if executor is None:
                executor = cf.ThreadPoolExecutor(1, thread_name_prefix=f"{self.name}:{group}")
                self._executors[group] = executor
            return executor

    def _call(self, fn: Callable[[], Any]) -> Any:
        _local.actor = self.name
        return fn()

    def _submit(self, name: str, args: tuple, kwargs: dict) -> LocalRef:
        method = getattr(self.instance, name)
        group = self._groups.get(name, DEFAULT_GROUP)

        def call() -> Any:
            resolved = [get(a) if isinstance(a, LocalRef) else a for a in args]
            named = {k: get(v) if isinstance(v, LocalRef) else v for k, v in kwargs.items()}
            return method(*resolved, **named)

        return LocalRef(self._executor(group).submit(self._call, call))

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_") or name not in dir(self.__dict__.get("instance")):
            raise AttributeError(f"{self.name} has no method {name!r}")
        return _Method(self, name)

    def close(self, *, wait: bool = True) -> None:
        """Take no more calls; with `wait`, let the queued ones finish first."""
        with self._lock:
            self._closed = True
            executors = list(self._executors.values())
        for executor in executors:
            executor.shutdown(wait=wait, cancel_futures=not wait)
