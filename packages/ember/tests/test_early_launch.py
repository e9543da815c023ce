"""Which checkpoint launched SGLang servers start from while the trainer starts
(`weight_push.early_launch_source`); the driver's use of it is in test_weight_push.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ember.config import load_config
from ember.weight_push import early_launch_source


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    """A float32 checkpoint of a small dense model with its tokenizer."""
    from ember_rollout.config import TinyModelConfig
    from ember_rollout.models import write_tiny_checkpoint
    from ember_rollout.tokenizer import save_toy_tokenizer

    own = write_tiny_checkpoint(tmp_path / "model", TinyModelConfig(vocab_size=17, num_layers=2))
    save_toy_tokenizer(own)
    return own


def source(tmp_path: Path, *overrides: str, reuse_init: bool = False) -> Path | None:
    config, _ = load_config("default", overrides=["engine.kind=sglang", *overrides])
    return early_launch_source(config, tmp_path / "run" / "hf_init", reuse_init=reuse_init)


def test_a_fresh_run_launches_from_its_hf_checkpoint_when_the_export_would_serve_the_same(
    tmp_path, checkpoint
):
    fresh = ["train.model=null", f"train.hf_load={checkpoint}"]
    assert source(tmp_path, *fresh) == checkpoint.resolve()
    assert source(tmp_path, *fresh, "engine.sglang.dtype=bfloat16") == checkpoint.resolve()
    # SGLang's auto dtype follows the checkpoint's dtype (float32 here), as it would the
    # export's, which is train.dtype.
    auto = "engine.sglang.dtype=auto"
    assert source(tmp_path, *fresh, auto) == checkpoint.resolve()
    assert source(tmp_path, *fresh, auto, "train.dtype=bfloat16") is None
    assert source(tmp_path, *fresh, "train.dtype=bfloat16", "engine.sglang.dtype=bfloat16")
    # What would make the export another model, or the servers nothing to launch.
    assert source(tmp_path, *fresh, "train.model_overrides.num_layers=1") is None
    assert source(tmp_path, "train.model=tiny-llama", f"train.hf_load={checkpoint}") is None
    assert source(tmp_path, *fresh, "engine.sglang.urls=[http://127.0.0.1:1]") is None
    assert source(tmp_path, *fresh, "engine.kind=hf") is None
    assert source(tmp_path, *fresh, "run.rollout_only=true") is None
    # Trainer and engines sharing GPUs: the trainer starts first.
    colocated = [
        "ray.gpus_per_rank=0.5", "ray.gpus_per_engine=0.5", "rollout.async=false",
        "engine.sglang.server_args=[--enable-memory-saver]",
    ]  # fmt: skip
    assert source(tmp_path, *fresh, *colocated) is None
    assert source(tmp_path, *fresh, *colocated, "ray.colocate=false") == checkpoint.resolve()


def test_no_checkpoint_no_tokenizer_or_a_resume_without_hf_init_waits_for_the_export(
    tmp_path, checkpoint
):
    assert source(tmp_path) is None  # the preset's weights exist only in the trainer
    (checkpoint / "tokenizer_config.json").unlink()  # SGLang reads it at launch
    assert source(tmp_path, "train.model=null", f"train.hf_load={checkpoint}") is None
    init = tmp_path / "run" / "hf_init"
    assert source(tmp_path, reuse_init=True) is None
    init.mkdir(parents=True)
    (init / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    (init / "tokenizer_config.json").write_text("{}")
    assert source(tmp_path, reuse_init=True) == init


def test_a_checkpoint_whose_token_ids_or_tokenizer_the_export_would_change_waits_for_it(
    tmp_path, checkpoint
):
    """A server keeps its checkpoint's config.json and tokenizer: where the export would write
    other stop ids or another tokenizer, the servers start from the export."""
    from ember_rollout.tokenizer import save_toy_tokenizer

    fresh = ["train.model=null", f"train.hf_load={checkpoint}"]
    assert source(tmp_path, *fresh) == checkpoint.resolve()
    other = save_toy_tokenizer(tmp_path / "other")
    assert source(tmp_path, *fresh, f"data.tokenizer_path={other}") is None
    config = json.loads((checkpoint / "config.json").read_text())
    config["eos_token_id"] = 1  # a config class's default, not the tokenizer's EOS
    (checkpoint / "config.json").write_text(json.dumps(config))
    assert source(tmp_path, *fresh) is None
