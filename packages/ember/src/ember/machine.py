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


def processor_name() -> str:
    """The processor's model name, with its family and model numbers where lscpu gives them
    (one name covers processors of different generations): what a generated page names."""
    fields = lscpu_fields()
    name = fields.get("Model name") or platform.processor() or platform.machine()
    if fields.get("CPU family") and fields.get("Model"):
        name += f" (family {fields['CPU family']}, model {fields['Model']})"
    return name


def lscpu_fields() -> dict[str, str | None]:
    """util-linux's `lscpu --json` as field -> data (the first of a repeated field); empty
    where lscpu is missing or fails."""
    try:
        out = subprocess.run(["lscpu", "--json"], capture_output=True, text=True, check=True)
        fields: dict[str, str | None] = {}
        for field, data in _fields(json.loads(out.stdout)["lscpu"]):
            fields.setdefault(field, data)
        return fields
    except (OSError, subprocess.CalledProcessError, ValueError, KeyError, TypeError):
        return {}


def processor() -> tuple[str, set[str]]:
    """The processor's model name and feature flags, as util-linux's `lscpu --json` reports
    them; the platform's processor name and no flags where lscpu is missing."""
    model, fields = platform.processor() or "unknown", lscpu_fields()
    if not fields:
        return model, set()
    return fields.get("Model name") or model, set((fields.get("Flags") or "").split())


def _fields(entries: list[dict]) -> list[tuple[str, str | None]]:
    """(field, data) of lscpu's JSON entries, nested ones included (newer util-linux nests the
    model's fields under the vendor)."""
    out = []
    for entry in entries:
        out.append((entry["field"].rstrip(":"), entry.get("data")))
        out += _fields(entry.get("children", []))
    return out
