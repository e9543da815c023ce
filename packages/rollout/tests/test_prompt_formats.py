"""Prompt data in the formats users bring: parquet files and HF `datasets` directories read as
the same prompts as JSONL, with the same keys and one-line errors naming the file and row."""

from __future__ import annotations

import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ember_rollout.config import DataConfig
from ember_rollout.data import load_prompts, read_prompt_data

ROWS = [
    {"question": "what is 2+2?", "answer": "4", "meta": {"id": 1}},
    {"question": [{"role": "user", "content": "hi"}], "answer": "5", "meta": {"id": 2}},
    {"question": "sort 321 =", "answer": "123", "meta": {"id": 3}},
]
KEYS = {"input_key": "question", "label_key": "answer", "metadata_key": "meta"}


def write(kind: str, directory, rows):
    """`rows` written as a `kind` source (jsonl, parquet, datasets) under `directory`."""
    if kind == "jsonl":
        path = directory / "prompts.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif kind == "parquet":
        path = directory / "prompts.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path = directory / "prompts"
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def _fields(records):
    return [(r.prompt, r.label, r.metadata) for r in records]


@pytest.mark.parametrize("kind", ["parquet", "datasets"])
def test_parquet_and_datasets_directories_read_as_the_same_prompts_as_jsonl(tmp_path, kind):
    # Chat prompts and plain ones in one column: a union type in parquet, so one format each.
    for rows in (ROWS[::2], ROWS[1:2]):
        (tmp_path / kind).mkdir(exist_ok=True)
        (tmp_path / "jsonl").mkdir(exist_ok=True)
        records = read_prompt_data(write(kind, tmp_path / kind, rows), **KEYS)
        expected = read_prompt_data(write("jsonl", tmp_path / "jsonl", rows), **KEYS)
        assert _fields(records) == _fields(expected)
        assert records[0].source.endswith(" row 1")
    config = DataConfig(prompt_data=str(write(kind, tmp_path / kind, ROWS[::2])), **KEYS)
    assert [r.label for r in load_prompts(config)] == ["4", "123"]


@pytest.mark.parametrize("kind", ["parquet", "datasets"])
def test_a_missing_column_or_a_wrong_type_names_the_file_and_the_row(tmp_path, kind):
    no_label = [{"question": "a"}]
    with pytest.raises(ValueError) as info:
        read_prompt_data(write(kind, tmp_path, no_label), **KEYS)
    message = str(info.value)
    assert "no 'answer' column (columns: question)" in message and "\n" not in message
    (tmp_path / "b").mkdir()
    numbers = [{"question": 3, "answer": "x", "meta": {"id": 1}}]
    with pytest.raises(ValueError, match=r" row 1: 'question' must be a string or a non-empty"):
        read_prompt_data(write(kind, tmp_path / "b", numbers), **KEYS)
    (tmp_path / "c").mkdir()
    with pytest.raises(ValueError, match=r" row 1: 'meta' must be an object, got int"):
        read_prompt_data(write(kind, tmp_path / "c", [{**ROWS[0], "meta": 7}]), **KEYS)


def test_bad_parquet_files_and_directories_get_one_line(tmp_path):
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 not really")
    with pytest.raises(ValueError, match=r"broken.parquet': not a readable parquet file"):
        read_prompt_data(broken)
    with pytest.raises(ValueError, match="no such file"):
        read_prompt_data(tmp_path / "absent.parquet")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("no prompts here")
    with pytest.raises(ValueError, match="not one written by datasets' save_to_disk"):
        read_prompt_data(tmp_path / "other")
    # A directory of parquet files is read as shards: the broken one is named.
    with pytest.raises(ValueError, match=r"broken.parquet': not a readable parquet file"):
        read_prompt_data(tmp_path)
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[::2])})
    splits.save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(ValueError, match="the splits train; name one directory, for example"):
        read_prompt_data(tmp_path / "dict", **KEYS)
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp_path / "e.parquet")
    with pytest.raises(ValueError, match="no prompts in it"):
        read_prompt_data(tmp_path / "e.parquet", label_key=None)


def test_a_directory_of_parquet_shards_or_a_glob_reads_the_shards_in_name_order(tmp_path):
    """The layout datasets are published in (train-0000i-of-0000n.parquet): the shards in
    order of their names, as one file holding their rows in that order would read."""
    shards = tmp_path / "data"
    shards.mkdir()
    # Written out of order: the names, not the writing, decide.
    pq.write_table(pa.Table.from_pylist(ROWS[2:]), shards / "train-00001-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(ROWS[:1]), shards / "train-00000-of-00002.parquet")
    (tmp_path / "whole").mkdir()
    expected = _fields(read_prompt_data(write("parquet", tmp_path / "whole", ROWS[::2]), **KEYS))
    for source in (shards, shards / "train-*.parquet", f"{shards}/*-of-00002.parquet"):
        records = read_prompt_data(source, **KEYS)
        assert _fields(records) == expected, source
        assert records[0].source == f"{shards / 'train-00000-of-00002.parquet'} row 1"
        assert records[1].source == f"{shards / 'train-00001-of-00002.parquet'} row 1"
    config = DataConfig(prompt_data=str(shards / "train-*.parquet"), **KEYS)
    assert [r.label for r in load_prompts(config)] == ["4", "123"]
    with pytest.raises(ValueError, match=r"data.prompt_data='.*test-\*.parquet': no file matches"):
        read_prompt_data(shards / "test-*.parquet", **KEYS)
    # Every shard needs the keys: the one without is named.
    pq.write_table(pa.Table.from_pylist([{"question": "q"}]), shards / "train-00002.parquet")
    with pytest.raises(ValueError, match=r"train-00002.parquet': no 'answer' column"):
        read_prompt_data(shards, **KEYS)
