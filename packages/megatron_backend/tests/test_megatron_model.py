"""ModelConfig validation, the GPTModel provider and the packed attention mask."""

from __future__ import annotations

import pytest
import torch

from ember_megatron_backend.model import (
    PRESETS,
    ModelConfig,
    ValueOutputLayer,
    build_model,
    packed_causal_mask,
)


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"num_layers": 0}, "num_layers"),
        ({"hidden_size": 64.0}, "hidden_size"),
        ({"num_query_groups": 3}, "num_query_groups"),
        ({"moe_ffn_hidden_size": 0}, "moe_ffn_hidden_size"),
        ({"moe_router_topk": 9}, "moe_router_topk"),
        ({"rope_theta": 0}, "rope_theta"),
        ({"norm_epsilon": -1e-6}, "norm_epsilon"),
        ({"moe_router_dtype": "bf16"}, "moe_router_dtype"),
        ({"num_experts": 0, "ffn_hidden_size": 0}, "ffn_hidden_size"),
        ({"family": "llama"}, "family='llama' with num_experts=8: llama is a dense family"),
        (
            {"family": "mixtral", "num_experts": 0},
            "family='mixtral' with num_experts=0: mixtral is an MoE family",
        ),
    ],
)
def test_model_config_errors_name_the_key(changes, key):
    with pytest.raises(ValueError, match=f"model.{key}"):
        ModelConfig.preset("tiny-moe").replace(**changes)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        ModelConfig.preset("huge")


def test_preset_is_a_copy():
    cfg = ModelConfig.preset("tiny-moe")
    cfg.num_layers = 1
    assert PRESETS["tiny-moe"].num_layers == 4


def test_packed_causal_mask_blocks_and_causality():
    mask = packed_causal_mask(torch.tensor([0, 2, 5]), 6)[0, 0]
    allowed = ~mask
    expected = torch.zeros(6, 6, dtype=torch.bool)
    for a, b in [(0, 2), (2, 5), (5, 6)]:  # the tail past cu_seqlens[-1] is its own block
        for i in range(a, b):
            expected[i, a : i + 1] = True
    assert torch.equal(allowed, expected)


def test_moe_model_shape(dist_env):
    cfg = ModelConfig.preset("tiny-moe")
    model = build_model(cfg, seed=0)
    params = dict(model.named_parameters())
    layer = "decoder.layers.3."
    assert params[layer + "self_attention.linear_qkv.weight"].shape == (
        (cfg.num_attention_heads + 2 * cfg.num_query_groups) * cfg.head_dim,
        cfg.hidden_size,
    )
    assert params[layer + "self_attention.q_layernorm.weight"].shape == (cfg.head_dim,)
    assert params[layer + "mlp.router.weight"].shape == (cfg.num_experts, cfg.hidden_size)
    fc1 = params[layer + "mlp.experts.local_experts.7.linear_fc1.weight"]
    assert fc1.shape == (2 * cfg.moe_ffn_hidden_size, cfg.hidden_size)
    assert params["output_layer.weight"].shape == (cfg.vocab_size, cfg.hidden_size)
    assert model.config.moe_router_topk == 2 and model.config.moe_router_pre_softmax is False
    assert all(p.device.type == "cpu" for p in params.values())


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-llama"])
def test_dense_tied_model_has_no_output_weight(dist_env, preset):
    cfg = ModelConfig.preset(preset)
    model = build_model(cfg, seed=0)
    names = {n for n, _ in model.named_parameters()}
    assert "output_layer.weight" not in names
    assert "decoder.layers.1.mlp.linear_fc1.weight" in names
    assert not any("router" in n for n in names)
    assert model.share_embeddings_and_output_weights
    qk_norm = any(n.endswith("self_attention.q_layernorm.weight") for n in names)
    assert qk_norm == (preset == "tiny-dense")  # Qwen3 has QK-norm, Llama none
    assert model.config.num_query_groups == cfg.num_query_groups
    assert model.rotary_pos_emb.inv_freq[1].item() == pytest.approx(
        cfg.rope_theta ** (-2 / cfg.head_dim)
    )


