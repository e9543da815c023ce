"""The processes a local Ray leaves: found by parentage, waited for, killed if need be (psutil).

`ray.shutdown()` (ray 2.60) stops the processes `ray.init` started, but not their workers: each
worker exits on its own once it sees its raylet gone, which on a loaded machine can take
seconds after the driver has exited. `Driver.shutdown` waits for them with `reap`, so that
`ember train` leaves no process behind.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import psutil


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def children(pid: int) -> set[int]:
    """The live direct children of `pid`."""
    process = _process(pid)
    if process is None:
        return set()
    try:
        return {child.pid for child in process.children() if alive(child.pid)}
    except psutil.NoSuchProcess:
        return set()


def descendants(roots: Iterable[int]) -> set[int]:
    """The live processes below `roots` (children, their children, ...), roots excluded."""
    found: set[int] = set()
    for root in roots:
        process = _process(root)
        try:
            below = process.children(recursive=True) if process is not None else []
        except psutil.NoSuchProcess:
            continue
        found.update(child.pid for child in below if alive(child.pid))
    return found


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not yet reaped by its parent, does not)."""
    process = _process(pid)
    try:
        return process is not None and process.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def reap(pids: Iterable[int], *, timeout: float = 5.0) -> list[int]:
    """Wait up to `timeout` s for `pids` to exit, then SIGKILL the rest and wait briefly.

    A zombie counts as exited: its parent, not this process, collects it.

    Returns:
        The pids that had to be killed.
    """
    waiting = {p for p in pids if alive(p)}
    deadline = time.monotonic() + timeout
    while waiting and time.monotonic() < deadline:
        time.sleep(0.05)
        waiting = {p for p in waiting if alive(p)}
    killed = sorted(waiting)
    for pid in killed:
        try:
            psutil.Process(pid).kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):  # gone meanwhile, or not ours
            pass
    deadline = time.monotonic() + 2.0
    while any(alive(p) for p in killed) and time.monotonic() < deadline:
        time.sleep(0.05)
    return killed
