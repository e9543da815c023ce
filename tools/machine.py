"""The machine a figure came from: processor model, vector extensions, cores and load."""

from __future__ import annotations

import json
import os
import platform
import subprocess


def describe_machine() -> str:
    """Processor model, its vector extensions, cores and load: figures depend on all four."""
    model, flags = processor()
    wanted = ("avx2", "avx512f", "amx_tile")
    vector = ", ".join(flag for flag in wanted if flag in flags) or "no AVX2"
    load = os.getloadavg()[0]
    return f"{model} ({vector}), {len(os.sched_getaffinity(0))} cores, load {load:.2f}"


def processor() -> tuple[str, set[str]]:
    """The processor's model name and feature flags, as util-linux's `lscpu --json` reports
    them; the platform's processor name and no flags where lscpu is missing."""
    model, flags = platform.processor() or "unknown", set()
    try:
        out = subprocess.run(["lscpu", "--json"], capture_output=True, text=True, check=True)
        fields = dict(_fields(json.loads(out.stdout)["lscpu"]))
    except (OSError, subprocess.CalledProcessError, ValueError, KeyError, TypeError):
        return model, flags
    return fields.get("Model name") or model, set((fields.get("Flags") or "").split())


def _fields(entries: list[dict]) -> list[tuple[str, str | None]]:
    """(field, data) of lscpu's JSON entries, nested ones included (newer util-linux nests the
    model's fields under the vendor)."""
    out = []
    for entry in entries:
        out.append((entry["field"].rstrip(":"), entry.get("data")))
        out += _fields(entry.get("children", []))
    return out
