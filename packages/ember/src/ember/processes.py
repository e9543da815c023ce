"""The processes a local Ray leaves: found by parentage in /proc, waited for, killed if need be.

`ray.shutdown()` (ray 2.60) stops the processes `ray.init` started, but not their workers: each
worker exits on its own once it sees its raylet gone, which on a loaded machine can take
seconds after the driver has exited. `Driver.shutdown` waits for them with `reap`, so that
`ember train` leaves no process behind.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

PROC = Path("/proc")


def _parents() -> dict[int, int]:
    """pid -> parent pid of every live process (empty where /proc is missing)."""
    out = {}
    for entry in PROC.iterdir() if PROC.is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited meanwhile
            continue
        out[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return out


def children(pid: int) -> set[int]:
    """The live direct children of `pid`."""
    return {child for child, parent in _parents().items() if parent == pid}


def descendants(roots: Iterable[int]) -> set[int]:
    """The live processes below `roots` (children, their children, ...), roots excluded."""
    parents = _parents()
    below: dict[int, list[int]] = {}
    for child, parent in parents.items():
        below.setdefault(parent, []).append(child)
    found: set[int] = set()
    todo = list(roots)
    while todo:
        for child in below.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not yet reaped by its parent, does not)."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def reap(pids: Iterable[int], *, timeout: float = 5.0) -> list[int]:
    """Wait up to `timeout` s for `pids` to exit, then SIGKILL the rest and wait briefly.

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
            os.kill(pid, signal.SIGKILL)
        except OSError:  # gone meanwhile, or not ours
            pass
    deadline = time.monotonic() + 2.0
    while any(alive(p) for p in killed) and time.monotonic() < deadline:
        time.sleep(0.05)
    return killed
