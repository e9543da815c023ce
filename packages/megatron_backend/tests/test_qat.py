"""train.qat: the actor's and reference's forwards multiply with the weights the engine serves,
checked against a plain model loaded with the engine's dequantized weights."""

from __future__ import annotations

import types

import pytest
import torch
from megatron_samples import algorithm, backend, make_samples, sampling

from ember_core import quant
from ember_core.quant import QuantSpec
from ember_megatron_backend import qat
from ember_megatron_backend.hf_layout import hf_rule
from ember_megatron_backend.model import (
    ModelConfig,
    _grouped_local_experts,
    build_model,
    packed_causal_mask,
)
from ember_megatron_backend.qat import fake_quantize_model, served_weight
from ember_megatron_backend.weights import iter_hf_weights, named_tensors
from ember_megatron_backend.worker import MegatronWorker

GROUP = 32  # tiny presets: hidden 64, k/v 32 rows, expert width 32

CASES = {
    # (scheme, targets, INT4 scale dtype, experts through megatron-core's loop)
    "fp8-linear": ("fp8_block", "linear", torch.float32, False),
    "fp8-experts": ("fp8_block", "experts", torch.float32, False),
    "int4-linear": ("int4_w4a16", "linear", torch.bfloat16, False),
    "int4-experts": ("int4_w4a16", "experts", torch.float32, False),
    "fp8-experts-loop": ("fp8_block", "experts", torch.float32, True),
}


def _config(preset: str = "tiny-moe") -> ModelConfig:
    # A wide init: quantization moves the logits far more than float noise.
    return ModelConfig.preset(preset).replace(init_method_std=0.15)


def _target_modules(model, targets: str) -> dict[str, object]:
    """The linear layers the engine quantizes, found by where they sit (not by name mapping):
    every decoder layer's linear layers, or the routed experts' only."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, ColumnParallelLinear | RowParallelLinear)
        and name.startswith("decoder.layers.")
        and (targets == "linear" or ".local_experts." in name)
    }


def _quantize_inputs(model, targets: str, group_size: int) -> None:
    """The engine's W8A8 activations alone on a plain model: each target layer's input quantized
    per token (straight through), its weight untouched."""

    def fq(x):
        return quant.straight_through(x, quant.fake_quantize_activation(x.detach(), group_size))

    def forward_impl(self, input, weight, bias=None, **kwargs):
        return type(self)._forward_impl(self, input=fq(input), weight=weight, bias=bias, **kwargs)

    def grouped_operands(self, linear, x):
        x, w = type(self).grouped_operands(self, linear, x)
        return fq(x), w

    for m in _target_modules(model, targets).values():
        m._forward_impl = types.MethodType(forward_impl, m)
    for m in model.modules():
        if isinstance(m, _grouped_local_experts()):
            m.grouped_operands = types.MethodType(grouped_operands, m)


def _served_model(master, cfg: ModelConfig, spec: QuantSpec, scale_dtype: torch.dtype):
    """A plain model holding `master`'s quantized weights as the engine serves them: the
    transformers export, quantized (`quantize_named`, as a weight push sends it; INT4 scales in
    `scale_dtype`), dequantized, loaded; the other tensors as `master` holds them."""
    served = dict(iter_hf_weights(master, cfg))
    sent = dict(quant.quantize_named(served.items(), spec, dtype=scale_dtype))
    for name in served:
        if quant.is_target(name, spec.targets):
            stem = name.removesuffix("weight")
            tensors = {n.removeprefix(stem): sent[n] for n in quant.quantized_names(name, spec)}
            served[name] = quant.dequantize(tensors, torch.float32)
    plain = build_model(cfg, seed=1)
    with torch.no_grad():
        for name, param in named_tensors(plain):
            rule = hf_rule(name, cfg)
            param.copy_(rule.merge(*(served[n] for n in rule.hf_names)))
    return plain


def _tokens(cfg: ModelConfig):
    """Two packed sequences: ids and positions [1, T], the block-causal mask."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, cfg.vocab_size, (1, 21), generator=g)
    pos = torch.cat([torch.arange(12), torch.arange(9)])[None]
    return ids, pos, packed_causal_mask(torch.tensor([0, 12, 21]))


