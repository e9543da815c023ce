"""Resume and fresh starts refuse what they cannot do right, before Ray starts; metrics.jsonl
keeps every rollout once, and its damaged lines are dropped only where a kill explains them."""

from __future__ import annotations

import json
import logging
import pickle
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray

import ember.calls
from ember.checkpoints import PENDING_ROLLOUT, PENDING_ROLLOUTS, truncate_metrics
from ember.cli import main
from ember.config import load_config, write_resolved
from ember.driver import Actors, Driver
from ember.metrics import read_metrics
from ember_core.types import Sample
from ember_rollout.rollout import RolloutBatch


def record(kind: str, rollout_id: int, step: int) -> str:
    return json.dumps({"kind": kind, "rollout_id": rollout_id, "step": step, "train/loss": 0.5})


def rows(rollouts: int) -> list[str]:
    """The lines of `rollouts` rollouts with two train steps each."""
    out = []
    for i in range(rollouts):
        out += [record("rollout", i, i), record("train", i, 2 * i), record("train", i, 2 * i + 1)]
    return out


def run_dir(tmp_path: Path, *overrides: str) -> Path:
    """A run directory as `ember train` leaves it: config.yaml and three rollouts of metrics."""
    path = tmp_path / "run"
    path.mkdir()
    config, _ = load_config("default", overrides=[f"run.dir={path}", *overrides])
    write_resolved(config, path)
    (path / "metrics.jsonl").write_text("".join(f"{line}\n" for line in rows(3)))
    return path


STREAM = {"dataset": {"epoch": 0, "position": 2}}
"""The rollout manager's state: where the prompt stream stands."""


def checkpoint(run: Path, rollout_id: int, *, name: str | None = None) -> Path:
    path = run / "checkpoints" / (name or f"rollout_{rollout_id:06d}")
    (path / "train").mkdir(parents=True)
    state = {"rollout_id": rollout_id, "accumulated_step": 2 * rollout_id + 2, "rollout": STREAM}
    (path / "driver.json").write_text(json.dumps(state))
    return path


def error_line(capsys: pytest.CaptureFixture[str]) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


# --------------------------------------------------------------------------------------------
# --resume and fresh starts
# --------------------------------------------------------------------------------------------


def test_resume_without_a_complete_checkpoint_is_an_error_before_ray(tmp_path, capsys):
    run = run_dir(tmp_path)
    before = (run / "metrics.jsonl").read_bytes()
    # A checkpoint killed while being written is not one to resume from.
    checkpoint(run, 1, name=".rollout_000001.tmp")
    assert main(["train", "--resume", str(run)]) == 2
    assert error_line(capsys) == (
        f"ember train: error: {run}: no complete checkpoint to resume from (no "
        "checkpoints/rollout_*/driver.json); to start the run over, give its config.yaml a new "
        "run.dir"
    )
    assert not ray.is_initialized()
    assert (run / "metrics.jsonl").read_bytes() == before  # nothing appended, nothing dropped


def test_an_older_checkpoint_of_several_engines_cannot_resume_and_says_why_before_ray(
    tmp_path, capsys
):
    """Each engine used to own a prompt stream; several of them cannot become the one stream
    of the rollout manager (one engine's can, see below)."""
    run = run_dir(tmp_path)
    saved = checkpoint(run, 1)
    state = {"rollout_id": 1, "accumulated_step": 4, "engines": [STREAM, STREAM]}
    (saved / "driver.json").write_text(json.dumps(state))
    assert main(["train", "--resume", str(run)]) == 2
    assert error_line(capsys) == (
        f"ember train: error: {saved}/driver.json: no rollout state to resume from (expected a "
        "'rollout' entry, or the 'engines' list of a single-engine run; found "
        "['accumulated_step', 'engines', 'rollout_id'])"
    )
    assert not ray.is_initialized()


def handles(calls: list[tuple[str, object]], *names: str) -> list[SimpleNamespace]:
    """Actor handles whose `method.remote(arg)` records (actor.method, arg)."""

    def handle(name: str) -> SimpleNamespace:
        def method(attr: str) -> SimpleNamespace:
            return SimpleNamespace(remote=lambda *a: calls.append((f"{name}.{attr}", *a)))

        return SimpleNamespace(load=method("load"), load_state_dict=method("load_state_dict"))

    return [handle(n) for n in names]


