"""The machine a figure names, read from util-linux's `lscpu --json` (the one outside boundary)."""

from __future__ import annotations

import json
import subprocess

from ember import machine

LSCPU = {
    "lscpu": [
        {"field": "Architecture:", "data": "x86_64"},
        {
            "field": "Vendor ID:",
            "data": "AuthenticAMD",
            "children": [  # newer util-linux nests the model's fields under the vendor
                {"field": "Model name:", "data": "AMD EPYC"},
                {"field": "CPU family:", "data": "25"},
                {"field": "Model:", "data": "17"},
                {"field": "Flags:", "data": "fpu sse2 avx2 avx512f"},
            ],
        },
    ]
}


def test_name_family_model_and_flags_come_from_lscpu(monkeypatch):
    def run(argv, **kwargs):
        assert argv == ["lscpu", "--json"]
        return subprocess.CompletedProcess(argv, 0, stdout=json.dumps(LSCPU))

    monkeypatch.setattr(machine.platform, "processor", lambda: "x86_64")
    monkeypatch.setattr(machine.subprocess, "run", run)
    assert machine.processor_name() == "AMD EPYC (family 25, model 17)"
    assert machine.processor() == ("AMD EPYC", {"fpu", "sse2", "avx2", "avx512f"})
    assert machine.describe_machine().startswith("AMD EPYC (avx2, avx512f), ")


def test_without_lscpu_the_platform_names_it(monkeypatch):
    def run(argv, **kwargs):
        raise FileNotFoundError(argv[0])

    monkeypatch.setattr(machine.subprocess, "run", run)
    monkeypatch.setattr(machine.platform, "processor", lambda: "x86_64")
    assert machine.processor_name() == "x86_64"
    assert machine.processor() == ("x86_64", set())
