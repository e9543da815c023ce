"""SIGKILL and `--resume` with the rollout manager: one-step-off-policy runs lose and repeat no
rollout, and a run resumes with another number of engines (`resume_harness`: the actors in the
killed process, the in-process runtime; the resume with two engines is under Ray)."""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest

from ember.checkpoints import PENDING_ROLLOUTS, complete_checkpoints

pytestmark = pytest.mark.slow

RUN = [
    "--set", "train.model_overrides.num_layers=2",
    "--set", "rollout.rollout_batch_size=2",
    "--set", "rollout.n_samples_per_prompt=2",
    "--set", "rollout.max_response_len=8",
    "--set", "train.num_steps_per_rollout=2",
    "--set", "run.num_rollouts=4",
    "--set", "run.plot=false",
    "--set", "run.tensorboard=false",
    "--set", "run.dump_rollouts=true",
    "--set", "ray.threads_per_actor=1",
]  # fmt: skip
ASYNC = [*RUN, "--set", "rollout.async=true", "--set", "run.save_interval=1"]
"""A checkpoint after every rollout, the newest two kept."""
AHEAD = [*RUN, "--set", "rollout.max_staleness=2", "--set", "run.save_interval=1",
         "--set", "run.num_rollouts=5"]  # fmt: skip
"""Two rollouts generating ahead of the trainer, a checkpoint after every rollout."""
SYNC = [*RUN, "--set", "rollout.async=false", "--set", "run.save_interval=2"]
"""Checkpoints after rollouts 1 and 3."""


@pytest.fixture(scope="module")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from resume_harness import Launcher

    server = Launcher(tmp_path_factory.mktemp("harness") / "server.log")
    try:
        yield server
    finally:
        server.close()


def records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def ids(run_dir: Path, kind: str = "rollout") -> list[int]:
    return [r["rollout_id"] for r in records(run_dir, kind)]


