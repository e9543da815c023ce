"""Input the rollout package used to accept silently: weight updates, model info, prompt files."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from conftest import TINY, make_engine

from ember_core.config import SamplingConfig
from ember_rollout.config import DataConfig, EngineConfig, HFEngineConfig, RolloutSections
from ember_rollout.data import load_prompts
from ember_rollout.families import write_family_checkpoint
from ember_rollout.hf_engine import HFEngine
from ember_rollout.models import iter_checkpoint, write_tiny_checkpoint
from ember_rollout.rollout import RolloutGenerator
from ember_rollout.sglang_launch import model_info_from_dir
from ember_rollout.tokenizer import ordinary_stop_ids, save_tokenizer_for_model, toy_tokenizer

# --------------------------------------------------------------------------------------------
# hf engine weight updates: every name known, no parameter left out
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), TINY)


@pytest.fixture(scope="module")
def engine():
    return make_engine("float32")


def _update(engine, named, **kwargs):
    asyncio.run(engine.update_weights_from_tensors(named, weight_version="v", **kwargs))


def _snapshot(engine):
    return {k: v.clone() for k, v in engine.model.state_dict().items()}


def _unchanged(engine, before):
    return all(torch.equal(v, before[k]) for k, v in engine.model.state_dict().items())


def test_complete_update_in_checkpoint_names_is_accepted(engine, checkpoint):
    named = list(iter_checkpoint(checkpoint))
    assert any(".experts.3.up_proj." in name for name, _ in named)  # per-expert names
    _update(engine, named)
    assert engine.weight_version == "v"


@pytest.mark.parametrize(
    "dropped",
    [
        "model.layers.2.mlp.experts.3.up_proj.weight",  # half of a fused expert tensor
        "model.layers.0.self_attn.q_norm.weight",
        "model.norm.weight",
    ],
)
def test_update_leaving_out_a_parameter_names_it_and_changes_nothing(engine, checkpoint, dropped):
    named = [(n, t + 1.0) for n, t in iter_checkpoint(checkpoint) if n != dropped]
    before = _snapshot(engine)
    with pytest.raises(ValueError, match=rf"weight update leaves out {dropped}"):
        _update(engine, named)
    assert _unchanged(engine, before)


def test_update_with_an_unknown_name_names_it_and_changes_nothing(engine, checkpoint):
    named = [(n, t + 1.0) for n, t in iter_checkpoint(checkpoint)]
    named.append(("model.layers.0.mlp.shared_expert.weight", torch.zeros(4)))
    named.append(("model.layers.9.mlp.experts.0.up_proj.weight", torch.zeros(4)))  # no layer 9
    before = _snapshot(engine)
    with pytest.raises(ValueError) as info:
        _update(engine, named)
    message = str(info.value)
    assert "model.layers.0.mlp.shared_expert.weight" in message
    assert "model.layers.9.mlp.experts.0.up_proj.weight" in message
    assert "match no parameter of the engine's model" in message
    assert _unchanged(engine, before)


def test_partial_update_is_allowed_when_asked(engine):
    norm = torch.full_like(engine.model.state_dict()["model.norm.weight"], 0.5)
    _update(engine, [("model.norm.weight", norm)], partial=True)
    assert torch.equal(engine.model.state_dict()["model.norm.weight"], norm)


def test_disk_update_missing_a_tensor_is_an_error(tmp_path, engine, checkpoint):
    from safetensors.torch import save_file

    tensors = {n: t for n, t in iter_checkpoint(checkpoint) if n != "lm_head.weight"}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="leaves out lm_head.weight"):
        asyncio.run(engine.update_weights_from_disk(tmp_path))


# --------------------------------------------------------------------------------------------
# SGLang model info: no defaults for missing fields
# --------------------------------------------------------------------------------------------

FULL = {
    "num_hidden_layers": 4,
    "num_experts_per_tok": 2,
    "num_experts": 8,
    "vocab_size": 17,
    "max_position_embeddings": 512,
    "eos_token_id": 0,
}


@pytest.mark.parametrize(
    ("missing", "named"),
    [
        ("num_hidden_layers", "num_hidden_layers"),
        ("vocab_size", "vocab_size"),
        ("max_position_embeddings", "max_position_embeddings"),
        ("num_experts", "num_experts or num_local_experts or n_routed_experts"),
    ],
)
def test_model_info_names_a_missing_field_and_the_file(tmp_path, missing, named):
    config = {k: v for k, v in FULL.items() if k != missing}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as info:
        model_info_from_dir(tmp_path)
    assert str(info.value).startswith(f"{tmp_path / 'config.json'}: {named} is missing")


def test_model_info_rejects_a_non_integer_field(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**FULL, "vocab_size": "17"}))
    with pytest.raises(ValueError, match=r"vocab_size is \{'vocab_size': '17'\}"):
        model_info_from_dir(tmp_path)


def test_model_info_of_a_dense_model_and_eos_from_generation_config(tmp_path):
    dense = {k: v for k, v in FULL.items() if k not in ("num_experts_per_tok", "num_experts")}
    (tmp_path / "config.json").write_text(json.dumps(dense))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 5]}))
    info = model_info_from_dir(tmp_path)
    assert (info.topk, info.num_experts, info.moe_layers) == (0, 0, ())
    assert info.eos_token_ids == (0, 5)
    assert info.context_len == 512 and info.vocab_size == 17


# --------------------------------------------------------------------------------------------
# Prompt files: unreadable and non-UTF-8 files are named
# --------------------------------------------------------------------------------------------


def test_non_utf8_line_is_named(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "a", "label": "1"}\n{"prompt": "\xff", "label": "2"}\n')
    with pytest.raises(ValueError, match=rf"^{path}:2: not UTF-8 text \(byte 13 of the line\)"):
        load_prompts(DataConfig(prompt_data=str(path)))


def test_unreadable_file_is_named(tmp_path, monkeypatch):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "label": "1"}\n')

    def refuse(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(type(path), "open", refuse)  # chmod does not stop root
    with pytest.raises(ValueError, match=r"data.prompt_data='.*p.jsonl': cannot read \(Permission"):
        load_prompts(DataConfig(prompt_data=str(path)))


# --------------------------------------------------------------------------------------------
# The tokenizer saved next to an exported model carries its token ids
# --------------------------------------------------------------------------------------------


def test_saved_tokenizer_writes_token_ids_and_a_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "qwen3", "eos_token_id": None, "bos_token_id": None})
    )
    save_tokenizer_for_model(None, tmp_path)
    eos = toy_tokenizer().eos_token_id
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["eos_token_id"] == eos and config["pad_token_id"] == eos
    assert config["bos_token_id"] is None  # the toy tokenizer has no BOS token
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == eos and generation["pad_token_id"] == eos
    assert (tmp_path / "tokenizer_config.json").is_file()


def test_a_tokenizer_directory_generation_config_is_kept(tmp_path):
    source = tmp_path / "source"
    toy_tokenizer().save_pretrained(source)
    own = {"eos_token_id": [0, 3], "temperature": 0.6, "do_sample": True}
    (source / "generation_config.json").write_text(json.dumps(own))
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"model_type": "qwen3", "eos_token_id": 3}))
    save_tokenizer_for_model(source, target)
    assert json.loads((target / "generation_config.json").read_text()) == own
    assert json.loads((target / "config.json").read_text())["eos_token_id"] == 3  # kept


# --------------------------------------------------------------------------------------------
# A model that stops at an ordinary token is named before the first rollout
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("eos", "named"), [(0, {}), (2, {2: "0"}), (1, {1: "?"})])
def test_stop_ids_the_tokenizer_has_as_text_are_named(tmp_path, caplog, eos, named):
    """Mixtral's config class defaults EOS to 2, DeepSeek-V3's to 1: with the toy tokenizer the
    digit 0 and the unknown token, at which every response would end."""
    path = write_family_checkpoint(tmp_path, "mixtral", eos_token_id=eos)
    engine = HFEngine(HFEngineConfig(model_path=str(path), dtype="float32"))
    engine.load()
    assert engine.model_info.eos_token_ids == (eos,)
    assert ordinary_stop_ids(engine.model_info.eos_token_ids, toy_tokenizer()) == named
    sections = RolloutSections(engine=EngineConfig(kind="hf", hf=engine.config))
    with caplog.at_level("WARNING", logger="ember_rollout.rollout"):
        RolloutGenerator.from_config(engine=engine, sampling=SamplingConfig(), sections=sections)
    warned = [r.getMessage() for r in caplog.records if "ordinary" in r.getMessage()]
    assert len(warned) == bool(named)
    if named:
        assert str(named) in warned[0] and "tokenizer's EOS (0)" in warned[0]
