"""Prompt data: JSONL or parquet files, HF `datasets` directories, or the generated toy task;
epoch-shuffled, encoded to token ids."""

from __future__ import annotations

import dataclasses
import glob
import json
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ember_rollout.config import DataConfig, ToyTaskConfig
from ember_rollout.toy_task import make_toy_prompts

Prompt = str | list[dict[str, str]]


@dataclass(slots=True)
class PromptRecord:
    """One prompt with its ground truth."""

    prompt: Prompt
    """Text, or chat messages [{"role": ..., "content": ...}]."""
    label: Any = None
    """Ground truth for the reward function."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Per-prompt data copied into each sample's metadata."""
    source: str = ""
    """Where it came from ("file.jsonl:12", "toy:5"), for error messages."""


def _check_prompt(prompt: Any, where: str, key: str) -> Prompt:
    if isinstance(prompt, str):
        return prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in prompt
        )
    ):
        return prompt
    raise ValueError(
        f"{where}: {key!r} must be a string or a non-empty list of {{role, content}} messages, "
        f"got {str(prompt)[:80]}"
    )


DATA_EXTRA_HINT = (
    "install the data extra: `uv sync` in this repository (the dev group has it) or "
    "`pip install 'ember-rollout[data]'`"
)


def _record(
    row: Any,
    where: str,
    *,
    input_key: str,
    label_key: str | None,
    metadata_key: str | None,
) -> PromptRecord:
    """One prompt row (a mapping of its keys) as a record; errors name `where` and the key."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected an object, got {type(row).__name__}")
    for name in (input_key, label_key, metadata_key):
        if name is not None and name not in row:
            raise ValueError(f"{where}: no {name!r} key (keys: {', '.join(sorted(row))})")
    metadata = row[metadata_key] if metadata_key else {}
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise ValueError(
            f"{where}: {metadata_key!r} must be an object, got {type(metadata).__name__}"
        )
    return PromptRecord(
        prompt=_check_prompt(row[input_key], where, input_key),
        label=row[label_key] if label_key else None,
        metadata=dict(metadata),
        source=where,
    )


def _records(
    rows: Iterable[tuple[str, Any]], path: Path, key: str, **keys: Any
) -> list[PromptRecord]:
    records = [_record(row, where, **keys) for where, row in rows]
    if not records:
        raise ValueError(f"{key}={str(path)!r}: no prompts in it")
    return records


def read_prompt_data(
    path: str | Path,
    *,
    input_key: str = "prompt",
    label_key: str | None = "label",
    metadata_key: str | None = None,
    key: str = "data.prompt_data",
) -> list[PromptRecord]:
    """Read prompts from `path`, by its kind: a directory written by HF datasets'
    `save_to_disk`, a directory of `.parquet` shards (the published layout,
    `train-00000-of-00002.parquet` ...), a glob of files (`data/train-*.parquet`), a `.parquet`
    file, else a JSONL file. Shards and a glob's files are read in the order of their names,
    each by its kind. Every row needs the same keys (columns) whatever the kind, and errors
    name the file (as `key`) and the row.

    Raises:
        ValueError: The path is missing or unreadable, matches no file, holds no prompts, or a
            row lacks a key or has a value of the wrong type; one line naming them.
    """
    path = Path(path)
    keys = {"input_key": input_key, "label_key": label_key, "metadata_key": metadata_key}
    files = _shards(path, key)
    if files is not None:
        rows = (row for file in files for row in _file_rows(file, key, keys))
        return _records(rows, path, key, **keys)
    if path.is_dir():
        return _records(_dataset_rows(path, key, keys), path, key, **keys)
    if path.suffix == ".parquet":
        return _records(_parquet_rows(path, key, keys), path, key, **keys)
    return read_jsonl(path, key=key, **keys)


DATASET_MARKERS = ("state.json", "dataset_info.json", "dataset_dict.json")
"""Files of a directory written by datasets' `save_to_disk` (a dataset or a dict of splits)."""


def _shards(path: Path, key: str) -> list[Path] | None:
    """The files `path` names several of, in name order: the `.parquet` files of a directory
    that datasets did not write, or the matches of a glob; None for a single source."""
    if path.is_dir():
        if any((path / marker).is_file() for marker in DATASET_MARKERS):
            return None
        shards = sorted(p for p in path.glob("*.parquet") if p.is_file())
        return shards or None
    if path.exists() or not any(c in str(path) for c in "*?["):
        return None
    matches = sorted(Path(p) for p in glob.glob(str(path)) if Path(p).is_file())
    if not matches:
        raise ValueError(f"{key}={str(path)!r}: no file matches")
    return matches


