"""`ember convert`: transformers -> Megatron -> transformers is lossless."""

from __future__ import annotations

import subprocess
import sys

import pytest
from safetensors.torch import load_file

from ember_rollout.config import TinyModelConfig
from ember_rollout.models import write_tiny_checkpoint


def convert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ember.cli", "convert", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


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


def test_missing_source_is_named(tmp_path):
    run = convert("hf-to-megatron", str(tmp_path / "nope"), str(tmp_path / "out"))
    assert run.returncode == 2
    assert f"{tmp_path / 'nope'}: no such checkpoint" in run.stderr
