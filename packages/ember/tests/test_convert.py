"""`ember convert`: transformers -> Megatron -> transformers is lossless."""

from __future__ import annotations

import subprocess

import pytest
from ember_runs import ember_here
from safetensors.torch import load_file

from ember_rollout.config import TinyModelConfig
from ember_rollout.models import write_tiny_checkpoint
from ember_rollout.tokenizer import load_tokenizer, save_toy_tokenizer


def convert(*args: str) -> subprocess.CompletedProcess:
    """`ember convert ARGS`, called in this process (`ember_runs.ember_here`)."""
    return ember_here(["convert", *args])


@pytest.mark.slow
def test_hf_to_megatron_to_hf_round_trip(tmp_path):
    hf = write_tiny_checkpoint(tmp_path / "hf", TinyModelConfig(vocab_size=17))
    first = convert("hf-to-megatron", str(hf), str(tmp_path / "megatron"))
    assert first.returncode == 0, first.stderr[-2000:]
    second = convert(
        "megatron-to-hf", str(tmp_path / "megatron"), str(tmp_path / "back"), "--model", str(hf)
    )
    assert second.returncode == 0, second.stderr[-2000:]
    original = load_file(hf / "model.safetensors")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(original)
    for name, tensor in original.items():
        assert back[name].equal(tensor), name


@pytest.mark.slow  # a CLI subprocess
def test_missing_source_is_named(tmp_path):
    run = convert("hf-to-megatron", str(tmp_path / "nope"), str(tmp_path / "out"))
    assert run.returncode == 2
    assert f"{tmp_path / 'nope'}: no such checkpoint" in run.stderr


@pytest.mark.slow
def test_megatron_to_hf_from_a_run_directory(tmp_path):
    """A run directory converts from its newest complete checkpoint, shaped like its hf_init."""
    run = tmp_path / "run"
    hf = write_tiny_checkpoint(run / "hf_init", TinyModelConfig(vocab_size=17, num_layers=2))
    save_toy_tokenizer(hf)
    newest = run / "checkpoints" / "rollout_000009"
    first = convert("hf-to-megatron", str(hf), str(newest / "train"))
    assert first.returncode == 0, first.stderr[-2000:]
    (newest / "driver.json").write_text("{}")
    (run / "checkpoints" / "rollout_000019" / "train").mkdir(parents=True)  # incomplete: skipped
    for src in (run, newest):
        out = tmp_path / f"from_{src.name}"
        second = convert("megatron-to-hf", str(src), str(out))
        assert second.returncode == 0, second.stderr[-2000:]
        original = load_file(hf / "model.safetensors")
        back = load_file(out / "model.safetensors")
        assert sorted(back) == sorted(original)
        assert all(back[name].equal(tensor) for name, tensor in original.items())
        assert load_tokenizer(out).decode([3, 4]) == "12"  # the run's tokenizer came along
