"""Engines that fail in a real `ember train` under Ray: SIGKILLed, SIGSTOPped (hung), their SGLang
server killed (under partial rollouts, with R3 and the CI checks), and a slot that fails past
`fault_tolerance.max_restarts`.

Nothing stands in: the driver starts its own Ray, the engines are the embedded ones (or the real
SGLang server on CPU), and the victims are their processes, found by title below the driver.
The untouched run the killed-then-hung one is compared with kills nothing: it joins the
session's Ray.
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
from ember_runs import ember_command
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


def rollout_records(run_dir: Path, kind: str = "rollout") -> list[dict]:
    """The run's metrics records of `kind` (rollout, or train: one per optimizer step)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The same run, untouched: nothing in it is killed, so it runs on the session's Ray
    (`ember_runs.ember_command`)."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    done = ember_command(["train", *RUN, "--set", f"run.dir={run_dir}"], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


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
def test_a_killed_sglang_server_under_partial_rollouts_is_replaced_and_r3_holds_throughout(
    tmp_path,
):
    """The real SGLang server on CPU behind `ember train` on the overlapped loop with partial
    rollouts, R3 and the CI checks (one run for all of it: a server launch costs about a minute
    of a 2-core machine). Pushes land while requests run (paused in place, continued after),
    and every token's recorded experts and log-prob come from one forward. Once rollout 2 is
    logged the server is SIGKILLed: the run replaces it, which launches a server again, and
    completes; the audit after the replacement holds exactly as the one before it.

    R3 with the CI checks on the real server's prefix cache (which partial rollouts turn off)
    is `test_e2e_smollm2.py`'s upcycled MoE on SGLang."""
    run = Run(
        tmp_path / "run",
        "--set", "engine.kind=sglang",
        "--set", "ray.num_engines=1",
        "--set", "rollout.partial_rollouts=true",
        "--set", "rollout.max_staleness=2",
        "--plugins", "r3_routing,ci_kl_checker",
        "--set", "algorithm.use_kl_loss=true",  # a reference model, for the reference checks
        # One request at a time, and answers of up to 64 tokens: a rollout's requests then take
        # longer than a training step and its push, so the pushes between the audits at 0 and 4
        # find one running (at the default 8 tokens only some did), and the kill finds one too.
        "--set", "engine.sglang.max_concurrency=1",
        "--set", "rollout.max_response_len=64",
        "--set", "run.num_rollouts=6",
        "--set", "run.save_interval=0",
        "--set", "run.dump_rollouts=true",
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
    output = run.output
    rollouts = rollout_records(run.dir)
    assert [r["rollout_id"] for r in rollouts] == list(range(6))
    assert sum(r["rollout/engine_restarts"] for r in rollouts) == 1.0
    failed = r"rollout engine 0 failed \((died|SGLang server http://\S+ (exited|failed GET))"
    assert re.search(failed, output), output[-3000:]
    assert re.search(r"rollout engine 0 replaced \(pid \d+\), serving weight", output)
    assert servers() == []  # the killed one is gone, the replacement's stopped with the run

    assert [r.get("rollout/audit") for r in rollouts] == [1.0, None, None, None, 1.0, None]
    multi_version = 0
    for rollout_id, r in enumerate(rollouts):
        dump = (run.dir / "rollouts" / f"{rollout_id:06d}.jsonl").read_text().splitlines()
        for line in dump[1:]:  # after the dump's header
            versions = json.loads(line)["weight_versions"]
            numbers = [int(v) for _, v in versions]
            assert numbers == sorted(set(numbers)) and rollout_id - 1 - numbers[0] <= 2
            multi_version += len(versions) > 1
        assert r["rollout/staleness_max"] <= 2
    # Pushes landed mid-request: the server recorded spans of two versions in some samples.
    assert multi_version > 0
    assert sum(r["rollout/multi_version_samples"] * r["rollout/num_samples"] for r in rollouts) == (
        multi_version
    )
    for audit in rollouts[::4]:
        # An audit generates in turn, from the trainer's current weights: fp32 server and fp32
        # trainer, same weights, so the engine's log-probs are the trainer's to rounding, per
        # token, and the actor replayed exactly the experts SGLang chose (the replacement's
        # too, at rollout 4).
        assert audit["rollout/staleness"] == 0.0
        assert audit["rollout/multi_version_samples"] == 0.0
        assert audit["rollout/train_rollout_logprob_max_abs_diff"] <= 1e-4
        assert audit["rollout/replay_agreement"] == 1.0
    # At rollout 0 the reference, replaying the actor's routing, is the actor.
    assert rollouts[0]["rollout/ref_replayed_log_probs_max_abs_diff"] < 1e-8
    steps = rollout_records(run.dir, "train")
    assert steps and all(s["train/replay_agreement"] == 1.0 for s in steps)
    # The first step of each audited rollout starts exactly on-policy.
    firsts = {}
    for s in steps:
        firsts.setdefault(s["rollout_id"], s)
    assert [firsts[i]["train/ppo_kl"] for i in (0, 4)] == [0.0, 0.0]
    checks = ("train_rollout_mismatch_max", "first_step_ppo_kl_max", "replay_agreement")
    for audit_id in (0, 4):
        for check in (*checks, "recorded_routing_agreement"):
            found = re.search(rf"audit rollout {audit_id}\b[^\n]*: {check} passed: ", output)
            assert found, (audit_id, check)
    # The first rollout after audit 0 that holds stale samples is the off-policy audit.
    for check in ("recorded_versions", "replay_agreement"):
        found = re.search(rf"off-policy audit rollout [123]\b[^\n]*: {check} passed: ", output)
        assert found, check
    # The servers logged to the run directory, took the pushes by broadcast and paused for the
    # pushes that found requests running.
    logs = sorted((run.dir / "sglang").glob("sglang-0-*.log"))
    assert len(logs) >= 2  # the killed server's and its replacement's
    text = "".join(log.read_text() for log in logs)
    assert "update_weights_from_distributed" in text and "pause_generation" in text
