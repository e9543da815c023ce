"""Dumped rollouts: one JSONL file per rollout (`run.dump_rollouts`), a header line with the
provenance of the run that wrote it and then one JSON object per sample, the routed experts in
a binary side file; and the samples read back from them (`run.train_from_rollouts`)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ember_core.types import Sample, SampleStatus

FORMAT = 2
"""The dump format this Ember writes and reads. Format 1 (no header, routed experts as JSON
integers in the sample lines) recorded no provenance and is refused."""
HEADER = "ember_dump"
"""The key of the header line, whose value is the format: `{"ember_dump": 2, "samples": N,
"experts": side file name or null, "provenance": {...}}`."""
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
    "metadata",
    "rollout_routed_experts",
)
"""The keys of every dumped sample line, in order. `rollout_routed_experts` is null, or the
name of the sample's tensor in the side file (`experts_path`)."""
EXPERTS = "rollout_routed_experts"


def experts_path(path: Path) -> Path:
    """The side file of the routed experts of dump `path` (<id>.experts.safetensors): one
    integer tensor [len(tokens) - 1, num_layers, topk] per sample that has them, in the dtype
    the engine recorded (uint8 up to 256 experts), named by the sample's line in the dump."""
    return path.with_name(f"{path.stem}.experts.safetensors")


