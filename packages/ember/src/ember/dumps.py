"""Dumped rollouts: one JSON object per sample, one file per rollout (`run.dump_rollouts`), and
the samples read back from them (`run.train_from_rollouts`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ember_core.types import Sample, SampleStatus

FIELDS = (
    "index",
    "group_index",
    "prompt",
    "response",
    "label",
    "reward",
    "status",
    "tokens",
    "response_length",
    "loss_mask",
    "rollout_log_probs",
    "weight_version",
    "weight_versions",
)
"""The keys of every dumped sample, in order; `rollout_routed_experts` follows where recorded."""
EXPERTS = "rollout_routed_experts"


def write_dump(path: Path, samples: list[Sample]) -> None:
    """Write `samples` to `path`, one JSON object per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        for s in samples:
            row: dict[str, Any] = {
                "index": s.index,
                "group_index": s.group_index,
                "prompt": s.prompt,
                "response": s.response,
                "label": s.label,
                "reward": s.reward,
                "status": str(s.status),
                "tokens": s.tokens,
                "response_length": s.response_length,
                "loss_mask": s.effective_loss_mask(),
                "rollout_log_probs": s.rollout_log_probs,
                "weight_version": s.weight_version,
                "weight_versions": s.weight_versions,
            }
            if s.rollout_routed_experts is not None:
                row[EXPERTS] = s.rollout_routed_experts.tolist()
            handle.write(json.dumps(row) + "\n")


def read_dump(path: Path) -> list[Sample]:
    """The samples of one dumped rollout, validated as the trainer takes them.

    Raises:
        ValueError: The file does not read, a line is not a JSON object, a key is missing, or
            a sample is inconsistent (`Sample.validate`); one line naming the file and line.
    """
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the dumped rollout ({exc})") from None
    samples = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: malformed JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
        missing = [key for key in FIELDS if key not in row]
        if missing:
            raise ValueError(f"{where}: no {missing[0]!r} key (a dumped sample has {FIELDS})")
        try:
            sample = _sample(row)
            sample.validate()
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from None
        samples.append(sample)
    if not samples:
        raise ValueError(f"{path}: no samples in the dumped rollout")
    return samples


def _sample(row: dict[str, Any]) -> Sample:
    spans = row["weight_versions"]
    experts = row.get(EXPERTS)
    if experts is not None:
        experts = torch.tensor(experts, dtype=torch.int32)
    return Sample(
        tokens=[int(t) for t in row["tokens"]],
        response_length=int(row["response_length"]),
        index=int(row["index"]),
        group_index=int(row["group_index"]),
        prompt=row["prompt"],
        response=row["response"],
        label=row["label"],
        reward=None if row["reward"] is None else float(row["reward"]),
        loss_mask=row["loss_mask"],
        rollout_log_probs=row["rollout_log_probs"],
        rollout_routed_experts=experts,
        status=SampleStatus(row["status"]),
        weight_version=row["weight_version"],
        weight_versions=None if spans is None else [(int(a), str(v)) for a, v in spans],
    )