def _file_rows(path: Path, key: str, keys: dict[str, Any]) -> Iterable[tuple[str, Any]]:
    """(where, row) of every row of one file of several: parquet or JSONL, by its suffix."""
    if path.suffix == ".parquet":
        return _parquet_rows(path, key, keys)
    return _jsonl_rows(path, key)


def _columns_present(columns: list[str], keys: dict[str, Any], path: Path, key: str) -> None:
    for name in keys.values():
        if name is not None and name not in columns:
            raise ValueError(
                f"{key}={str(path)!r}: no {name!r} column (columns: {', '.join(columns)})"
            )


def _parquet_rows(path: Path, key: str, keys: dict[str, Any]) -> Iterable[tuple[str, Any]]:
    """(where, row) of every row of a parquet file, read with pyarrow."""
    if not path.is_file():
        raise ValueError(f"{key}={str(path)!r}: no such file")
    try:
        import pyarrow
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(
            f"{key}={str(path)!r}: reading parquet needs pyarrow; {DATA_EXTRA_HINT}"
        ) from None
    try:
        table = pq.read_table(path)
    except (OSError, pyarrow.ArrowException) as exc:
        raise ValueError(f"{key}={str(path)!r}: not a readable parquet file ({exc})") from None
    _columns_present(table.column_names, keys, path, key)
    return ((f"{path} row {i}", row) for i, row in enumerate(table.to_pylist(), start=1))


def _dataset_rows(path: Path, key: str, keys: dict[str, Any]) -> Iterable[tuple[str, Any]]:
    """(where, row) of every row of a dataset directory (`datasets.Dataset.save_to_disk`)."""
    try:
        import datasets
    except ImportError:
        raise ValueError(
            f"{key}={str(path)!r}: reading a datasets directory needs the datasets package; "
            f"{DATA_EXTRA_HINT}"
        ) from None
    try:
        dataset = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise ValueError(
            f"{key}={str(path)!r}: a directory, but not one written by datasets' save_to_disk "
            f"({(str(exc).splitlines() or [type(exc).__name__])[0][:160]})"
        ) from None
    if isinstance(dataset, datasets.DatasetDict):
        splits = list(dataset)
        raise ValueError(
            f"{key}={str(path)!r}: a dataset with the splits {', '.join(splits)}; name one "
            f"directory, for example {path / splits[0]}"
        )
    _columns_present(list(dataset.column_names), keys, path, key)
    return ((f"{path} row {i}", row) for i, row in enumerate(dataset, start=1))


def read_jsonl(
    path: str | Path,
    *,
    input_key: str = "prompt",
    label_key: str | None = "label",
    metadata_key: str | None = None,
    key: str = "data.prompt_data",
) -> list[PromptRecord]:
    """Read one prompt per line; blank lines are skipped. Errors name the file as `key`.

    Raises:
        ValueError: The file is missing, unreadable or empty, a line is not UTF-8 or not a JSON
            object, or a key is missing; the message names the file and line.
    """
    path = Path(path)
    keys = {"input_key": input_key, "label_key": label_key, "metadata_key": metadata_key}
    records = [_record(row, where, **keys) for where, row in _jsonl_rows(path, key)]
    if not records:
        raise ValueError(f"{key}={str(path)!r}: no prompts in the file")
    return records


