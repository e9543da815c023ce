"""Weight mapping Megatron <-> transformers, checked against real transformers models of every
family."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from ember_core.heads import PolicyHead
from ember_core.types import Sample, pack_samples
from ember_megatron_backend.hf_layout import (
    family_of,
    hf_config,
    hf_names,
    megatron_names,
    merge_qkv,
    model_config_from_hf,
    split_qkv,
)
from ember_megatron_backend.model import ModelConfig, build_model, packed_causal_mask
from ember_megatron_backend.weights import (
    export_hf_checkpoint,
    hf_shapes,
    iter_hf_weights,
    load_hf_checkpoint,
    named_tensors,
    shard,
    unshard,
)

PRESETS = [
    "tiny-moe",
    "tiny-dense",
    "tiny-deepseek-v3",
    "tiny-glm4-moe",
    "tiny-qwen2-moe",
    "tiny-mixtral",
    "tiny-llama",
]


def _config(preset: str) -> ModelConfig:
    # A wide init makes logits far from uniform, so a mapping slip shows in the log-probs.
    return ModelConfig.preset(preset).replace(init_method_std=0.15)


@pytest.fixture(scope="module", params=PRESETS)
def hf_dir(request, tmp_path_factory):
    """A random transformers model of the preset, saved by transformers itself."""
    cfg = _config(request.param)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(cfg))
    with torch.no_grad():  # norms start at 1, biases at 0: perturb them so a swap is caught
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name or "bias" in name:
                p.add_(0.2 * torch.randn_like(p))
    path = tmp_path_factory.mktemp(request.param) / "hf"
    model.save_pretrained(path)
    return cfg, path, model.state_dict()


def _keys(path):
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def test_hf_megatron_hf_round_trip_is_bit_exact(dist_env, hf_dir, tmp_path):
    cfg, path, reference = hf_dir
    model = build_model(cfg, seed=1)
    load_hf_checkpoint(model, path, cfg)
    out = export_hf_checkpoint(model, cfg, tmp_path / "export")
    assert _keys(out) == _keys(path)  # the same on-disk layout transformers writes
    with (
        safe_open(str(out / "model.safetensors"), framework="pt") as mine,
        safe_open(str(path / "model.safetensors"), framework="pt") as theirs,
    ):
        for key in theirs.keys():
            assert torch.equal(mine.get_tensor(key), theirs.get_tensor(key)), key
    reloaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert reloaded.keys() == reference.keys()
    for key, tensor in reference.items():
        assert torch.equal(reloaded[key], tensor), key
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [family_of(cfg).hf.architecture]
    assert config["model_type"] == cfg.family


def _reference_log_probs(model, samples, temperature):
    """Per sample, independently: log_softmax(logits / T) at the response tokens."""
    out = []
    for s in samples:
        ids = torch.tensor([s.tokens])
        with torch.no_grad():
            logits = model(ids).logits[0].double() / temperature
        rows = logits[len(s.tokens) - s.response_length - 1 : -1].log_softmax(-1)
        targets = ids[0, len(s.tokens) - s.response_length :]
        out.append(rows.gather(1, targets[:, None])[:, 0])
    return out


VARIANTS = {
    # norm_topk_prob=False: softmax over all experts
    "tiny-moe-unnormalised": ("tiny-moe", {"norm_topk_prob": False}),
    # routed_scaling_factor as DeepSeek-V3 ships it
    "tiny-deepseek-v3-scaled": ("tiny-deepseek-v3", {"moe_router_topk_scaling_factor": 2.5}),
    # YaRN as DeepSeek-V3 ships it, over positions past the original context (16)
    "tiny-deepseek-v3-yarn": (
        "tiny-deepseek-v3",
        {
            "rope_type": "yarn",
            "rope_yarn_factor": 4.0,
            "rope_yarn_original_max_position_embeddings": 16,
            "rope_yarn_mscale_all_dim": 1.0,
            "max_position_embeddings": 64,
        },
    ),
    # head_dim taken from the config, not hidden_size / num_attention_heads (16)
    "tiny-llama-head-dim": ("tiny-llama", {"head_dim": 24}),
}


@pytest.mark.parametrize("preset", [*PRESETS, *VARIANTS])
def test_megatron_log_probs_match_exported_transformers_model(dist_env, preset, tmp_path):
    if preset in VARIANTS:
        base, changes = VARIANTS[preset]
        cfg = _config(base).replace(**changes)
        assert model_config_from_hf(hf_config(cfg)) == cfg
    else:
        cfg = _config(preset)
    model = build_model(cfg, seed=3).eval()
    with torch.no_grad():
        for name, p in named_tensors(model):
            if "layernorm" in name or "bias" in name:
                p.add_(0.2 * torch.randn_like(p))
    hf = AutoModelForCausalLM.from_pretrained(export_hf_checkpoint(model, cfg, tmp_path / "x"))
    hf.eval()

    g = torch.Generator().manual_seed(5)
    shapes = [(9, 4), (6, 1), (23, 7), (8, 5)]  # (total length, response length)
    samples = [
        Sample(
            tokens=torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist(),
            response_length=r,
            index=i,
        )
        for i, (n, r) in enumerate(shapes)
    ]
    batch = pack_samples(samples, pad_multiple=8)  # 46 tokens + a 2-token padding segment
    mask = packed_causal_mask(batch.cu_seqlens, batch.padded_length)
    with torch.no_grad():
        logits = model(batch.tokens[None], batch.position_ids[None], attention_mask=mask)
    temperature = 0.7
    head = PolicyHead(temperature).log_probs(
        logits[:, : batch.num_tokens],
        batch.tokens[: batch.num_tokens],
        batch.total_lengths,
        batch.response_lengths,
    )
    expected = _reference_log_probs(hf, samples, temperature)
    for i, (mine, ref) in enumerate(zip(head.log_probs, expected, strict=True)):
        assert mine.shape == (samples[i].response_length,)
        torch.testing.assert_close(mine.double(), ref, atol=1e-4, rtol=0, msg=f"sample {i}")
    spread = torch.cat(expected)
    assert spread.std() > 0.5, "logits too uniform for the comparison to mean anything"


def test_in_memory_iterator_matches_checkpoint(dist_env, hf_dir):
    cfg, path, reference = hf_dir
    model = build_model(cfg, seed=1)
    load_hf_checkpoint(model, path, cfg)
    pairs = dict(iter_hf_weights(model, cfg))
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert pairs.keys() == set(f.keys())
        assert all(torch.equal(pairs[k], f.get_tensor(k)) for k in f.keys())
    assert sorted(hf_names(cfg)) == sorted(pairs)  # the description names what transformers writes


def test_loading_a_fused_expert_checkpoint(dist_env, hf_dir, tmp_path):
    """A checkpoint written from transformers 5's in-memory state (experts fused)."""
    from safetensors.torch import save_file

    cfg, path, reference = hf_dir
    if not cfg.is_moe or cfg.family == "mixtral":
        pytest.skip("fused storage applies to the mlp.experts layout")
    fused = {k: v.contiguous() for k, v in reference.items() if "inv_freq" not in k}
    (tmp_path / "ckpt").mkdir()
    save_file(fused, str(tmp_path / "ckpt" / "model.safetensors"))
    expected = build_model(cfg, seed=2)
    load_hf_checkpoint(expected, path, cfg)
    target = build_model(cfg, seed=4)
    load_hf_checkpoint(target, tmp_path / "ckpt", cfg)
    pairs = zip(named_tensors(expected), named_tensors(target), strict=True)
    for (name, a), (_, b) in pairs:
        assert torch.equal(a, b), name


