"""`ember upcycle`: a dense llama becomes a Mixtral that computes the same function, then
noise makes routing matter; transformers, Ember's Megatron side and the hf engine read it."""

from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
)

from ember.cli import main
from ember.upcycle import upcycle
from ember_rollout.tokenizer import save_toy_tokenizer, toy_tokenizer

LAYERS, HIDDEN, INTERMEDIATE = 2, 64, 96
VOCAB = len(toy_tokenizer())


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """(path, model) of a tiny random dense llama with tied embeddings and the toy tokenizer.

    Weights are wider than transformers' init (std 0.1) so the logits are far from uniform, and
    the norms are perturbed from 1 so a norm copied to the wrong place shows.
    """
    tok = toy_tokenizer()
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        rms_norm_eps=1e-5,
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("dense") / "llama"
    model.save_pretrained(path)
    save_toy_tokenizer(path)
    return path, model


def _tokens(seed=1, batch=3, length=24):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _log_probs(model, ids):
    with torch.no_grad():
        return model(ids).logits.log_softmax(-1)


def _routers(model):
    return [layer.mlp.gate for layer in model.model.layers]


def test_zero_noise_computes_the_dense_model(dense, tmp_path):
    """The proof of the upcycling: copies of the MLP behind any router are the MLP.

    Mixtral renormalises the top-k router weights to sum to 1, so the MoE output is
    sum_k w_k * MLP(x) = MLP(x) up to fp32 rounding of that weighted sum (a few ulps per
    layer; measured 5e-7 on the log-probs here), hence 1e-5.
    """
    path, model = dense
    out = upcycle(path, tmp_path / "moe", experts=4, top_k=2, noise=0.0, seed=3)
    assert out.path == tmp_path / "moe"
    config = json.loads((out.path / "config.json").read_text())
    expected = {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
        "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB,
        "eos_token_id": 0,
        "pad_token_id": 0,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": None,
        "router_jitter_noise": 0.0,
        "router_aux_loss_coef": 0.0,
        "output_router_logits": False,
        "tie_word_embeddings": False,
    }
    assert {k: config.get(k) for k in expected} == expected

    dense_weights = load_file(path / "model.safetensors")
    moe_weights = load_file(out.path / "model.safetensors")
    embed = dense_weights["model.embed_tokens.weight"]
    assert moe_weights["lm_head.weight"].equal(embed)  # untied copy
    for name, tensor in dense_weights.items():
        if ".mlp." not in name:
            assert moe_weights[name].equal(tensor), name
    for i in range(LAYERS):
        for e in range(4):
            for dense_name, w in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
                got = moe_weights[f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight"]
                assert got.equal(dense_weights[f"model.layers.{i}.mlp.{dense_name}_proj.weight"])
    assert len(moe_weights) == len(dense_weights) + 1 + LAYERS * (1 + 4 * 3 - 3)

    moe = AutoModelForCausalLM.from_pretrained(out.path).eval()
    ids = _tokens()
    expected_lp, got_lp = _log_probs(model, ids), _log_probs(moe, ids)
    assert expected_lp.std() > 0.5, "logits too uniform for the comparison to mean anything"
    torch.testing.assert_close(got_lp, expected_lp, atol=1e-5, rtol=0)
    # Not vacuous: the router spreads the tokens over the experts.
    chosen = set()
    moe.model.layers[0].mlp.gate.register_forward_hook(
        lambda m, a, o: chosen.update(o[2].flatten().tolist())
    )
    _log_probs(moe, ids)
    assert len(chosen) == 4

    assert AutoTokenizer.from_pretrained(out.path).eos_token_id == 0
    assert GenerationConfig.from_pretrained(out.path).eos_token_id == 0


def test_with_noise_the_experts_differ_and_routing_matters(dense, tmp_path):
    path, model = dense
    noise = 0.05
    out = upcycle(path, tmp_path / "moe", experts=4, top_k=2, noise=noise, seed=0)
    dense_weights = load_file(path / "model.safetensors")
    weights = load_file(out.path / "model.safetensors")
    for i in range(LAYERS):
        base = dense_weights[f"model.layers.{i}.mlp.up_proj.weight"]
        experts = [
            weights[f"model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight"] for e in range(4)
        ]
        for e, w in enumerate(experts):
            relative = float((w - base).std() / base.std())
            assert relative == pytest.approx(noise, rel=0.1), (i, e, relative)
            assert all(not w.equal(other) for other in experts[e + 1 :])

    moe = AutoModelForCausalLM.from_pretrained(out.path).eval()
    ids = _tokens()
    before = _log_probs(moe, ids)
    assert (before - _log_probs(model, ids)).abs().max() > 1e-3  # the noise changes the function
    with torch.no_grad():
        for gate in _routers(moe):
            gate.weight.copy_(gate.weight.flip(0))  # the same scores, dealt to other experts
    after = _log_probs(moe, ids)
    assert (after - before).abs().max() > 1e-3, "another router gave the same output"


def test_same_seed_same_files_other_seed_other_weights(dense, tmp_path):
    path, _ = dense
    runs = {
        name: upcycle(path, tmp_path / name, experts=3, top_k=1, seed=seed).path
        for name, seed in (("a", 7), ("b", 7), ("c", 8))
    }
    files = sorted(p.name for p in runs["a"].iterdir())
    assert "model.safetensors" in files and "tokenizer.json" in files
    for name in files:
        assert (runs["a"] / name).read_bytes() == (runs["b"] / name).read_bytes(), name
    assert sorted(p.name for p in runs["c"].iterdir()) == files
    a, c = load_file(runs["a"] / "model.safetensors"), load_file(runs["c"] / "model.safetensors")
    differ = {n for n in a if not a[n].equal(c[n])}
    assert "model.layers.1.block_sparse_moe.gate.weight" in differ
    assert "model.layers.0.block_sparse_moe.experts.2.w2.weight" in differ
    assert not any("self_attn" in n or "norm" in n or "embed" in n for n in differ)


@pytest.fixture(scope="module")
def distributed():
    """A single-process gloo group for Megatron; left as found (other modules may hold one)."""
    import torch.distributed as dist

    from ember_megatron_backend.parallel import destroy_distributed, init_distributed

    owned = not dist.is_initialized()
    init_distributed()
    yield
    if owned:
        destroy_distributed()


def test_megatron_loads_the_upcycled_model_and_matches_transformers(dense, distributed, tmp_path):
    """Ember's Megatron mixtral family reads the checkpoint; its fp32 log-probs match
    transformers' to 1e-4 (two fp32 implementations with different matmul and attention
    orders, as the backend's own export test allows). Router std 0.5 keeps routing decisions
    far from ties, so both pick the same experts and the noise makes that choice count."""
    from ember_core.heads import PolicyHead
    from ember_core.types import Sample, pack_samples
    from ember_megatron_backend.hf_layout import model_config_from_hf
    from ember_megatron_backend.model import build_model, packed_causal_mask
    from ember_megatron_backend.weights import load_hf_checkpoint

    path, _ = dense
    out = upcycle(path, tmp_path / "moe", experts=4, top_k=2, noise=0.05, router_std=0.5).path
    cfg = model_config_from_hf(AutoConfig.from_pretrained(out))
    assert (cfg.family, cfg.num_experts, cfg.moe_router_topk, cfg.head_dim) == ("mixtral", 4, 2, 16)
    assert (cfg.tie_word_embeddings, cfg.rope_theta, cfg.moe_ffn_hidden_size) == (
        False,
        100000.0,
        INTERMEDIATE,
    )
    model = build_model(cfg, seed=11).eval()
    load_hf_checkpoint(model, out, cfg)
    hf = AutoModelForCausalLM.from_pretrained(out).eval()

    g = torch.Generator().manual_seed(5)
    shapes = [(9, 4), (23, 7), (14, 5)]  # (total length, response length)
    samples = [
        Sample(
            tokens=torch.randint(0, VOCAB, (n,), generator=g).tolist(), response_length=r, index=i
        )
        for i, (n, r) in enumerate(shapes)
    ]
    batch = pack_samples(samples, pad_multiple=8)
    mask = packed_causal_mask(batch.cu_seqlens, batch.padded_length)
    with torch.no_grad():
        logits = model(batch.tokens[None], batch.position_ids[None], attention_mask=mask)
    head = PolicyHead(1.0).log_probs(
        logits[:, : batch.num_tokens],
        batch.tokens[: batch.num_tokens],
        batch.total_lengths,
        batch.response_lengths,
    )
    refs = []
    for s, mine in zip(samples, head.log_probs, strict=True):
        ids = torch.tensor([s.tokens])
        with torch.no_grad():
            rows = hf(ids).logits[0, len(s.tokens) - s.response_length - 1 : -1].double()
        ref = rows.log_softmax(-1).gather(1, ids[0, -s.response_length :, None])[:, 0]
        torch.testing.assert_close(mine.double(), ref, atol=1e-4, rtol=0, msg=f"sample {s.index}")
        refs.append(ref)
    assert torch.cat(refs).std() > 0.5, "logits too uniform for the comparison to mean anything"


def test_hf_engine_serves_it_and_records_routed_experts(dense, tmp_path):
    from ember_rollout.config import HFEngineConfig
    from ember_rollout.engine import GenerateRequest, SamplingParams
    from ember_rollout.hf_engine import HFEngine

    path, _ = dense
    # Router std 0.5: routing decisions far from ties, so cached decoding and one plain
    # forward choose alike.
    out = upcycle(path, tmp_path / "moe", experts=4, top_k=2, router_std=0.5).path
    engine = HFEngine(HFEngineConfig(model_path=str(out), dtype="float32"))
    engine.load()
    info = engine.model_info
    assert (info.num_layers, info.num_experts, info.topk, info.moe_layers) == (2, 4, 2, (0, 1))
    prompt = [12, 5, 3, 16]
    request = GenerateRequest(
        input_ids=prompt,
        sampling=SamplingParams(max_new_tokens=6, seed=0, ignore_eos=True),
        fields={"return_routed_experts": True},
    )
    (result,) = engine.generate_sync([request])
    tokens = prompt + result.output_ids
    experts = result.routed_experts
    assert experts.shape == (len(tokens) - 1, LAYERS, 2)
    # Independently: the top-2 of each router's logits on one plain forward.
    logits = []
    hooks = [
        g.register_forward_hook(lambda m, a, o: logits.append(o[0])) for g in _routers(engine.model)
    ]
    try:
        with torch.no_grad():
            engine.model(torch.tensor([tokens[:-1]]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    for layer, layer_logits in enumerate(logits):
        expected = layer_logits.topk(2, dim=-1).indices.sort(-1).values
        assert torch.equal(experts[:, layer].long().sort(-1).values, expected), layer


BAD = [
    ({"experts": 2, "top_k": 4}, "--top-k 4 exceeds --experts 2"),
    ({"experts": 0, "top_k": 0}, "--experts 0: expected at least 1"),
    ({"noise": -0.1}, "--noise -0.1: expected a number >= 0"),
    ({"router_std": 0.0}, "--router-std 0.0: expected a number > 0"),
]


@pytest.mark.parametrize(("options", "message"), BAD)
def test_bad_options_are_refused_in_one_line(dense, tmp_path, options, message):
    path, _ = dense
    with pytest.raises(ValueError, match="^" + message.replace("+", r"\+") + "$"):
        upcycle(path, tmp_path / "out", **options)
    assert not (tmp_path / "out").exists()


def test_bad_sources_are_refused_before_reading_weights(dense, tmp_path):
    path, _ = dense
    with pytest.raises(FileNotFoundError, match="no such checkpoint directory"):
        upcycle(tmp_path / "nope", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a transformers checkpoint"):
        upcycle(tmp_path / "empty", tmp_path / "out")
    qwen3 = tmp_path / "qwen3"
    qwen3.mkdir()
    (qwen3 / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(
        ValueError, match="'qwen3' cannot be upcycled .*supported dense types: llama"
    ):
        upcycle(qwen3, tmp_path / "out")
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("")
    with pytest.raises(ValueError, match="not an empty directory"):
        upcycle(path, full)
    assert not (tmp_path / "out").exists()


def test_cli_error_is_one_line_with_status_2(dense, tmp_path, capsys):
    path, _ = dense
    start = time.monotonic()
    status = main(["upcycle", str(path), str(tmp_path / "out"), "--experts", "2", "--top-k", "4"])
    assert time.monotonic() - start < 10
    assert status == 2
    assert capsys.readouterr().err == "ember upcycle: error: --top-k 4 exceeds --experts 2\n"
    assert not (tmp_path / "out").exists()


def test_cli_writes_and_says_where(dense, tmp_path, capsys):
    path, _ = dense
    status = main(["upcycle", str(path), str(tmp_path / "out"), "--experts", "3", "--top-k", "1"])
    assert status == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1] == str(tmp_path / "out")
    assert "3 experts (top-1)" in printed[0]
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # no temp dir left


def test_each_layer_draws_its_own_router_and_noise(dense, tmp_path):
    """Layers have their own generators: one seed repeated in every layer would give every
    layer the same router and the same noise pattern on its experts."""
    path, _ = dense
    noise = 0.05
    out = upcycle(path, tmp_path / "moe", experts=4, top_k=2, noise=noise, seed=5)
    dense_weights = load_file(path / "model.safetensors")
    weights = load_file(out.path / "model.safetensors")
    routers = [weights[f"model.layers.{i}.block_sparse_moe.gate.weight"] for i in range(LAYERS)]
    draws = []  # per layer, the unit-variance draw behind each expert's noise
    for i in range(LAYERS):
        base = dense_weights[f"model.layers.{i}.mlp.up_proj.weight"]
        w = weights[f"model.layers.{i}.block_sparse_moe.experts.0.w3.weight"]
        draws.append(((w - base) / (noise * base.std())).flatten())
    for i in range(1, LAYERS):
        # Independent standard normal draws: correlation ~ N(0, 1/n), n = 4 x 64 and 96 x 64.
        router_corr = torch.corrcoef(torch.stack([routers[0].flatten(), routers[i].flatten()]))
        assert abs(float(router_corr[0, 1])) < 0.3, (i, float(router_corr[0, 1]))
        noise_corr = torch.corrcoef(torch.stack([draws[0], draws[i]]))
        assert abs(float(noise_corr[0, 1])) < 0.3, (i, float(noise_corr[0, 1]))
