"""The machine a figure came from: processor model, vector extensions, cores and load."""

from __future__ import annotations

import os
import platform


def describe_machine() -> str:
    """Processor model, its vector extensions, cores and load: figures depend on all four."""
    model, flags = platform.processor() or "unknown", set()
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    wanted = ("avx2", "avx512f", "amx_tile")
    vector = ", ".join(flag for flag in wanted if flag in flags) or "no AVX2"
    load = os.getloadavg()[0]
    return f"{model} ({vector}), {len(os.sched_getaffinity(0))} cores, load {load:.2f}"