def test_critic_loads_trunk_and_keeps_value_layer(dist_env, hf_dir):
    cfg, path, reference = hf_dir
    critic = build_model(cfg, critic=True, seed=1)
    load_hf_checkpoint(critic, path, cfg)
    params = dict(critic.named_parameters())
    assert torch.equal(
        params["embedding.word_embeddings.weight"], reference["model.embed_tokens.weight"]
    )
    assert torch.count_nonzero(params["output_layer.weight"]) == 0
    with pytest.raises(ValueError, match="critic"):
        next(iter_hf_weights(critic, cfg))


def test_other_architecture_names_first_mismatch_and_shapes(dist_env, hf_dir):
    cfg, path, _ = hf_dir
    # (Qwen2-MoE ties head_dim to hidden_size / heads: widen both.)
    wider = cfg.replace(
        hidden_size=2 * cfg.hidden_size,
        head_dim=2 * cfg.head_dim if cfg.family == "qwen2_moe" else cfg.head_dim,
    )
    with pytest.raises(ValueError) as err:
        load_hf_checkpoint(build_model(wider, seed=0), path, wider)
    message = str(err.value)
    assert "model.embed_tokens.weight" in message
    assert f"[{cfg.vocab_size}, {cfg.hidden_size}]" in message
    assert f"[{cfg.vocab_size}, {2 * cfg.hidden_size}]" in message

    shallower = cfg.replace(num_layers=cfg.num_layers - 1)
    with pytest.raises(ValueError, match=f"model.layers.{cfg.num_layers - 1}.") as err:
        load_hf_checkpoint(build_model(shallower, seed=0), path, shallower)
    assert "another architecture" in str(err.value)

    deeper = cfg.replace(num_layers=cfg.num_layers + 1)
    with pytest.raises(ValueError, match=f"lacks parameter model.layers.{cfg.num_layers}."):
        load_hf_checkpoint(build_model(deeper, seed=0), path, deeper)


