"""Weight updates of the hf engine from HF-named tensors and from checkpoint directories."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY, make_engine

from ember_rollout.config import HFEngineConfig
from ember_rollout.engine import EngineError, GenerateRequest, SamplingParams
from ember_rollout.hf_engine import HFEngine
from ember_rollout.models import iter_checkpoint, load_hf_weights, write_tiny_checkpoint
from ember_rollout.sglang_launch import free_port

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
    # Exact: both engines build the same modules from the same config, and an update copies
    # into the existing parameters, so the layouts, kernels and their order are the same on any
    # processor (unlike an engine loaded through from_pretrained: test_moe_families.py).
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


# -- a dense model with tied embeddings (Llama, as SmolLM2) ------------------------------------


def write_tied_llama(path, seed):
    """A tiny random LlamaForCausalLM shaped like SmolLM2 (three query heads per key/value head,
    tied embeddings, RoPE theta 1e5) with the toy tokenizer, saved by transformers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ember_rollout.tokenizer import toy_tokenizer

    tokenizer = toy_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        tie_word_embeddings=True,
        initializer_range=0.2,  # logits far from uniform, so a stale output layer shows
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tied_llamas(tmp_path_factory):
    return [write_tied_llama(tmp_path_factory.mktemp(f"llama{seed}"), seed) for seed in (1, 2)]


def _served(path, dtype="float32") -> HFEngine:
    engine = HFEngine(HFEngineConfig(model_path=str(path), dtype=dtype))
    engine.load()
    return engine


def test_tied_dense_llama_is_served_and_takes_weights_without_lm_head(tied_llamas):
    first, second = tied_llamas
    engine = _served(first)
    model = engine.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    info = engine.model_info
    assert (info.num_layers, info.moe_layers, info.num_experts, info.topk) == (2, (), 0, 0)
    out = sample(engine)
    # A dense model reports zeros for every layer, in the layout MoE models use.
    assert out.routed_experts.shape == (4 + 8 - 1, 2, 1) and not out.routed_experts.any()

    # What a trainer pushes for a tied model: the checkpoint's names, which have no lm_head.
    named = [(n, t.clone()) for n, t in iter_checkpoint(second)]
    assert "lm_head.weight" not in dict(named) and "model.embed_tokens.weight" in dict(named)
    asyncio.run(engine.update_weights_from_tensors(iter(named), weight_version="v1"))
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still one tensor
    assert torch.equal(model.lm_head.weight, dict(named)["model.embed_tokens.weight"])
    expected = sample(_served(second))
    got = sample(engine)
    assert got.output_log_probs != out.output_log_probs
    # Exact: both engines are the same transformers modules loaded the same way.
    assert got.output_ids == expected.output_ids
    assert got.output_log_probs == expected.output_log_probs
    bf16 = _served(first, "bfloat16").model  # cast as the engine serves by default: still tied
    assert bf16.lm_head.weight is bf16.model.embed_tokens.weight


# -- weights broadcast over gloo ---------------------------------------------------------------

SENDER = Path(__file__).with_name("weight_sender.py")


def flatten(named):
    """A bucket as a trainer sends it: names, dtypes, shapes, and the bytes back to back."""
    names = [n for n, _ in named]
    dtypes = [str(t.dtype).removeprefix("torch.") for _, t in named]
    shapes = [list(t.shape) for _, t in named]
    flat = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for _, t in named])
    return (names, dtypes, shapes), flat


@contextlib.contextmanager
def sender(tmp_path, flats, group="ember-weights-test"):
    """A trainer process that joins `group` (world 2) as rank 0 and broadcasts `flats`."""
    path = tmp_path / "buckets.pt"
    torch.save(flats, path)
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, str(SENDER), str(port), "2", group, str(path)],
    )
    try:
        yield {
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": group,
            "backend": "gloo",
        }
        assert process.wait(timeout=120) == 0
    finally:
        process.kill()


