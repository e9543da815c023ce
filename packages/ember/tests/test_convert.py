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


@pytest.mark.slow
def test_a_quantized_hf_init_gives_the_shape_and_the_output_stays_full_precision(tmp_path):
    """A run under engine.quantization with SGLang exports a quantized hf_init (what the servers
    load); converting its checkpoints reads only the shape from it and writes full precision."""
    import json

    import torch
    from safetensors.torch import save_file

    from ember_core.quant import QuantSpec, quantize_named
    from ember_rollout.sglang_quant import quantization_config

    run = tmp_path / "run"
    hf = write_tiny_checkpoint(tmp_path / "hf", TinyModelConfig(vocab_size=17, num_layers=2))
    save_toy_tokenizer(hf)
    newest = run / "checkpoints" / "rollout_000000"
    assert convert("hf-to-megatron", str(hf), str(newest / "train")).returncode == 0
    (newest / "driver.json").write_text("{}")
    init = run / "hf_init"  # the quantized export, as the trainer writes it for SGLang
    init.mkdir()
    original = load_file(hf / "model.safetensors")
    spec = QuantSpec("fp8_block", 32, "linear")
    save_file(
        dict(quantize_named(original.items(), spec, dtype=torch.bfloat16)),
        init / "model.safetensors",
    )
    config = json.loads((hf / "config.json").read_text())
    config["quantization_config"] = quantization_config(spec, original)
    (init / "config.json").write_text(json.dumps(config))
    save_toy_tokenizer(init)
    out = tmp_path / "out"
    second = convert("megatron-to-hf", str(run), str(out))
    assert second.returncode == 0, second.stderr[-2000:]
    back = load_file(out / "model.safetensors")
    assert sorted(back) == sorted(original)
    assert all(back[name].equal(tensor) for name, tensor in original.items())
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
