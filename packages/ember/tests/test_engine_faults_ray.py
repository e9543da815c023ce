"""Engines that fail in a real `ember train` under Ray: SIGKILLed, SIGSTOPped (hung), their SGLang
server killed, and a slot that fails past `fault_tolerance.max_restarts`.

Nothing stands in: the driver starts its own Ray, the engines are the embedded ones (or the real
SGLang server on CPU), and the victims are their processes, found by title below the driver.
Every run here is under Ray without asking (`ray.enabled=auto`: two engines, or an SGLang
server, each need a process of their own), which engine replacement needs: an engine in the
driver's process cannot fail apart from the run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from test_kill_resume_ray import ENV, comparable, logged_rollouts

from ember import processes
from ember.checkpoints import complete_checkpoints
from ember_rollout import sglang_cpu

pytestmark = pytest.mark.slow

RUN = [
    "--set", "train.model_overrides.num_layers=2",
    "--set", "rollout.rollout_batch_size=8",
    "--set", "rollout.n_samples_per_prompt=4",
    "--set", "train.num_steps_per_rollout=2",
    "--set", "run.num_rollouts=12",
    "--set", "run.save_interval=4",
    "--set", "run.plot=false",
    "--set", "run.tensorboard=false",
    "--set", "ray.threads_per_actor=1",
    "--set", "ray.num_engines=2",
    # The CI checks: an audit after the replacement must pass exactly as before it.
    "--plugins", "ci_kl_checker",
    "--set", "ci.test=true",
    "--set", "ci_kl_checker.audit_interval=4",
    "--set", "fault_tolerance.health_check_interval_s=1",
    "--set", "fault_tolerance.health_check_timeout_s=5",
]  # fmt: skip


class Run:
    """An `ember train` below this test, its output collected as it comes."""

    def __init__(self, run_dir: Path, *args: str) -> None:
        self.dir = run_dir
        self.log = run_dir.parent / f"{run_dir.name}.log"
        command = [sys.executable, "-m", "ember.cli", "train", *RUN, *args,
                   "--set", f"run.dir={run_dir}"]  # fmt: skip
        with self.log.open("wb") as sink:
            self.process = subprocess.Popen(command, env=ENV, stdout=sink, stderr=subprocess.STDOUT)

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, what, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while not what():
            assert self.process.poll() is None, self.output[-3000:]
            assert time.monotonic() < deadline, self.output[-3000:]
            time.sleep(0.1)

    def finish(self, timeout: float = 600) -> int:
        return self.process.wait(timeout=timeout)

    def engines(self) -> list[psutil.Process]:
        """The live engine actors' processes (Ray titles them ray::RolloutEngine, or
        ray::PartialRolloutEngine under partial rollouts)."""
        found = []
        for pid in processes.descendants([self.process.pid]):
            try:
                proc = psutil.Process(pid)
                if re.search(r"ray::(Partial)?RolloutEngine\b", " ".join(proc.cmdline())):
                    found.append(proc)
            except psutil.Error:
                continue
        return found


def rollout_records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "rollout"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The same run, untouched."""
    run = Run(tmp_path_factory.mktemp("reference") / "run")
    assert run.finish() == 0, run.output[-3000:]
    return run.dir


def test_a_killed_then_a_hung_engine_are_each_replaced_and_the_run_completes(tmp_path, reference):
    """One run, two failures: engine 1 SIGKILLed once rollout 3 is logged, then, once its
    replacement serves and rollout 7 is logged, the other engine SIGSTOPped (hung: the process
    stays and answers nothing). Each slot is replaced once and the run ends as the untouched
    run does."""
    run = Run(tmp_path / "run")
    run.wait_for(lambda: 3 in logged_rollouts(run.dir))  # past audit 0, into the overlap
    killed = run.engines()[-1]
    before = logged_rollouts(run.dir)
    killed.kill()
    replaced = re.compile(r"rollout engine \d replaced \(pid (\d+)\)")
    run.wait_for(lambda: replaced.search(run.output))
    replacement = int(replaced.search(run.output)[1])
    run.wait_for(lambda: 7 in logged_rollouts(run.dir))
    (hung,) = [e for e in run.engines() if e.pid != replacement]
    hung.suspend()  # SIGSTOP
    assert run.finish() == 0, run.output[-3000:]
    output = run.output
    for victim in (killed, hung):
        assert not psutil.pid_exists(victim.pid) or victim.status() == psutil.STATUS_ZOMBIE
    rollouts = rollout_records(run.dir)
    assert [r["rollout_id"] for r in rollouts] == list(range(12))
    assert sum(r["rollout/engine_failures"] for r in rollouts) == 2.0
    assert sum(r["rollout/engine_restarts"] for r in rollouts) == 2.0
    pattern = r"rollout engine (\d) failed \((.*?)\); starting replacement 1 of at most 3"
    first, second = re.findall(pattern, output)
    assert first[0] != second[0]  # each slot replaced once
    assert first[1].startswith(f"died (pid {killed.pid} on "), first
    assert second[1] == "did not answer a health probe within 5 s (hung)", second
    # Each replacement serves the trainer's weights: after the push that follows, the two
    # engines hash to the same bytes.
    assert len(replaced.findall(output)) == 2
    assert re.search(r"rollout engine \d replaced \(pid \d+\), serving weight version \d+", output)
    assert "the 2 engines serve the same weights (sha256 " in output
    # The exact checks hold at every audit, those after the replacements too.
    for audit_id in (0, 4, 8):
        assert re.search(rf"audit rollout {audit_id}\b[^\n]*: first_step_ppo_kl passed", output)
    # Rollouts finished before the first failure are the untouched run's, record for record.
    # Every request carries its own seed, so a request sent again samples the same tokens on
    # the other engine: every rollout's rewards are the untouched run's too, and the rest
    # differ only by the rounding of another batch's forward (below 1e-6 here).
    counts = re.compile(
        r"rollout/(engine\d+_requests|engine_failures|engine_restarts|resent_requests)"
    )
    got, want = comparable(run.dir), comparable(reference)
    assert len(got) == len(want)
    for mine, theirs in zip(got, want, strict=True):
        assert mine.keys() == theirs.keys()
        exact = mine["kind"] == "rollout" and mine["rollout_id"] in before
        for key, value in theirs.items():
            if counts.fullmatch(key):
                continue
            if (
                exact
                or key in ("rollout/rewards", "rollout/response_length")
                or not isinstance(value, float)
            ):
                assert mine[key] == value, (mine["rollout_id"], key)
            else:
                assert mine[key] == pytest.approx(value, abs=1e-5), (mine["rollout_id"], key)