def _batch(cfg, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    ids = torch.randint(0, cfg.vocab_size, (1, total), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return ids, pos, packed_causal_mask(cu)


def test_moe_forward_backward_on_cpu(dist_env):
    cfg = ModelConfig.preset("tiny-moe")
    model = build_model(cfg, seed=0)
    ids, pos, mask = _batch(cfg, [5, 7])
    logits = model(ids, pos, attention_mask=mask)
    assert logits.shape == (1, 12, cfg.vocab_size)
    logits.float().logsumexp(-1).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert grads["decoder.layers.0.mlp.router.weight"].abs().sum() > 0
    assert grads["decoder.layers.0.self_attention.k_layernorm.weight"].abs().sum() > 0
    assert all(p.device.type == "cpu" for p in model.parameters())  # the router stayed put


def test_packed_samples_do_not_see_each_other(dist_env):
    cfg = ModelConfig.preset("tiny-moe")
    model = build_model(cfg, seed=0).eval()
    ids, pos, mask = _batch(cfg, [5, 7])
    with torch.no_grad():
        packed = model(ids, pos, attention_mask=mask)[0]
        alone_mask = packed_causal_mask(torch.tensor([0, 7]))
        alone = model(ids[:, 5:], pos[:, 5:], attention_mask=alone_mask)
    torch.testing.assert_close(packed[5:], alone[0], atol=1e-5, rtol=0)


def test_critic_outputs_one_value_per_token(dist_env):
    cfg = ModelConfig.preset("tiny-dense")  # tied: the critic must not tie its value layer
    critic = build_model(cfg, critic=True, seed=0)
    assert isinstance(critic.output_layer, ValueOutputLayer)
    ids, pos, mask = _batch(cfg, [4, 3])
    values = critic(ids, pos, attention_mask=mask)
    assert values.shape == (1, 7, 1)
    assert torch.count_nonzero(values) == 0  # zero-initialised value layer
    values.sum().backward()
    assert critic.output_layer.weight.grad.abs().sum() > 0


def _experts(model):
    from megatron.core.transformer.moe.experts import SequentialMLP

    return [m for m in model.modules() if isinstance(m, SequentialMLP)]


def _forward_backward(model, ids, pos, mask):
    model.zero_grad()
    logits = model(ids, pos, attention_mask=mask)
    (logits.float().logsumexp(-1) * torch.linspace(0.5, 1.5, logits.shape[1])).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("moe_ffn_hidden_size", [32, 6], ids=["grouped", "unaligned-loop"])
def test_grouped_experts_compute_what_megatron_cores_loop_computes(
    dist_env, monkeypatch, moe_ffn_hidden_size
):
    from megatron.core.transformer.moe.experts import SequentialMLP

    cfg = ModelConfig.preset("tiny-moe").replace(moe_ffn_hidden_size=moe_ffn_hidden_size)
    model = build_model(cfg, seed=0)
    experts = _experts(model)
    assert experts and all(type(e) is not SequentialMLP for e in experts)
    ids, pos, mask = _batch(cfg, [5, 7, 9])
    # Each expert keeps its own parameters under megatron-core's names.
    names = [n for n, _ in model.named_parameters()]
    assert "decoder.layers.0.mlp.experts.local_experts.7.linear_fc2.weight" in names
    grouped = [e._grouped(torch.zeros(1, cfg.hidden_size)) for e in experts]
    assert all(grouped) == (moe_ffn_hidden_size == 32)
    logits, grads = _forward_backward(model, ids, pos, mask)
    loop_forward = SequentialMLP.forward
    calls = []

    def loop(self, *args):
        calls.append(self)
        return loop_forward(self, *args)

    monkeypatch.setattr(type(experts[0]), "forward", loop)
    loop_logits, loop_grads = _forward_backward(model, ids, pos, mask)
    assert len(calls) == len(experts)
    torch.testing.assert_close(logits, loop_logits, atol=1e-6, rtol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, loop_grads[name], atol=1e-6, rtol=1e-5, msg=name)
    assert grads["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"].abs().sum() > 0


def test_padded_layout_matches_the_packed_stream_and_maps_router_rows(dist_env):
    from ember_core.types import Sample, pack_samples
    from ember_megatron_backend.forward import model_inputs, router_rows, run_model

    cfg = ModelConfig.preset("tiny-moe")
    model = build_model(cfg, seed=0).eval()
    g = torch.Generator().manual_seed(3)
    lengths = [5, 9, 2, 7]
    samples = [
        Sample(
            tokens=torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist(), response_length=1
        )
        for n in lengths
    ]
    batch = pack_samples(samples)
    inputs = model_inputs(batch)
    assert inputs["input_ids"].shape == (4, 9)  # [B, longest]
    rows_seen = []
    router = next(m for m in model.modules() if type(m).__name__ == "TopKRouter")
    handle = router.register_forward_pre_hook(lambda m, args: rows_seen.append(args[0]))
    with torch.no_grad():
        padded = run_model(model, batch, window=None)  # [T, V] in stream order
        ids, pos, mask = _batch(cfg, lengths)
        ids = batch.tokens[None]
        stream = model(ids, pos, attention_mask=mask)[0]
    handle.remove()
    assert padded.shape == (sum(lengths), cfg.vocab_size)
    torch.testing.assert_close(padded, stream, atol=1e-5, rtol=0)
    # Router rows: [S * B] in megatron-core's [s, b] order, padding -1.
    index = router_rows(batch)
    assert index.shape == (9 * 4,) and rows_seen[0].numel() // cfg.hidden_size == 9 * 4
    assert index[:4].tolist() == [0, 5, 14, 16]  # position 0 of each sample
    assert sorted(index[index >= 0].tolist()) == list(range(sum(lengths)))
    assert index[2 * 4 + 2] == -1  # sample 2 has 2 tokens: position 2 is padding


@pytest.mark.parametrize("layout", [None, (6, 12)])
@pytest.mark.parametrize("critic", [False, True])
def test_the_output_layer_runs_at_the_response_windows_alone(dist_env, layout, critic):
    """run_model's rows are the response windows': the output layer sees those positions only,
    and rows, heads and gradients equal the full forward's at them."""
    from ember_core.heads import PolicyHead, ValueHead
    from ember_core.types import Sample, pack_samples
    from ember_megatron_backend.forward import response_window, run_model

    cfg = ModelConfig.preset("tiny-moe")
    model = build_model(cfg, seed=0, critic=critic)
    g = torch.Generator().manual_seed(5)
    if critic:  # a fresh critic's value layer is zero
        model.output_layer.weight.data.normal_(generator=g)
    shapes = [(9, 3), (4, 1), (11, 6), (6, 2)]  # (total, response)
    samples = [
        Sample(
            tokens=torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist(), response_length=r
        )
        for n, r in shapes
    ]
    batch = pack_samples(samples)
    window = response_window(batch)
    assert window.batch.total_lengths == [4, 2, 7, 3]
    # Samples start at 0, 9, 13, 24; each window is its last R + 1 positions.
    assert window.positions.tolist() == [5, 6, 7, 8, 11, 12, *range(17, 24), 27, 28, 29]
    seen = []
    handle = model.output_layer.register_forward_hook(lambda m, args, out: seen.append(args[0]))

    def read(rows, packed):
        if critic:
            return ValueHead().values(rows, packed.total_lengths, packed.response_lengths)
        head = PolicyHead(0.7).log_probs(
            rows,
            packed.tokens[: packed.num_tokens],
            packed.total_lengths,
            packed.response_lengths,
            with_entropy=True,
        )
        return [lp + e for lp, e in zip(head.log_probs, head.entropy, strict=True)]

    def grads(window):
        model.zero_grad()
        rows = run_model(model, batch, layout, window=response_window(batch) if window else None)
        out = read(rows, response_window(batch).batch if window else batch)
        torch.cat(out).pow(2).sum().backward()
        return (
            rows,
            out,
            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        )

    rows, out, grad = grads(True)
    full_rows, full_out, full_grad = grads(False)
    handle.remove()
    assert seen[0].shape[:2] == (16, 1)  # the 16 window positions, as [N, 1, h]
    assert seen[1].shape[0] * seen[1].shape[1] == (layout or (4, 11))[0] * (layout or (4, 11))[1]
    torch.testing.assert_close(rows, full_rows[window.positions], atol=1e-6, rtol=0)
    for a, b in zip(out, full_out, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert grad.keys() == full_grad.keys() and "output_layer.weight" in grad
    for name, g_full in full_grad.items():
        torch.testing.assert_close(grad[name], g_full, atol=1e-6, rtol=1e-5, msg=name)