def test_qkv_layout_is_grouped_by_query_group():
    cfg = ModelConfig.preset("tiny-moe")  # 4 query heads, 2 groups, head_dim 16
    d, h = cfg.head_dim, 3
    # Each head row block carries its own label: q heads 0-3, k heads 10-11, v heads 20-21.
    q = torch.arange(4).repeat_interleave(d)[:, None].expand(-1, h).float()
    k = (10 + torch.arange(2)).repeat_interleave(d)[:, None].expand(-1, h).float()
    v = (20 + torch.arange(2)).repeat_interleave(d)[:, None].expand(-1, h).float()
    qkv = merge_qkv(q, k, v, cfg)
    labels = qkv[::d, 0].tolist()
    assert labels == [0, 1, 10, 20, 2, 3, 11, 21]
    for a, b in zip(split_qkv(qkv, cfg), (q, k, v), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["column", "row", "glu", "replicated"])
def test_shard_unshard_inverse(kind):
    full = torch.arange(8 * 6).reshape(8, 6)
    pieces = [shard(full, kind, r, 2) for r in range(2)]
    assert torch.equal(unshard(pieces, kind), full)


def test_glu_shard_takes_each_half_separately():
    gate, up = torch.zeros(4, 2), torch.ones(4, 2)
    piece = shard(torch.cat([gate, up]), "glu", 1, 2)
    assert torch.equal(piece, torch.tensor([[0.0, 0], [0, 0], [1, 1], [1, 1]]))


@pytest.mark.parametrize("preset", PRESETS)
def test_config_round_trip_and_names(preset):
    cfg = ModelConfig.preset(preset)
    assert model_config_from_hf(hf_config(cfg)) == cfg
    names = megatron_names(cfg)
    assert len(names) == len(set(names))
    assert sum(p.numel() for p in map(torch.Size, hf_shapes(cfg).values())) > 0


def test_model_config_from_hf_rejects_other_models():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'; supported: .*llama"):
        model_config_from_hf(GPT2Config())


@pytest.mark.parametrize("preset", PRESETS)
def test_megatron_names_are_the_unsharded_model_names(dist_env, preset):
    cfg = ModelConfig.preset(preset)
    built = [n for n, _ in named_tensors(build_model(cfg, seed=0))]
    assert sorted(megatron_names(cfg)) == sorted(built) and len(built) == len(set(built))
    critic = build_model(cfg, critic=True, seed=0)
    assert sorted(megatron_names(cfg, critic=True)) == sorted(n for n, _ in named_tensors(critic))


def test_hf_load_reads_the_family_from_config_json(hf_dir):
    """`train.hf_load` of a directory transformers wrote: the same model shape comes back."""
    from ember_megatron_backend.config import BackendConfig

    cfg, path, _ = hf_dir
    assert BackendConfig(hf_load=str(path)).model_config() == cfg