@pytest.mark.parametrize(
    "layout",
    [{"rollout": STREAM}, {"engines": [STREAM]}],
    ids=["manager state", "one engine's state from before the manager"],
)
def test_restore_gives_the_one_prompt_stream_to_the_manager_whatever_the_engine_count(
    tmp_path, monkeypatch, layout
):
    run = run_dir(tmp_path)
    saved = checkpoint(run, 1)
    (saved / "driver.json").write_text(
        json.dumps({"rollout_id": 1, "accumulated_step": 4, **layout})
    )
    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(ember.calls, "get", lambda refs: refs)
    config, _ = load_config("default", overrides=[f"run.dir={run}", "ray.num_engines=3"])
    driver = Driver(config, run)
    (rank,) = handles(calls, "rank0")
    (manager,) = handles(calls, "manager")
    driver.actors = Actors(train=[rank], engines=handles(calls, "e0", "e1", "e2"), manager=manager)
    monkeypatch.setattr(driver, "push_weights", lambda rollout: calls.append(("push", rollout)))
    assert driver.restore(saved) == (2, 4)
    assert calls == [
        ("rank0.load", str(saved / "train")),
        ("manager.load_state_dict", STREAM),
        ("push", 1),
    ]  # the engines hold no rollout state of their own


@pytest.mark.parametrize(
    ("name", "content"),
    [
        (PENDING_ROLLOUTS, lambda batches: batches),
        # An earlier version saved the one rollout generated ahead, rollout id + 1, alone.
        (PENDING_ROLLOUT, lambda batches: batches[2]),
    ],
    ids=["rollouts by id", "an earlier version's one rollout"],
)
def test_restore_keeps_the_rollouts_a_checkpoint_holds_generated_ahead(
    tmp_path, monkeypatch, name, content
):
    """The checkpoint of rollout 1 holds rollout 2, generated ahead (the prompt stream has moved
    past it): the resumed driver trains on it next instead of generating a new one."""
    run = run_dir(tmp_path)
    saved = checkpoint(run, 1)
    (saved / "driver.json").write_text(
        json.dumps({"rollout_id": 1, "accumulated_step": 4, "rollout": STREAM})
    )
    ahead = RolloutBatch(
        samples=[Sample(tokens=[5, 6, 7], response_length=1, weight_version="0")],
        metrics={"rollout/rewards": 0.5},
    )
    with (saved / name).open("wb") as handle:
        pickle.dump(content({2: ahead}), handle)
    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(ember.calls, "get", lambda refs: refs)
    config, _ = load_config("default", overrides=[f"run.dir={run}"])
    driver = Driver(config, run)
    (rank,) = handles(calls, "rank0")
    (manager,) = handles(calls, "manager")
    driver.actors = Actors(train=[rank], engines=handles(calls, "e0"), manager=manager)
    monkeypatch.setattr(driver, "push_weights", lambda rollout: calls.append(("push", rollout)))
    assert driver.restore(saved) == (2, 4)
    assert list(driver.loop.pending) == [2]
    assert driver.loop.pending[2] == ahead


def test_a_fresh_run_in_a_used_directory_is_refused(tmp_path, capsys):
    run = run_dir(tmp_path)
    before = (run / "metrics.jsonl").read_bytes()
    assert main(["train", "--set", f"run.dir={run}"]) == 2
    assert error_line(capsys) == (
        f"ember train: error: run.dir {run} already holds a run (metrics or checkpoints); "
        f"continue it with `ember train --resume {run}` or choose another run.dir"
    )
    assert (run / "metrics.jsonl").read_bytes() == before
    assert not ray.is_initialized()


# --------------------------------------------------------------------------------------------
# metrics.jsonl on resume
# --------------------------------------------------------------------------------------------


class Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_resume_drops_the_records_after_the_checkpoint_and_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = rows(4)
    path.write_text("".join(f"{line}\n" for line in lines) + '{"kind": "rollout", "rollout_i')
    seen = Messages()
    logging.getLogger("ember.checkpoints").addHandler(seen)
    try:
        truncate_metrics(tmp_path, 1)
    finally:
        logging.getLogger("ember.checkpoints").removeHandler(seen)
    assert path.read_text() == "".join(f"{line}\n" for line in lines[:6])  # rollouts 0 and 1
    (warning,) = seen.messages
    assert warning.startswith(f"{path}:13: dropped a record cut off by the kill")


def test_a_complete_last_record_without_its_newline_is_kept(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = rows(2)
    path.write_text("\n".join(lines))  # a kill between the record and its newline
    truncate_metrics(tmp_path, 1)
    assert path.read_text() == "".join(f"{line}\n" for line in lines)


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ('{"kind": "rollout", "rollout_id": 1, "st', "Unterminated string"),
        ("", "Expecting value"),
        ("[1, 2]", "a JSON object was expected"),
        ('{"kind": "rollout", "step": 1}', "rollout_id=None, expected an integer"),
    ],
)
def test_a_damaged_line_before_the_last_stops_the_resume(tmp_path, bad, why):
    path = tmp_path / "metrics.jsonl"
    lines = rows(3)
    lines[4] = bad
    path.write_text("".join(f"{line}\n" for line in lines))
    before = path.read_bytes()
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:5: .*{why}"):
        truncate_metrics(tmp_path, 1)
    assert path.read_bytes() == before


def test_reading_metrics_names_a_damaged_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(f"{record('rollout', 0, 0)}\nnot json\n{record('rollout', 1, 1)}\n")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:2: not a metrics record"):
        list(read_metrics(tmp_path))
