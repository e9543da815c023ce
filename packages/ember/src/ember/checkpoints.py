"""A run's checkpoints on disk: <run>/checkpoints/rollout_000009/{train/, driver.json, ...},
the newest complete one to resume from, and the metrics records a resumed run logs again."""

from __future__ import annotations

import json
import logging
import os
import pickle
from pathlib import Path
from typing import Any

from ember.metrics import METRICS_FILE, metrics_lines

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
LATEST = "latest"
DRIVER_STATE = "driver.json"
PENDING_ROLLOUTS = "pending_rollouts.pkl"
"""Checkpoint file of a run with `rollout.max_staleness` >= 1: the rollouts generated ahead
before the checkpoint was written ({rollout id: RolloutBatch}), which a resumed run trains on
instead of generating them again."""
PENDING_ROLLOUT = "pending_rollout.pkl"
"""The same for checkpoints of earlier versions: rollout id + 1 alone (read, never written)."""


def checkpoint_name(rollout_id: int) -> str:
    return f"rollout_{rollout_id:06d}"


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (a directory is complete once it has its final name)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("rollout_*") if (p / DRIVER_STATE).is_file())


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def resume_checkpoint(run_dir: Path) -> Path:
    """The checkpoint a resumed run continues from: the newest complete one. Reads files only,
    so it fails before Ray starts.

    Raises:
        ValueError: The directory holds no complete checkpoint, or its rollout state is one
            this version cannot continue.
    """
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        raise ValueError(
            f"{run_dir}: no complete checkpoint to resume from (no {CHECKPOINTS}/rollout_*/"
            f"{DRIVER_STATE}); to start the run over, give its config.yaml a new run.dir"
        )
    rollout_state(checkpoint, driver_state(checkpoint))
    return checkpoint


def driver_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / DRIVER_STATE).read_text())


def rollout_state(checkpoint: Path, state: dict[str, Any]) -> dict[str, Any]:
    """The rollout manager's saved state (the prompt stream, held once per run)."""
    if "rollout" in state:
        return state["rollout"]
    # Checkpoints of one engine that owned its own prompt stream hold the same state.
    engines = state.get("engines")
    if isinstance(engines, list) and len(engines) == 1:
        return engines[0]
    raise ValueError(
        f"{checkpoint / DRIVER_STATE}: no rollout state to resume from (expected a 'rollout' "
        f"entry, or the 'engines' list of a single-engine run; found {sorted(state)})"
    )


def check_unused(run_dir: Path) -> None:
    """Refuse to start a run afresh where one already logged metrics or saved checkpoints, so
    that no rollout is logged twice and no other run's checkpoint is resumed by mistake."""
    metrics = Path(run_dir) / METRICS_FILE
    if (metrics.is_file() and metrics.stat().st_size) or complete_checkpoints(run_dir):
        raise ValueError(
            f"run.dir {run_dir} already holds a run (metrics or checkpoints); continue it with "
            f"`ember train --resume {run_dir}` or choose another run.dir"
        )


def pending_rollouts(checkpoint: Path, rollout_id: int) -> dict[int, Any]:
    """The rollouts a checkpoint holds generated ahead of rollout `rollout_id`, by id
    (`PENDING_ROLLOUTS`, or an earlier version's `PENDING_ROLLOUT`)."""
    # Both files are written by the run's own `save`, in the run's own directory.
    path = checkpoint / PENDING_ROLLOUTS
    if path.is_file():
        with path.open("rb") as handle:
            return dict(pickle.load(handle))
    path = checkpoint / PENDING_ROLLOUT
    if path.is_file():
        with path.open("rb") as handle:
            return {rollout_id + 1: pickle.load(handle)}
    return {}