def comparable(run_dir: Path) -> list[dict]:
    """The run's records without wall-clock time, `perf/*` timings and per-engine counts."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [
        {
            k: v
            for k, v in record.items()
            if k != "time" and not k.startswith(("perf/", "rollout/engine"))
        }
        for record in map(json.loads, lines)
    ]


def complete(run_dir: Path) -> list[str]:
    return [p.name for p in complete_checkpoints(run_dir)]


def dumped(run_dir: Path, rollout_id: int) -> list[dict]:
    """The dumped samples of a rollout (the lines after the dump's header)."""
    path = run_dir / "rollouts" / f"{rollout_id:06d}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()[1:]]


def test_async_sigkill_in_generation_and_checkpoint_write_then_resume(launcher, tmp_path):
    """Killed while rollout 3 generates (during rollout 2's iteration) and while checkpoint 2 is
    written, each time resumed, the async run logs every rollout once and its records equal an
    uninterrupted async run's, value for value: the checkpoint holds the rollout generated
    ahead, so the resume neither regenerates it from newer weights nor skips its prompts."""
    train = launcher.trainer(tmp_path)
    reference, run = tmp_path / "reference", tmp_path / "run"
    train(*ASYNC, "--set", f"run.dir={reference}")
    staleness = [r["rollout/staleness"] for r in records(reference, "rollout")]
    assert staleness == [0.0, 1.0, 1.0, 1.0]

    train(*ASYNC, "--set", f"run.dir={run}", kill="rollout:3")
    # Rollout 3 generates before rollout 2 trains: rollout 2 was never logged.
    assert ids(run) == [0, 1] and complete(run) == ["rollout_000000", "rollout_000001"]
    newest = complete_checkpoints(run)[-1]
    with (newest / PENDING_ROLLOUTS).open("rb") as handle:  # generated before the kill
        assert sorted(pickle.load(handle)) == [2]

    train("--resume", str(run), kill="checkpoint:2")
    assert ids(run) == [0, 1, 2] and complete(run) == ["rollout_000000", "rollout_000001"]

    train("--resume", str(run))
    assert ids(run) == [0, 1, 2, 3]
    assert [r["step"] for r in records(run, "train")] == list(range(8))
    assert comparable(run) == comparable(reference)
    for rollout_id in range(4):
        assert dumped(run, rollout_id) == dumped(reference, rollout_id)
    assert complete(run) == ["rollout_000002", "rollout_000003"]
    assert not (complete_checkpoints(run)[-1] / PENDING_ROLLOUTS).exists()  # nothing ahead of 3


def test_a_run_resumes_with_another_number_of_engines(launcher, tmp_path):
    """The prompt stream lives once, in the rollout manager: a run checkpointed with one engine
    continues with two, from the same place in the stream, every rollout on both engines."""
    train = launcher.trainer(tmp_path)
    reference, run = tmp_path / "reference", tmp_path / "run"
    train(*SYNC, "--set", f"run.dir={reference}")
    assert [r["rollout/staleness"] for r in records(reference, "rollout")] == [0.0] * 4

    train(*SYNC, "--set", f"run.dir={run}", kill="train:2")
    assert ids(run) == [0, 1] and complete(run) == ["rollout_000001"]
    # Two engines are two processes: the in-process run resumes under Ray (ray.enabled=auto).
    train("--resume", str(run), "--set", "ray.num_engines=2")
    assert ids(run) == [0, 1, 2, 3]
    resumed = records(run, "rollout")
    assert all(r["rollout/engine1_requests"] > 0 for r in resumed[2:])
    assert all(r["rollout/engine0_requests"] > 0 for r in resumed)
    for rollout_id in (2, 3):
        prompts = [(s["prompt"], s["label"]) for s in dumped(run, rollout_id)]
        assert prompts == [(s["prompt"], s["label"]) for s in dumped(reference, rollout_id)]


def test_two_ahead_sigkill_in_generation_then_resume_exactly(launcher, tmp_path):
    """With rollout.max_staleness=2 rollout j comes from the weights of rollout j - 3: the
    staleness is 0, 1, 2, 2, 2 and each rollout's histogram says so. Killed while rollout 3
    generates (iteration 1), the run resumes from checkpoint 0, which holds rollouts 1 and 2
    generated ahead, and its records and samples (versions included) equal the uninterrupted
    run's."""
    train = launcher.trainer(tmp_path)
    reference, run = tmp_path / "reference", tmp_path / "run"
    train(*AHEAD, "--set", f"run.dir={reference}")
    rollouts = records(reference, "rollout")
    assert [r["rollout/staleness"] for r in rollouts] == [0.0, 1.0, 2.0, 2.0, 2.0]
    for r in rollouts:
        gap = r["rollout/staleness"]
        histogram = [r[f"rollout/staleness_{g}"] for g in range(3)]
        assert histogram == [1.0 if g == gap else 0.0 for g in range(3)]
        assert r["rollout/staleness_max"] == gap and r["rollout/regenerated"] == 0.0
    for rollout_id in range(5):
        versions = {s["weight_version"] for s in dumped(reference, rollout_id)}
        assert versions == {str(max(rollout_id - 3, -1))}

    train(*AHEAD, "--set", f"run.dir={run}", kill="rollout:3")
    assert ids(run) == [0] and complete(run) == ["rollout_000000"]
    with (complete_checkpoints(run)[-1] / PENDING_ROLLOUTS).open("rb") as handle:
        assert sorted(pickle.load(handle)) == [1, 2]
    train("--resume", str(run))
    assert ids(run) == [0, 1, 2, 3, 4]
    assert comparable(run) == comparable(reference)
    for rollout_id in range(5):
        assert dumped(run, rollout_id) == dumped(reference, rollout_id)


def test_a_lower_bound_on_resume_generates_stale_rollouts_again(launcher, tmp_path):
    """Checkpoint 1 of a max_staleness=2 run holds rollouts 2 and 3 from versions -1 and 0;
    resumed with max_staleness=1 they would be 2 versions old, so each is dropped and generated
    again from the current weights, and `rollout/regenerated` counts its samples."""
    train = launcher.trainer(tmp_path)
    run = tmp_path / "run"
    train(*AHEAD, "--set", f"run.dir={run}", kill="rollout:4")
    assert ids(run) == [0, 1] and complete(run)[-1] == "rollout_000001"
    train("--resume", str(run), "--set", "rollout.max_staleness=1")
    rollouts = records(run, "rollout")
    assert [r["rollout_id"] for r in rollouts] == [0, 1, 2, 3, 4]
    per_rollout = 2 * 2  # rollout_batch_size x n_samples_per_prompt
    assert [r["rollout/regenerated"] for r in rollouts] == [0.0, 0.0, per_rollout, per_rollout, 0]
    assert all(r["rollout/staleness_max"] <= 1 for r in rollouts[2:])
    for rollout_id in (2, 3):  # from the weights the trainer held when it took them
        assert {s["weight_version"] for s in dumped(run, rollout_id)} == {str(rollout_id - 1)}
