"""The run's metric sinks: metrics.jsonl (always), TensorBoard events, and wandb when configured."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


class MetricsLogger:
    """Writes one JSON object per line to `run_dir/metrics.jsonl` and mirrors it to TensorBoard.

    Each record carries `kind` ("rollout" or "train"), `rollout_id`, `step` (the x-axis: the
    rollout id for rollout records, the accumulated step for train records) and flat slash-keyed
    metrics. Lines are flushed as they are written, so a killed run keeps every finished record.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        tensorboard: bool = True,
        wandb_project: str | None = None,
        wandb_config: Mapping[str, Any] | None = None,
    ) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(logdir=str(Path(run_dir) / "tensorboard"))
        self._wandb = None
        if wandb_project:
            try:
                import wandb
            except ImportError:
                logger.warning("wandb.project is set but wandb is not installed; skipping wandb")
            else:
                self._wandb = wandb.init(
                    project=wandb_project,
                    name=Path(run_dir).name,
                    dir=str(run_dir),
                    config=dict(wandb_config or {}),
                    resume="allow",
                )

    def log(self, kind: str, rollout_id: int, step: int, metrics: Mapping[str, float]) -> None:
        """Append one record and mirror its metrics to TensorBoard (and wandb)."""
        clean = {k: _plain(v) for k, v in metrics.items()}
        record = {
            "kind": kind,
            "rollout_id": rollout_id,
            "step": step,
            "time": time.time(),
            **clean,
        }
        self._file.write(json.dumps(record, allow_nan=True) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in clean.items():
                if isinstance(value, float) and math.isfinite(value):
                    self._tb.add_scalar(key, value, global_step=step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(clean, step=step if kind == "train" else None)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int | float):
        return value
    return float(value)


def read_metrics(run_dir: Path) -> Iterator[dict[str, Any]]:
    """The records of a run's metrics.jsonl; a torn last line (a killed writer) is skipped.

    Raises:
        FileNotFoundError: The run directory has no metrics file.
        ValueError: A line other than a torn last one is not a JSON object (names FILE:LINE).
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path}: no metrics file (is {run_dir} an Ember run directory?)")
    for _, _, record in metrics_lines(path):
        if record is not None:
            yield record


def metrics_lines(path: Path) -> Iterator[tuple[int, str, dict[str, Any] | None]]:
    """Each line of a metrics file as (line number, text without its newline, record).

    `MetricsLogger` ends every record with a newline in the same write, so a line without one
    can only be the last, cut off by a kill: it is yielded with record None when it does not
    parse. Any other line that is not a JSON object was damaged after the fact.

    Raises:
        ValueError: `FILE:LINE: ...` for a corrupt line that is not a torn last line.
    """
    with Path(path).open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            text = line.removesuffix("\n")
            try:
                record = json.loads(text)
            except json.JSONDecodeError as exc:
                if not line.endswith("\n"):
                    yield number, text, None
                    return
                raise ValueError(
                    f"{path}:{number}: not a metrics record ({exc.msg}: {_excerpt(text)})"
                ) from None
            if not isinstance(record, dict):
                raise ValueError(
                    f"{path}:{number}: not a metrics record (a JSON object was expected: "
                    f"{_excerpt(text)})"
                )
            yield number, text, record


def _excerpt(text: str, width: int = 60) -> str:
    return repr(text if len(text) <= width else text[:width] + "...")