def _jsonl_rows(path: Path, key: str) -> Iterable[tuple[str, Any]]:
    """(where, row) of every non-blank line of a JSONL file, each a JSON object."""
    if not path.is_file():
        raise ValueError(f"{key}={str(path)!r}: no such file")
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise ValueError(f"{key}={str(path)!r}: cannot read ({exc.strerror})") from None
    with handle:
        for lineno, raw in enumerate(handle, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(
                    f"{where}: not UTF-8 text (byte {exc.start + 1} of the line)"
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"{where}: malformed JSON ({exc.msg} at column {exc.colno})"
                ) from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
            yield where, row


def load_prompts(config: DataConfig) -> list[PromptRecord]:
    """The configured prompts: `data.prompt_data` (`read_prompt_data`), or the toy task."""
    if config.prompt_data is not None:
        return read_prompt_data(
            config.prompt_data,
            input_key=config.input_key,
            label_key=config.label_key,
            metadata_key=config.metadata_key,
        )
    return _toy_records(config.toy, "toy")


def _toy_records(toy: ToyTaskConfig, source: str) -> list[PromptRecord]:
    """The toy task's prompts as records, each's source `<source>:<index>`."""
    return [
        PromptRecord(prompt=r["prompt"], label=r["label"], source=f"{source}:{i}")
        for i, r in enumerate(make_toy_prompts(toy))
    ]


def load_eval_sets(
    sets: Mapping[str, str], data: DataConfig, *, prompts: int
) -> dict[str, list[PromptRecord]]:
    """The named eval sets (`run.eval_sets`), each cut to its first `prompts` prompts.

    A source is a path (JSONL, parquet or a datasets directory), read with the data section's
    keys like `data.prompt_data`, or
    `toy`: the toy task of `data.toy` drawn with seed `data.toy.seed + 1`. No sets: one named
    `toy` when the run trains on the toy task.

    Raises:
        ValueError: No sets while the run trains on `data.prompt_data`, or a file that does
            not read (naming the set, the file and the line).
    """
    if not sets:
        if data.prompt_data is not None:
            raise ValueError(
                "run.eval_sets: empty, and the run trains on data.prompt_data; name the eval "
                "sets (--set run.eval_sets.<name>=<file.jsonl>)"
            )
        sets = {"toy": "toy"}
    out: dict[str, list[PromptRecord]] = {}
    for name, source in sets.items():
        if source == "toy":
            toy = dataclasses.replace(data.toy, seed=data.toy.seed + 1, num_prompts=prompts)
            out[name] = _toy_records(toy, "eval toy")
            continue
        records = read_prompt_data(
            source,
            input_key=data.input_key,
            label_key=data.label_key,
            metadata_key=data.metadata_key,
            key=f"run.eval_sets.{name}",
        )
        out[name] = records[:prompts]
    return out


class PromptDataset:
    """Hands out prompts in order, reshuffled (seeded) at the start of every epoch."""

    def __init__(self, records: list[PromptRecord], *, shuffle: bool = True, seed: int = 0) -> None:
        if not records:
            raise ValueError("PromptDataset: no prompts")
        self.records = records
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.offset = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.records)))
        if self.shuffle:
            random.Random(f"{self.seed}-{epoch}").shuffle(order)
        return order

    def __len__(self) -> int:
        return len(self.records)

    def next(self, count: int) -> list[PromptRecord]:
        """The next `count` prompts, crossing into the next epoch when needed."""
        out = []
        while len(out) < count:
            if self.offset == len(self._order):
                self.epoch += 1
                self.offset = 0
                self._order = self._permutation(self.epoch)
            take = min(count - len(out), len(self._order) - self.offset)
            out.extend(self.records[i] for i in self._order[self.offset : self.offset + take])
            self.offset += take
        return out

    def state_dict(self) -> dict[str, int]:
        """Position to resume from."""
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._order = self._permutation(self.epoch)


class PromptEncoder:
    """Turns prompts into token ids: chat template when the tokenizer has one, length policy."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        apply_chat_template: bool = True,
        max_prompt_len: int | None = None,
        overlong_prompt: str = "error",
    ) -> None:
        self.tokenizer = tokenizer
        self.use_template = apply_chat_template and bool(getattr(tokenizer, "chat_template", None))
        self.max_prompt_len = max_prompt_len
        self.overlong_prompt = overlong_prompt
        self.truncated = 0
        """Prompts cut to max_prompt_len so far."""
        self.dropped = 0
        """Prompts skipped for length so far."""

    def text(self, record: PromptRecord) -> str:
        """The prompt as the model sees it (after the chat template, if any)."""
        if self.use_template:
            messages = record.prompt
            if isinstance(messages, str):
                messages = [{"role": "user", "content": messages}]
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        if not isinstance(record.prompt, str):
            raise ValueError(
                f"{record.source}: the prompt is a list of chat messages but the tokenizer has "
                "no chat template (or data.apply_chat_template is false)"
            )
        return record.prompt

    def encode(self, record: PromptRecord) -> list[int] | None:
        """Token ids of the prompt, or None when it is too long and the policy drops it.

        Raises:
            ValueError: Too long under the "error" policy, or empty; names the prompt's source.
        """
        ids = list(
            self.tokenizer(self.text(record), add_special_tokens=not self.use_template)["input_ids"]
        )
        if not ids:
            raise ValueError(f"{record.source}: the prompt encodes to no tokens")
        limit = self.max_prompt_len
        if limit is not None and len(ids) > limit:
            if self.overlong_prompt == "truncate":
                self.truncated += 1
                return ids[-limit:]
            if self.overlong_prompt == "drop":
                self.dropped += 1
                return None
            raise ValueError(
                f"{record.source}: the prompt has {len(ids)} tokens, more than max_prompt_len="
                f"{limit} (set data.overlong_prompt to truncate or drop to allow it)"
            )
        return ids
