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