@pytest.mark.slow  # a sender subprocess
def test_broadcast_buckets_over_gloo_switch_the_policy_and_the_version(other_checkpoint, tmp_path):
    expected = sample(HFEngine(HFEngineConfig(dtype="float32", tiny=OTHER)))
    named = list(iter_checkpoint(other_checkpoint))
    buckets = [flatten(named[i : i + 7]) for i in range(0, len(named), 7)]
    engine = make_engine("float32")
    engine.weight_version = "-1"
    assert sample(engine).output_log_probs != expected.output_log_probs

    async def receive(join):
        await engine.init_weights_update_group(**join)
        await engine.begin_weight_update()
        for i, (meta, _) in enumerate(buckets):
            last = i == len(buckets) - 1
            await engine.update_weights_from_distributed(
                *meta, group_name=join["group_name"], weight_version="3" if last else None
            )
            assert engine.weight_version == "-1", "no new version before the session closes"
        await engine.end_weight_update()

    with sender(tmp_path, [flat for _, flat in buckets]) as join:
        asyncio.run(receive(join))
    got = sample(engine)
    assert got.output_ids == expected.output_ids
    assert got.output_log_probs == expected.output_log_probs
    assert got.meta_info["weight_version"] == "3"


@pytest.mark.slow  # a sender subprocess
def test_broadcast_updates_refuse_what_sglang_refuses(other_checkpoint, tmp_path):
    engine = make_engine("float32")
    engine.weight_version = "-1"
    embed = engine.model.get_input_embeddings().weight
    before = embed.detach().clone()
    named = dict(iter_checkpoint(other_checkpoint))
    good = flatten([("model.embed_tokens.weight", named["model.embed_tokens.weight"])])
    wrong = flatten([("model.norm.weight", torch.ones(5)), ("lm_head.weight", torch.ones(2))])

    async def refusals(join):
        group = join["group_name"]
        meta = good[0]
        with pytest.raises(EngineError, match="must run between begin_weight_update"):
            await engine.update_weights_from_distributed(*meta, group_name=group)
        await engine.init_weights_update_group(**join)
        with pytest.raises(EngineError, match="exists already"):
            await engine.init_weights_update_group(**join)
        await engine.begin_weight_update()
        with pytest.raises(EngineError, match="already open"):
            await engine.begin_weight_update()
        with pytest.raises(EngineError, match=r"'nope' not in \['ember-weights-test'\]"):
            await engine.update_weights_from_distributed(*meta, group_name="nope")
        with pytest.raises(EngineError, match="1 names, 2 dtypes and 1 shapes"):
            await engine.update_weights_from_distributed(
                meta[0], ["float32", "float32"], meta[2], group_name=group
            )
        with pytest.raises(EngineError, match="dtype 'float33' is not a torch dtype"):
            await engine.update_weights_from_distributed(
                meta[0], ["float33"], meta[2], group_name=group
            )
        # Received, then refused before anything is copied: a shape the model does not have.
        with pytest.raises(EngineError, match=r"'model.norm.weight': shape \(5,\)"):
            await engine.update_weights_from_distributed(*wrong[0], group_name=group)
        assert torch.equal(embed, before)
        await engine.update_weights_from_distributed(*meta, group_name=group, weight_version="0")
        assert torch.equal(embed, named["model.embed_tokens.weight"])
        # One tensor is not a whole model, and it was copied: no version names the mix.
        with pytest.raises(EngineError, match="leaves out .*serves no weight version until"):
            await engine.end_weight_update()
        with pytest.raises(EngineError, match="no weight-update session is open"):
            await engine.end_weight_update()
        await engine.destroy_weights_update_group(group)
        with pytest.raises(EngineError, match="no weight group"):
            await engine.destroy_weights_update_group(group)

    with sender(tmp_path, [wrong[1], good[1]]) as join:
        asyncio.run(refusals(join))
    assert engine.weight_version is None
    with pytest.raises(EngineError, match="serves no weight version until"):
        sample(engine)
    with pytest.raises(ValueError, match="backend='nccl': the hf engine receives weights over"):
        asyncio.run(engine.init_weights_update_group(**{**join, "backend": "nccl"}))
