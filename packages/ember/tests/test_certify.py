"""`ember certify` end to end (real Ray, megatron-core and the embedded engine): the default
setup passes, and each planted fault fails its row."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ember.certify import CERTIFICATE, FAIL, NOT_APPLICABLE, PASS, REPORTED
from ember.cli import RUN_ERROR
from ember_core.certify import Fault

pytestmark = pytest.mark.slow

SMALL = ["--set", "rollout.rollout_batch_size=8"]
"""Eight prompt groups a rollout: the rows measure the same things on fewer samples."""
EVERY_ROW = [
    "--plugins", "r3_routing",
    "--set", "algorithm.use_kl_loss=true",  # a reference model, for row 6
    "--set", "rollout.temperature=0.7",  # a temperature left out shows
]  # fmt: skip
"""A setup where every row applies: routing replay, a reference, a temperature other than 1."""
FAILS = {
    Fault.DROPPED_TENSOR: "7.1",
    Fault.TEMPERATURE: "2",
    Fault.REPLAY_OFF: "4",
    Fault.REFERENCE: "6",
    Fault.STALE_VERSION: "7.5",
}


def certify(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    run = subprocess.run(
        [sys.executable, "-m", "ember.cli", "certify", *args, *SMALL,
         "--set", f"run.dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    path = tmp_path / "run" / CERTIFICATE
    return run, json.loads(path.read_text()) if path.is_file() else {}


def test_the_default_setup_is_certified(tmp_path):
    run, document = certify(tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    verdicts = {r["row"]: r["verdict"] for r in document["rows"]}
    assert document["passed"] is True
    # The default has no routing replay and no reference: those rows say so.
    assert verdicts == {
        "1": PASS, "2": PASS, "3": PASS, "4": NOT_APPLICABLE, "5": PASS,
        "6": NOT_APPLICABLE, "7.1": PASS, "7.2": PASS, "7.3": PASS, "7.4": NOT_APPLICABLE,
        "7.5": PASS, "8": PASS,
    }  # fmt: skip
    assert document["setup"]["family"] == "qwen3_moe"
    for row in document["rows"]:  # the table printed is the certificate written
        assert any(line.startswith(row["row"] + " ") for line in run.stdout.splitlines())
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("fault", list(FAILS), ids=[f.value for f in FAILS])
def test_a_planted_fault_fails_its_row(tmp_path, fault):
    run, document = certify(tmp_path, "--plant", fault.value, *EVERY_ROW)
    assert run.returncode == RUN_ERROR, run.stdout[-3000:] + run.stderr[-3000:]
    verdicts = {r["row"]: r["verdict"] for r in document["rows"]}
    assert verdicts[FAILS[fault]] == FAIL, run.stdout
    failing = next(line for line in run.stdout.splitlines() if line.startswith(FAILS[fault] + " "))
    assert failing.endswith(FAIL)
    # Every other row that was measured holds: the fault is caught where it is.
    others = {row for row, verdict in verdicts.items() if verdict == FAIL} - {FAILS[fault]}
    allowed = {
        Fault.TEMPERATURE: {"3", "5", "7.2", "7.3"},  # every log-prob the trainer computes
        Fault.STALE_VERSION: {"7.2"},  # not scored: the samples are not the update's
    }.get(fault, set())
    assert others <= allowed, run.stdout
    assert set(verdicts.values()) <= {PASS, FAIL, REPORTED}, run.stdout
