"""SIGKILL of a real `ember train` under Ray, in the default overlapped loop, then `--resume`.

`test_async_resume.py` kills at exact points of the loop, with the actors in the killed process
(the in-process runtime). Here the run is under Ray (`ray.enabled=true`; the default config
alone would run in one process): the driver starts its own local Ray with the default loop
(rollout i + 1 generating while rollout i trains, weights broadcast), is SIGKILLed once it has
published a checkpoint and gone on, and the resumed run must log what an uninterrupted run
logs, leaving no process of the killed run's Ray behind; a killed actor process stops the run
with one line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from ember_runs import ember_command

from ember import processes
from ember.checkpoints import complete_checkpoints

pytestmark = pytest.mark.slow

RUN = [
    "--set", "train.model_overrides.num_layers=2",
    "--set", "rollout.rollout_batch_size=2",
    "--set", "rollout.n_samples_per_prompt=2",
    "--set", "rollout.max_response_len=8",
    "--set", "train.num_steps_per_rollout=2",
    "--set", "run.num_rollouts=5",
    "--set", "run.save_interval=1",
    "--set", "run.plot=false",
    "--set", "run.tensorboard=false",
    "--set", "ray.threads_per_actor=1",
    # What these tests kill are Ray's processes (the driver with its Ray, an actor's worker):
    # under the default ray.enabled=auto this config would run every actor in one process.
    "--set", "ray.enabled=true",
]  # fmt: skip
ENV = {**os.environ, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "RAY_USAGE_STATS_ENABLED": "0"}


def train(*args: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "ember.cli", "train", *args]
    return subprocess.Popen(command, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def finish(process: subprocess.Popen, timeout: float = 900) -> None:
    out, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, out.decode(errors="replace")[-3000:]


def comparable(run_dir: Path) -> list[dict]:
    """The run's records without wall-clock time and `perf/*` timings."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [
        {k: v for k, v in record.items() if k != "time" and not k.startswith("perf/")}
        for record in map(json.loads, lines)
    ]


def logged_rollouts(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["rollout_id"] for r in records if r["kind"] == "rollout"]


def command(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())[:200]
    except psutil.Error:
        return f"{pid} (gone)"


def alive(pids: set[int]) -> set[int]:
    return {pid for pid in pids if processes.alive(pid)}


def test_sigkill_of_the_overlapped_driver_resumes_to_the_uninterrupted_runs_metrics(tmp_path):
    reference, run = tmp_path / "reference", tmp_path / "run"
    # The uninterrupted run in this process (`ember_runs`): an in-process run writes the Ray
    # run's metrics, record for record (test_runtime_parity.py).
    assert RUN[-2:] == ["--set", "ray.enabled=true"]
    untouched = ember_command(["train", *RUN[:-2], "--set", f"run.dir={reference}"], timeout=900)
    assert untouched.returncode == 0, untouched.stderr[-3000:]
    assert logged_rollouts(reference) == [0, 1, 2, 3, 4]
    staleness = [r["rollout/staleness"] for r in map(json.loads, (reference / "metrics.jsonl")
                 .read_text().splitlines()) if r["kind"] == "rollout"]  # fmt: skip
    assert staleness == [0.0, 1.0, 1.0, 1.0, 1.0]  # the default overlaps rollout and training

    driver = train(*RUN, "--set", f"run.dir={run}")
    deadline = time.monotonic() + 900
    # Kill once rollout 2 is logged: checkpoint 1 is published, rollout 3 is generating.
    while 2 not in logged_rollouts(run):
        assert driver.poll() is None, driver.stdout.read().decode(errors="replace")[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.2)
    ray_processes = processes.descendants([driver.pid])
    assert ray_processes  # its own Ray: GCS, raylet, workers and actors
    os.kill(driver.pid, signal.SIGKILL)
    driver.communicate()
    assert complete_checkpoints(run)  # at least rollout 1's
    # The killed driver's Ray goes with it (its head processes share its fate, and the
    # workers and actors theirs).
    deadline = time.monotonic() + 120
    while alive(ray_processes) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive(ray_processes), [command(pid) for pid in sorted(alive(ray_processes))]

    finish(train("--resume", str(run)))
    assert logged_rollouts(run) == [0, 1, 2, 3, 4]
    assert comparable(run) == comparable(reference)


def _actor_process(driver: subprocess.Popen, name: str) -> psutil.Process:
    """The live process of the actor class `name` below `driver` (Ray titles it ray::Name)."""
    for pid in processes.descendants([driver.pid]):
        try:
            if f"ray::{name}" in " ".join(psutil.Process(pid).cmdline()):
                return psutil.Process(pid)
        except psutil.Error:
            continue
    raise AssertionError(f"no ray::{name} process below the driver")


@pytest.mark.parametrize(
    ("actor", "role"), [("TrainRank", "training rank 0"), ("RolloutEngine", "rollout engine 0")]
)
def test_a_killed_process_stops_the_run_with_one_line_naming_it_and_the_resume(
    tmp_path, actor, role
):
    run = tmp_path / "run"
    # An engine stops the run only without fault tolerance (otherwise it is replaced:
    # test_engine_faults_ray.py); a training rank always does.
    driver = train(*RUN, "--set", "run.num_rollouts=50", "--set", f"run.dir={run}",
                   "--set", "fault_tolerance.enabled=false")  # fmt: skip
    deadline = time.monotonic() + 900
    while 2 not in logged_rollouts(run):  # checkpoints of rollouts 0 and 1 published
        assert driver.poll() is None, driver.stdout.read().decode(errors="replace")[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.2)
    victim = _actor_process(driver, actor)
    victim.kill()
    out, _ = driver.communicate(timeout=300)
    from ember.cli import RUN_ERROR

    assert driver.returncode == RUN_ERROR, out.decode(errors="replace")[-3000:]
    last = out.decode(errors="replace").strip().splitlines()[-1]
    newest = int(complete_checkpoints(run)[-1].name.removeprefix("rollout_"))
    assert last.startswith(f"ember train: error: {role} (pid {victim.pid} on "), last
    assert last.endswith(
        f"continue from the checkpoint of rollout {newest} with: ember train --resume {run}"
    ), last
    assert newest >= 1