def test_an_engine_killed_under_partial_rollouts_is_replaced_once(tmp_path):
    """With partial rollouts the driver pushes, probes and replaces while the manager's round
    still runs: the replacement must serve to the end (the dead engine's late failure is the
    dead engine's, not its slot's), the one failure counted once, every audit passing."""
    run = Run(tmp_path / "run", "--set", "rollout.partial_rollouts=true",
              "--set", "rollout.max_staleness=2")  # fmt: skip
    run.wait_for(lambda: 3 in logged_rollouts(run.dir))
    victim = run.engines()[-1]
    victim.kill()
    run.wait_for(lambda: "replaced (pid" in run.output)
    replacement = int(re.search(r"rollout engine \d replaced \(pid (\d+)\)", run.output)[1])
    run.wait_for(lambda: 10 in logged_rollouts(run.dir))  # rounds after the replacement
    assert psutil.pid_exists(replacement), run.output[-3000:]
    assert run.finish() == 0, run.output[-3000:]
    output = run.output
    rollouts = rollout_records(run.dir)
    assert [r["rollout_id"] for r in rollouts] == list(range(12))
    assert sum(r["rollout/engine_failures"] for r in rollouts) == 1.0
    assert sum(r["rollout/engine_restarts"] for r in rollouts) == 1.0
    assert len(re.findall(r"starting replacement", output)) == 1, output[-3000:]
    assert "the 2 engines serve the same weights (sha256 " in output
    for audit_id in (0, 4, 8):
        assert re.search(rf"audit rollout {audit_id}\b[^\n]*: first_step_ppo_kl\S* passed", output)


def test_a_slot_that_fails_past_its_restarts_stops_the_run_with_one_line(tmp_path):
    run = Run(tmp_path / "run", "--set", "fault_tolerance.max_restarts=1",
              "--set", "run.num_rollouts=200")  # fmt: skip
    run.wait_for(lambda: 5 in logged_rollouts(run.dir))  # checkpoint of rollout 3 published
    run.engines()[-1].kill()
    replaced = re.compile(r"rollout engine (\d) replaced \(pid (\d+)\)")
    run.wait_for(lambda: replaced.search(run.output))
    slot, pid = replaced.search(run.output).groups()
    psutil.Process(int(pid)).kill()  # the same slot again
    assert run.finish() != 0
    from ember.cli import RUN_ERROR

    assert run.process.returncode == RUN_ERROR
    last = run.output.strip().splitlines()[-1]
    newest = int(complete_checkpoints(run.dir)[-1].name.removeprefix("rollout_"))
    assert last.startswith(f"ember train: error: rollout engine {slot} (pid {pid} on "), last
    assert "it was replaced 1 time(s), fault_tolerance.max_restarts=1" in last, last
    assert last.endswith(
        f"continue from the checkpoint of rollout {newest} with: ember train --resume {run.dir}"
    ), last


@pytest.mark.sglang
@pytest.mark.skipif(
    not sglang_cpu.sglang_installed(), reason=f"needs SGLang: {sglang_cpu.EXTRA_HINT}"
)
def test_a_killed_sglang_server_is_replaced_and_the_run_completes(tmp_path):
    run = Run(
        tmp_path / "run",
        "--set", "engine.kind=sglang",
        "--set", "ray.num_engines=1",
        "--set", "run.num_rollouts=6",
        "--set", "run.save_interval=0",
        # One request at a time, so the kill finds requests running.
        "--set", "engine.sglang.max_concurrency=1",
    )  # fmt: skip
    run.wait_for(lambda: 2 in logged_rollouts(run.dir), timeout=900)

    def servers() -> list[psutil.Process]:
        """The run's SGLang servers (their command names its model under the run directory),
        each the leader of its process group."""
        found = []
        for proc in psutil.process_iter():
            try:
                words = " ".join(proc.cmdline())
                if "sglang.launch_server" in words and str(run.dir) in words:
                    if os.getpgid(proc.pid) == proc.pid:
                        found.append(proc)
            except (psutil.Error, ProcessLookupError):
                continue
        return found

    (server,) = servers()
    os.killpg(os.getpgid(server.pid), signal.SIGKILL)
    assert run.finish(timeout=1200) == 0, run.output[-3000:]
    rollouts = rollout_records(run.dir)
    assert [r["rollout_id"] for r in rollouts] == list(range(6))
    assert sum(r["rollout/engine_restarts"] for r in rollouts) == 1.0
    failed = r"rollout engine 0 failed \((died|SGLang server http://\S+ (exited|failed GET))"
    assert re.search(failed, run.output), run.output[-3000:]
    assert re.search(r"rollout engine 0 replaced \(pid \d+\), serving weight", run.output)
    assert servers() == []  # the killed one is gone, the replacement's stopped with the run