def write_dump(path: Path, samples: Sequence[Sample], provenance: Mapping[str, Any]) -> None:
    """Write `samples` to `path` under a header holding `provenance` (`ember.config.
    dump_provenance`), the routed experts to `experts_path(path)`.

    Both files are written under temporary names beside them, synced, then renamed, the side
    file first: neither name ever holds a partial file, a dump's side file is in place before
    the dump, and a write that fails leaves what was there before. Sample metadata values JSON
    cannot hold are written as lists (tensors, arrays) or their text (`str`).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    side = experts_path(path)
    experts = {
        str(i): s.rollout_routed_experts.detach().cpu().clone()
        for i, s in enumerate(samples)
        if s.rollout_routed_experts is not None
    }
    header = {
        HEADER: FORMAT,
        "samples": len(samples),
        "experts": side.name if experts else None,
        "provenance": dict(provenance),
    }
    lines = [json.dumps(header)]
    for i, s in enumerate(samples):
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
            "metadata": s.metadata,
            EXPERTS: str(i) if str(i) in experts else None,
        }
        lines.append(json.dumps(row, default=_plain))
    text = "\n".join(lines) + "\n"
    written = []  # (temporary, final) pairs, the side file first
    try:
        if experts:
            from safetensors.torch import save

            data = save(experts)  # written as any file is (the umask's mode)
            written.append(_written(side, lambda tmp: tmp.write_bytes(data)))
        written.append(_written(path, lambda tmp: tmp.write_text(text)))
        for tmp, final in written:
            os.replace(tmp, final)
    finally:
        for tmp, _ in written:
            tmp.unlink(missing_ok=True)
    if not experts:
        side.unlink(missing_ok=True)  # an earlier dump's, of the rollout written again


def _plain(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def _written(path: Path, write: Callable[[Path], None]) -> tuple[Path, Path]:
    """(temporary, `path`): `write` wrote and synced the temporary file beside `path`."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        with tmp.open("rb") as handle:
            os.fsync(handle.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp, path


def read_dump(path: Path, provenance: Mapping[str, Any] | None = None) -> list[Sample]:
    """The samples of one dumped rollout, validated as the trainer takes them.

    Args:
        path: The dump (`ember.config.dump_path`).
        provenance: The provenance of the run that trains on it (`ember.config.
            dump_provenance`); each of its fields must equal the dump's. None: not compared.

    Raises:
        ValueError: The file or its side file does not read, has no header or another format,
            a line is not a JSON object, a key is missing, a sample is inconsistent
            (`Sample.validate`), the file holds fewer or more samples than its header says, or
            a provenance field differs; one line naming the file and line (or the field).
    """
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the dumped rollout ({exc})") from None
    numbered = [(n, line) for n, line in enumerate(lines, start=1) if line.strip()]
    if not numbered:
        raise ValueError(f"{path}: no dump header (an empty file)")
    header = _header(path, *numbered[0])
    if provenance is not None:
        check_provenance(path, header["provenance"], provenance)
    rows = [(f"{path}:{n}", _row(f"{path}:{n}", line)) for n, line in numbered[1:]]
    if len(rows) != header["samples"]:
        raise ValueError(
            f"{path}: {len(rows)} sample line{'s' if len(rows) != 1 else ''}, and its header "
            f"announces {header['samples']} (a truncated or edited dump)"
        )
    experts = _experts(path, header) if any(row[EXPERTS] is not None for _, row in rows) else {}
    samples = []
    for where, row in rows:
        key = row[EXPERTS]
        if key is not None and key not in experts:
            raise ValueError(
                f"{where}: routed experts {key!r} are not in {experts_path(path).name}"
            )
        try:
            sample = _sample(row, None if key is None else experts[key])
            sample.validate()
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from None
        samples.append(sample)
    return samples


def _header(path: Path, lineno: int, line: str) -> dict[str, Any]:
    where = f"{path}:{lineno}"
    try:
        header = json.loads(line)
    except json.JSONDecodeError:
        header = None
    if not isinstance(header, dict) or HEADER not in header:
        raise ValueError(
            f"{where}: no dump header (a dump of an Ember that recorded no provenance, or not "
            "a dump: nothing tells which run's settings it holds); dump the rollouts again"
        )
    if header[HEADER] != FORMAT:
        raise ValueError(f"{where}: dump format {header[HEADER]!r}; this Ember reads {FORMAT}")
    samples, experts = header.get("samples"), header.get("experts")
    if samples == 0:
        raise ValueError(f"{path}: no samples in the dumped rollout")
    if (
        not isinstance(samples, int)
        or samples < 0
        or not isinstance(header.get("provenance"), dict)
        or not (experts is None or isinstance(experts, str))
    ):
        raise ValueError(
            f"{where}: a malformed dump header (expected samples >= 0, experts a file name or "
            "null, provenance an object)"
        )
    return header


def _row(where: str, line: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: malformed JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    missing = [key for key in FIELDS if key not in row]
    if missing:
        raise ValueError(f"{where}: no {missing[0]!r} key (a dumped sample has {FIELDS})")
    if not (row[EXPERTS] is None or isinstance(row[EXPERTS], str)):
        raise ValueError(f"{where}: {EXPERTS} must be null or a name in the experts file")
    if not isinstance(row["metadata"], dict):
        raise ValueError(f"{where}: metadata must be an object")
    return row


def _experts(path: Path, header: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The routed experts of the dump at `path`, by name."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    side = experts_path(path)
    if header["experts"] != side.name:
        raise ValueError(
            f"{path}: samples name routed experts, and its header names the experts file "
            f"{header['experts']!r}, expected {side.name!r}"
        )
    if not side.is_file():
        raise ValueError(f"{side}: no such file (the routed experts of {path.name})")
    try:
        return load_file(side)
    except (SafetensorError, OSError, ValueError) as exc:
        detail = (str(exc).splitlines() or [type(exc).__name__])[0][:160]
        raise ValueError(f"{side}: cannot read the routed experts ({detail})") from None


def check_provenance(path: Path, dumped: Mapping[str, Any], provenance: Mapping[str, Any]) -> None:
    """Refuse a dump whose provenance differs from the training run's in any field.

    Raises:
        ValueError: One line naming the first field that differs, the dump's value and the
            run's.
    """
    run = json.loads(json.dumps(dict(provenance)))  # compared as the header holds it
    for field in [*run, *(k for k in dumped if k not in run)]:
        if field not in dumped or field not in run or dumped[field] != run[field]:
            raise ValueError(
                f"{path} was dumped with {field}={_shown(dumped, field)}, and this run has "
                f"{field}={_shown(run, field)}: the dump's old log-probs and groups belong "
                "to its settings; train with those, or dump the rollouts again with these"
            )


def _shown(values: Mapping[str, Any], field: str) -> str:
    return json.dumps(values[field], sort_keys=True) if field in values else "(not recorded)"


def _sample(row: dict[str, Any], experts: torch.Tensor | None) -> Sample:
    spans = row["weight_versions"]
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
        metadata=row["metadata"],
    )