@pytest.mark.parametrize("case", CASES)
def test_qat_forward_and_gradients_are_the_served_models(dist_env, case, monkeypatch):
    scheme, targets, scale_dtype, loop = CASES[case]
    if loop:  # the experts through SequentialMLP's modules, each linear's `_forward_impl`
        monkeypatch.setattr(_grouped_local_experts(), "_grouped", lambda self, x: False)
    cfg = _config()
    spec = QuantSpec(scheme, GROUP, targets)
    model = build_model(cfg, seed=0)
    master = {n: t.detach().clone() for n, t in named_tensors(model)}
    plain = _served_model(model, cfg, spec, scale_dtype)
    if spec.quantizes_activations:
        _quantize_inputs(plain, targets, GROUP)
    unquantized = build_model(cfg, seed=0)

    changed = fake_quantize_model(model, cfg, spec, scale_dtype)
    # 4 layers: QKV and output projection, 8 experts' fc1 and fc2.
    assert changed == 4 * (8 * 2 + (2 if targets == "linear" else 0))
    assert set(_target_modules(model, targets)) == {
        name for name, m in model.named_modules() if served_weight(m) is not None
    }

    ids, pos, mask = _tokens(cfg)
    logits = model(ids, pos, attention_mask=mask)
    want = plain(ids, pos, attention_mask=mask)
    # The same products of the same numbers in the same order: bit for bit.
    assert torch.equal(logits, want)
    with torch.no_grad():
        assert not torch.equal(logits, unquantized(ids, pos, attention_mask=mask))

    # Straight through: the master weights' gradients are the served weights'.
    target = ids[0].roll(-1)
    for out in (logits, want):
        torch.nn.functional.cross_entropy(out[0].float(), target).backward()
    grads = {n: p.grad for n, p in plain.named_parameters()}
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.equal(param.grad, grads[name]), name
        assert torch.equal(param.detach(), master[name]), name  # the master stays full-precision
    moved: dict[str, float] = {}  # an expert a short batch routes no token to gets none
    for name in _target_modules(model, targets):
        where = name.split(".local_experts.")[0]
        grad = model.get_parameter(f"{name}.weight").grad
        moved[where] = moved.get(where, 0.0) + float(grad.abs().sum())
    assert len(moved) == 4 * (3 if targets == "linear" else 1) and all(moved.values()), moved


def test_refusals_name_the_key_and_leave_the_model_unchanged(dist_env, monkeypatch):
    cfg = _config()
    model = build_model(cfg, seed=0)
    with pytest.raises(
        ValueError, match=r"model\.layers\.0\.self_attn\.o_proj\.weight: fp8_block group size 48"
    ):
        fake_quantize_model(model, cfg, QuantSpec("fp8_block", 48, "linear"), torch.float32)
    with pytest.raises(
        ValueError, match=r"experts\.0\.down_proj\.weight: int4_w4a16 group size 64"
    ):
        fake_quantize_model(model, cfg, QuantSpec("int4_w4a16", 64, "experts"), torch.float32)
    dense = _config("tiny-dense")
    with pytest.raises(ValueError, match="train.qat: no layer.*quantization_targets=experts"):
        fake_quantize_model(
            build_model(dense, seed=0), dense, QuantSpec("fp8_block", 32, "experts"), torch.float32
        )
    # A tensor-parallel split as megatron-core reports its group (one process here).
    monkeypatch.setattr(qat, "_group", lambda expert: (0, 2, None))
    with pytest.raises(ValueError, match=r"split over 2 tensor-parallel.*tensor_parallel=1"):
        fake_quantize_model(model, cfg, QuantSpec("fp8_block", 32, "linear"), torch.float32)
    with pytest.raises(
        ValueError, match=r"experts.*expert-tensor-parallel.*expert_tensor_parallel"
    ):
        fake_quantize_model(model, cfg, QuantSpec("fp8_block", 32, "experts"), torch.float32)
    assert not any(served_weight(m) for m in model.modules())
    assert type(model.decoder.layers[0].mlp.experts) is _grouped_local_experts()


def test_worker_refuses_qat_without_quantization(dist_env):
    with pytest.raises(ValueError, match="train.qat=true needs engine.quantization"):
        MegatronWorker(backend(qat=True), algorithm(), sampling())


def test_worker_trains_with_qat_reference_quantized_critic_not(dist_env):
    spec = QuantSpec("fp8_block", GROUP)
    alg = algorithm(advantage_estimator="ppo", use_kl_loss=True, kl_loss_coef=0.1)
    worker = MegatronWorker(backend(qat=True), alg, sampling(), quantization=spec)
    # `quantization` alone (train.qat false) leaves the trainer as it is.
    plain = MegatronWorker(backend(), alg, sampling(), quantization=spec)
    assert not any(served_weight(m) for m in plain.actor.modules())
    for model in (worker.actor, worker.ref):
        assert sum(served_weight(m) is not None for m in model.modules()) == 4 * (2 + 16)
    assert not any(served_weight(m) for m in worker.critic.modules())

    samples = make_samples()
    batch = worker.prepare(0, samples)
    # The reference is the initial actor, fake-quantized alike.
    for a, b in zip(batch.log_probs, batch.ref_log_probs, strict=True):
        assert torch.equal(a, b)
    unquantized = plain.prepare(0, samples)
    assert not torch.equal(torch.cat(batch.log_probs), torch.cat(unquantized.log_probs))
    assert torch.equal(torch.cat(batch.values), torch.cat(unquantized.values))

    before = worker.actor.module.decoder.layers[0].self_attention.linear_qkv.weight.clone()
    steps = worker.train(0, batch)
    assert steps[0]["train/kl_loss"] == 0.0 and steps[1]["train/kl_loss"] > 0
    assert all(torch.isfinite(torch.tensor(s["train/grad_norm"])) for s in steps)
    after = worker.actor.module.decoder.layers[0].self_attention.linear_qkv.weight
    assert not torch.equal(before, after)
