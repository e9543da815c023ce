"""End-to-end `ember train` on CPU through Ray: CI-mode plugins, data parallel, kill + resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

SHORT = [
    "--set", "rollout.rollout_batch_size=4",
    "--set", "rollout.n_samples_per_prompt=4",
    "--set", "train.num_steps_per_rollout=2",
    "--set", "run.plot=false",
    "--set", "run.tensorboard=false",
]  # fmt: skip


def ember(*args: str, run_dir: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ember.cli", "train", *args, *SHORT, "--set", f"run.dir={run_dir}"],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_r3_and_kl_checker_in_ci_mode(tmp_path):
    run = ember(
        "--plugins", "r3_routing,ci_kl_checker",
        "--set", "ci.test=true",
        "--set", "run.num_rollouts=2",
        "--set", "run.save_interval=0",
        run_dir=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    rollouts = records(tmp_path, "rollout")
    assert [r["rollout_id"] for r in rollouts] == [0, 1]
    # Under replay the experts the actor used are the rollout's.
    assert all(r["rollout/replay_agreement"] == 1.0 for r in rollouts)
    assert all(0.0 < r["rollout/routing_agreement"] <= 1.0 for r in rollouts)
    steps = records(tmp_path, "train")
    assert steps[0]["train/ppo_kl"] == 0.0
    assert "routing" in run.stderr + run.stdout and "mismatch" in run.stderr + run.stdout


def test_kl_checker_alone_passes_in_ci_mode(tmp_path):
    run = ember(
        "--plugins", "ci_kl_checker",
        "--set", "ci.test=true",
        "--set", "run.num_rollouts=1",
        "--set", "run.save_interval=0",
        run_dir=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    (rollout,) = records(tmp_path, "rollout")
    assert rollout["rollout/log_probs"] == rollout["rollout/ref_log_probs"]


def test_two_data_parallel_ranks(tmp_path):
    run = ember(
        "--set", "ray.data_parallel=2",
        "--set", "run.num_rollouts=2",
        "--set", "run.save_interval=0",
        run_dir=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    steps = records(tmp_path, "train")
    assert len(steps) == 2 * 2  # two rollouts of num_steps_per_rollout=2
    assert steps[0]["train/ppo_kl"] == 0.0


def test_sigkill_mid_training_then_resume(tmp_path):
    args = [
        sys.executable, "-m", "ember.cli", "train", *SHORT,
        "--set", "run.num_rollouts=6",
        "--set", "run.save_interval=2",
        "--set", f"run.dir={tmp_path}",
    ]  # fmt: skip
    proc = subprocess.Popen(
        args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 300
    try:
        # Kill once the first checkpoint exists and training has moved past it.
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail("the run finished before it could be killed; make it longer")
            done = [r for r in records(tmp_path, "rollout")] if metrics.exists() else []
            if len(done) >= 3:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the run made no progress in time")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    resumed = subprocess.run(
        [sys.executable, "-m", "ember.cli", "train", "--resume", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rollouts = records(tmp_path, "rollout")
    assert [r["rollout_id"] for r in rollouts] == list(range(6))
    steps = records(tmp_path, "train")
    assert [r["step"] for r in steps] == list(range(12))

    checkpoints = sorted((tmp_path / "checkpoints").glob("rollout_*"))
    assert [c.name for c in checkpoints] == ["rollout_000003", "rollout_000005"]
    assert not list((tmp_path / "checkpoints").glob(".*"))  # no half-written checkpoint left
    for checkpoint in checkpoints:
        assert json.loads((checkpoint / "driver.json").read_text())["rollout_id"] == int(
            checkpoint.name.split("_")[1]
        )
        shards = list((checkpoint / "train").rglob("*.pt"))
        assert shards
        for shard in shards:
            state = torch.load(shard, weights_only=True, map_location="cpu")
            assert state