def truncate_metrics(run_dir: Path, last_rollout: int) -> None:
    """Drop the records logged after the checkpoint of `last_rollout`, which the resumed run
    logs again, so that the file holds every rollout once.

    A last line cut off by the kill is dropped with a warning; any other damaged line stops the
    resume with `FILE:LINE` (`metrics_lines`), since dropping it would lose a record silently.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return
    kept = []
    for number, text, record in metrics_lines(path):
        if record is None:
            logger.warning("%s:%d: dropped a record cut off by the kill: %.60s", path, number, text)
            continue
        rollout_id = record.get("rollout_id")
        if isinstance(rollout_id, bool) or not isinstance(rollout_id, int):
            raise ValueError(
                f"{path}:{number}: rollout_id={rollout_id!r}, expected an integer in every record"
            )
        if rollout_id <= last_rollout:
            kept.append(text)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    os.replace(tmp, path)


def resume_hint(run_dir: Path) -> str:
    """The command that continues from the newest checkpoint, or that there is none."""
    checkpoints = complete_checkpoints(run_dir)
    if not checkpoints:
        return "no checkpoint was saved yet (run.save_interval): start the run again"
    rollout = int(checkpoints[-1].name.removeprefix("rollout_"))
    return f"continue from the checkpoint of rollout {rollout} with: ember train --resume {run_dir}"


def save(driver: Any, rollout_id: int, accumulated_step: int) -> Path:
    """Write a checkpoint of the run of `driver` (a `Driver`) atomically: everything into a
    hidden directory, then one rename.

    It holds the training state, the rollout manager's prompt stream and, with
    `rollout.max_staleness` >= 1, the rollouts generating ahead, once they finish
    (`PENDING_ROLLOUTS`): the prompt stream has moved past them, and the weights they came
    from are gone.
    """
    import shutil

    from ember import calls
    from ember_megatron_backend.checkpoint import fsync_path, replace_dir

    actors, mender = driver.actors, driver.mender
    root = driver.run_dir / CHECKPOINTS
    final = root / checkpoint_name(rollout_id)
    tmp = root / f".{checkpoint_name(rollout_id)}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    calls.get([t.save.remote(str(tmp / "train")) for t in actors.train])
    # The manager answers once it has finished any rollout it is generating.
    state = {
        "rollout_id": rollout_id,
        "accumulated_step": accumulated_step,
        "rollout": mender.get(actors.manager.state_dict.remote()),
    }
    ahead = {j: mender.get(pending) for j, pending in sorted(driver.loop.pending.items())}
    if ahead:
        with (tmp / PENDING_ROLLOUTS).open("wb") as handle:
            pickle.dump(ahead, handle)
    (tmp / DRIVER_STATE).write_text(json.dumps(state))
    replace_dir(tmp, final)
    fsync_path(root)
    for old in complete_checkpoints(driver.run_dir)[: -driver.config.run.keep_checkpoints]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def restore(driver: Any, checkpoint: Path) -> tuple[int, int]:
    """Load `checkpoint` into the actors of `driver`; returns (next rollout id, accumulated
    step).

    Any number of engines can continue it: the prompt stream lives in the manager. The
    rollouts the checkpoint holds already generated are trained on next (each generated
    again, from its own prompts, if it is staler than this run's `rollout.max_staleness` or
    audited: `Loop.take`).
    """
    from ember import calls

    state = driver_state(checkpoint)
    stream = rollout_state(checkpoint, state)
    driver.handoff.to_training()  # the trainer loads into its own memory
    calls.get([t.load.remote(str(checkpoint / "train")) for t in driver.actors.train])
    calls.get(driver.actors.manager.load_state_dict.remote(stream))
    driver.loop.pending.clear()
    driver.loop.pending.update(pending_rollouts(checkpoint, state["rollout_id"]))
    driver.trained_version = str(state["rollout_id"])
    driver.handoff.after_training(lambda: driver.push_weights(state["rollout_id"]))
    truncate_metrics(driver.run_dir, state["rollout_id"])
    return state["rollout_id"] + 1, state["accumulated_step"]