def test_unsupported_features_are_named():
    from transformers import DeepseekV3Config, MixtralConfig

    dsv3 = hf_config(ModelConfig.preset("tiny-deepseek-v3"))
    dsv3.rope_interleave = False
    with pytest.raises(ValueError, match="rope_interleave=False"):
        model_config_from_hf(dsv3)
    with pytest.raises(ValueError, match="sliding_window=4096"):
        model_config_from_hf(MixtralConfig(sliding_window=4096))
    # transformers and SGLang score a group by its best two experts, megatron-core by its best
    # topk / group_topk: only topk = 2 x group_topk routes alike.
    model_config_from_hf(DeepseekV3Config())  # 8 experts of 4 groups: 2 x 4
    with pytest.raises(ValueError, match="must be 2 x moe_router_group_topk=2"):
        model_config_from_hf(DeepseekV3Config(topk_group=2))
    yarn = hf_config(ModelConfig.preset("tiny-glm4-moe"))
    yarn.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0}
    with pytest.raises(ValueError, match="rope_type 'yarn' is not supported for glm4_moe"):
        model_config_from_hf(yarn)


# SmolLM2-135M-Instruct's config.json as transformers 5.19 reads it (DESIGN.md section 11).
SMOLLM2 = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 9.999999747378752e-06,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}


def test_smollm2_config_reads_as_a_tied_llama():
    from transformers import LlamaConfig

    cfg = model_config_from_hf(LlamaConfig(**SMOLLM2))
    expected = dict(num_layers=30, hidden_size=576, num_attention_heads=9, num_query_groups=3)
    expected.update(head_dim=64, ffn_hidden_size=1536, vocab_size=49152, num_experts=0)
    expected.update(tie_word_embeddings=True, rope_theta=100_000.0, rope_type="default")
    expected.update(norm_epsilon=9.999999747378752e-06, max_position_embeddings=8192)
    expected.update(qk_layernorm=False, add_qkv_bias=False, family="llama")
    assert {k: getattr(cfg, k) for k in expected} == expected
    back = hf_config(cfg)
    assert type(back).__name__ == "LlamaConfig" and back.architectures == ["LlamaForCausalLM"]
    assert model_config_from_hf(back) == cfg
    shapes = hf_shapes(cfg)
    assert "lm_head.weight" not in shapes  # tied: the embedding is the output layer
    assert shapes["model.layers.29.self_attn.k_proj.weight"] == (3 * 64, 576)
    assert sum(math.prod(s) for s in shapes.values()) == 134_515_008  # SmolLM2-135M
    # Three query heads per key/value head: each group's heads stay together in linear_qkv.
    q, k, v = (torch.randn(n * 64, 4) for n in (9, 3, 3))
    merged = merge_qkv(q, k, v, cfg)
    assert torch.equal(merged[: 3 * 64], q[: 3 * 64]) and torch.equal(
        merged[3 * 64 : 4 * 64], k[:64]
    )
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(merged, cfg), (q, k, v), strict=True))


def test_tensor_parallel_that_splits_heads_is_refused_in_one_line():
    from transformers import LlamaConfig

    cfg = model_config_from_hf(LlamaConfig(**SMOLLM2))
    with pytest.raises(ValueError) as err:
        cfg.check_tensor_parallel(2)
    assert str(err.value) == (
        "tensor_model_parallel_size=2 must divide num_attention_heads=9 and num_query_groups=3 "
        "(each tensor-parallel rank holds whole heads)"
    )
    cfg.check_tensor_parallel(3)  # 3 heads and 1 group per rank
    with pytest.raises(ValueError, match="num_attention_heads=9 and num_query_groups=3"):
        cfg.check_tensor_parallel(9)  # whole query heads, but a third of a key/value head


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"attention_bias": True},
            "llama config has attention_bias=True; only attention_bias=False",
        ),
        ({"mlp_bias": True}, "llama config has mlp_bias=True; only mlp_bias=False"),
        ({"hidden_act": "gelu"}, "llama config has hidden_act='gelu'; only hidden_act='silu'"),
        (
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                }
            },
            "rope_type 'llama3' is not supported for llama",
        ),
        (
            {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}},
            "rope_type 'linear' is not supported for llama",
        ),
    ],
)
def test_llama_features_ember_does_not_build_are_named(change, message):
    from transformers import LlamaConfig

    with pytest.raises(ValueError, match=message):
        model_config_from_hf(LlamaConfig(**{**SMOLLM2, **change}))
