"""A timeline of a run's start-up and shutdown, across the driver and its actors.

With ``EMBER_STARTUP_TRACE`` set to a file path, each process appends one line per step it
reaches: wall time, process, step. Ray actors inherit the variable with the driver's
environment. `tools/profile_startup.py` runs `ember train` with it and prints the timeline.
Without it `mark` does nothing.
"""

from __future__ import annotations

import os
import time

TRACE_ENV = "EMBER_STARTUP_TRACE"


def process_start_time() -> float:
    """When this process started (wall seconds); now where the platform cannot tell.

    psutil's `create_time` is the boot time, which Linux gives in whole seconds, plus the start
    after boot in clock ticks. The start after boot is exact, so on Linux it is added to the
    boot clock's own reading (`CLOCK_BOOTTIME`, nanoseconds) instead: the start to 10 ms.
    """
    import psutil

    try:
        created = psutil.Process().create_time()
        boottime = getattr(time, "CLOCK_BOOTTIME", None)
        if boottime is None:
            return created
        since_boot = created - psutil.boot_time()
        return time.time() - time.clock_gettime(boottime) + since_boot
    except (psutil.Error, OSError):
        return time.time()


def mark_process_start(process: str, step: str | None = None) -> None:
    """Record when this process started and, given `step`, that it reached it
    now: the first lines of an actor's (or the driver's) trace."""
    if not os.environ.get(TRACE_ENV):
        return
    mark(process, "process started", process_start_time())
    if step is not None:
        mark(process, step)


def mark(process: str, step: str, when: float | None = None) -> None:
    """Record that `process` reached `step` (now, or at `when`)."""
    path = os.environ.get(TRACE_ENV)
    if not path:
        return
    line = f"{time.time() if when is None else when:.3f}\t{process}[{os.getpid()}]\t{step}\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())  # one short write: lines of concurrent processes stay whole
    finally:
        os.close(fd)
