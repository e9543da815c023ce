"""Weight updates of the hf engine from HF-named tensors and from checkpoint directories."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from conftest import TINY, make_engine

from ember_rollout.config import HFEngineConfig
from ember_rollout.engine import GenerateRequest, SamplingParams
from ember_rollout.hf_engine import HFEngine
from ember_rollout.models import iter_checkpoint, load_hf_weights, write_tiny_checkpoint

OTHER = dataclasses.replace(TINY, init_seed=TINY.init_seed + 1)


def sample(engine, seed=0):
    request = GenerateRequest(
        input_ids=[12, 4, 5, 16],
        sampling=SamplingParams(max_new_tokens=8, seed=seed, ignore_eos=True),
        fields={"return_routed_experts": True},
    )
    return engine.generate_sync([request])[0]


@pytest.fixture(scope="module")
def other_checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), OTHER)


def test_checkpoint_holds_per_expert_hf_names(other_checkpoint):
    names = {name for name, _ in iter_checkpoint(other_checkpoint)}
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in names
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in names
    assert not any(name.endswith("gate_up_proj") for name in names)
    assert (other_checkpoint / "tokenizer.json").is_file()


def test_loading_checkpoint_names_equals_from_pretrained(other_checkpoint):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(other_checkpoint, dtype=torch.float32)
    engine = make_engine("float32")
    count = load_hf_weights(engine.model, iter_checkpoint(other_checkpoint))
    assert count == len(list(iter_checkpoint(other_checkpoint)))
    ours, theirs = engine.model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


def test_update_from_disk_and_from_tensors_switch_the_policy(other_checkpoint):
    target = HFEngine(HFEngineConfig(dtype="float32", tiny=OTHER))
    expected = sample(target)
    from_disk = make_engine("float32")
    # A random-init model is close to uniform, so compare log-probs, not only tokens.
    assert sample(from_disk).output_log_probs != expected.output_log_probs
    asyncio.run(from_disk.update_weights_from_disk(other_checkpoint, weight_version="v1"))
    got = sample(from_disk)
    assert got.output_ids == expected.output_ids
    assert got.output_log_probs == expected.output_log_probs
    assert torch.equal(got.routed_experts, expected.routed_experts)
    assert got.meta_info["weight_version"] == "v1"

    from_tensors = make_engine("float32")
    named = [(n, t.clone()) for n, t in iter_checkpoint(other_checkpoint)]
    asyncio.run(from_tensors.update_weights_from_tensors(iter(named), weight_version="v2"))
    assert sample(from_tensors).output_log_probs == expected.output_log_probs


def test_engine_serves_a_local_model_directory(other_checkpoint):
    from_dir = HFEngine(HFEngineConfig(model_path=str(other_checkpoint), dtype="float32"))
    built = HFEngine(HFEngineConfig(dtype="float32", tiny=OTHER))
    a, b = sample(from_dir), sample(built)
    assert from_dir.model_info == built.model_info
    assert a.output_ids == b.output_ids
    assert a.output_log_probs == pytest.approx(b.output_log_probs, abs=1e-5)
    assert torch.equal(a.routed_experts, b.routed_experts)
    with pytest.raises(ValueError, match="no config.json there"):
        HFEngine(HFEngineConfig(model_path=str(other_checkpoint / "absent"))).load()


def test_partial_update_touches_only_named_tensors():
    engine = make_engine("float32")
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    gate = torch.full((TINY.moe_intermediate_size, TINY.hidden_size), 0.5)
    load_hf_weights(engine.model, [("model.layers.2.mlp.experts.1.up_proj.weight", gate)])
    fused = engine.model.state_dict()["model.layers.2.mlp.experts.gate_up_proj"]
    half = TINY.moe_intermediate_size
    assert torch.equal(fused[1, half:], gate)  # up is the second half
    assert torch.equal(fused[1, :half], before["model.layers.2.mlp.experts.gate_up_proj"][1, :half])
    changed = [k for k, v in engine.model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed == ["model.layers.2.mlp.experts.gate_up_proj"]


def test_bf16_engine_casts_incoming_fp32_tensors(bf16_engine):
    embed = torch.randn(17, TINY.hidden_size)
    load_hf_weights(bf16_engine.model, [("model.embed_tokens.weight", embed)])
    stored = bf16_engine.model.state_dict()["model.embed_tokens.weight"]
    assert stored.dtype == torch.bfloat16 and torch.equal(stored, embed.bfloat16())


def test_unknown_names_and_wrong_shapes_are_errors(fp32_engine):
    with pytest.raises(ValueError, match="'model.layers.0.mlp.nope.weight' matches no parameter"):
        load_hf_weights(fp32_engine.model, [("model.layers.0.mlp.nope.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"shape \(2, 2\) does not match the model's \(17, 48\)"):
        load_hf_weights(fp32_engine.model, [("model.embed_tokens.weight", torch.zeros(2, 2))])
    with pytest.raises(ValueError, match="expert 99 >= 8 experts"):
        load_hf_weights(
            fp32_engine.model,
            [("model.layers.0.mlp.experts.99.down_proj.weight", torch.zeros(48, 64))],
        )
    with pytest.raises(ValueError, match="does not fit the fused expert tensor"):
        load_hf_weights(
            fp32_engine.model,
            [("model.layers.0.mlp.experts.1.gate_proj.weight", torch.zeros(5, 48))],
        )
