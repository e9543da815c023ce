"""The embedded engine serving quantized weights (`engine.quantization`, ember_rollout.quantized).

The engine's numbers are checked against a model computed here from the quantized tensors
(`ember_core.quant`), with the W8A8 input quantization applied where SGLang's kernel applies it,
and its weight updates against the names and dtypes a quantized push carries.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ember_core import quant
from ember_core.quant import QuantSpec
from ember_rollout.config import HFEngineConfig
from ember_rollout.engine import GenerateRequest, SamplingParams
from ember_rollout.families import FAMILIES, build_family_model
from ember_rollout.hf_engine import HFEngine
from ember_rollout.models import _checkpoint_name, naming_of
from ember_rollout.quantized import QuantExperts, QuantLinear, quantize_model

SPECS = [
    QuantSpec("fp8_block", 32),
    QuantSpec("int4_w4a16", 32),
    QuantSpec("fp8_block", 32, "experts"),
    QuantSpec("int4_w4a16", 32, "experts"),
]
IDS = [f"{s.scheme}-{s.targets}" for s in SPECS]


def _served(w: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    return quant.dequantize(quant.quantize(w, spec), w.dtype)


def reference_forward(model: nn.Module, spec: QuantSpec, ids: torch.Tensor) -> torch.Tensor:
    """Logits of `model` (full precision, untouched) computed as the quantized model should:
    every target weight dequantized from its quantized tensors, and under fp8_block every
    target product's input quantized per token group; written from the formats, not from
    `ember_rollout.quantized`."""
    naming = naming_of(model)
    act = spec.quantizes_activations
    saved, hooks = [], []

    def quantize_input(module, args):
        return (quant.fake_quantize_activation(args[0], spec.group_size),)

    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and quant.is_target(
                _checkpoint_name(f"{name}.weight", naming), spec.targets
            ):
                saved.append((module.weight, module.weight.clone()))
                module.weight.copy_(_served(module.weight, spec))
                if act:
                    hooks.append(module.register_forward_pre_hook(quantize_input))
            elif hasattr(module, "gate_up_proj") and spec.targets in ("linear", "experts"):
                hooks.append(_experts_hook(module, spec))
        try:
            return model(ids).logits
        finally:
            for hook in hooks:
                hook.remove()
            for param, value in saved:
                param.copy_(value)


def _experts_hook(experts: nn.Module, spec: QuantSpec):
    gate_up, down = experts.gate_up_proj, experts.down_proj  # [E, 2I, H], [E, H, I]
    g = spec.group_size

    def a(x):
        return quant.fake_quantize_activation(x, g) if spec.quantizes_activations else x

    def forward(module, args, output):
        hidden, index, weights = args
        out = torch.zeros_like(hidden)
        for e in range(gate_up.shape[0]):
            token, slot = torch.where(index == e)
            if token.numel() == 0:
                continue
            gate, up = (_served(t, spec) for t in gate_up[e].chunk(2, dim=0))
            x = a(hidden[token])
            h = module.act_fn(F.linear(x, gate)) * F.linear(x, up)
            y = F.linear(a(h), _served(down[e], spec)) * weights[token, slot, None]
            out.index_add_(0, token, y)
        return out

    return experts.register_forward_hook(forward)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_engine_computes_the_quantized_model(model_type, spec):
    model = build_family_model(model_type, seed=3)
    naming = naming_of(model)
    misfit = [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear)
        and quant.is_target(_checkpoint_name(f"{name}.weight", naming), spec.targets)
        and (
            m.weight.shape[1] % spec.group_size
            or spec.scheme == "fp8_block"
            and m.weight.shape[0] % spec.group_size
        )
    ]
    if misfit:  # e.g. DeepSeek's MLA ranks, Qwen2-MoE's 48-wide shared expert
        with pytest.raises(ValueError, match=rf"{misfit[0]}.weight: .* does not divide"):
            quantize_model(model, spec)
        return
    ids = torch.randint(1, 17, (2, 9), generator=torch.Generator().manual_seed(0))
    expected = reference_forward(model, spec, ids)
    full = model(ids).logits
    count = quantize_model(model, spec)
    assert count > 0
    assert any(isinstance(m, QuantExperts) for m in model.modules())
    if spec.targets == "experts":
        assert not any(
            isinstance(m, QuantLinear) and ".experts." not in n for n, m in model.named_modules()
        )
    with torch.no_grad():
        got = model(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert (got - full).abs().max() > 1e-4  # quantization shows in the logits


def _engine(spec: QuantSpec, dtype: str = "float32") -> HFEngine:
    engine = HFEngine(HFEngineConfig(dtype=dtype, max_batch_size=8), quantization=spec)
    engine.load()
    return engine


def _source_weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    """The full-precision checkpoint tensors of another tiny engine model (seed `seed`)."""
    from ember_rollout.config import TinyModelConfig

    other = HFEngine(HFEngineConfig(dtype="float32", tiny=TinyModelConfig(init_seed=seed)))
    other.load()
    from ember_rollout.models import check_update_names

    state = dict(other.model.state_dict())
    named = []
    for name, tensor in state.items():
        if name.endswith("gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            for e, fused in enumerate(tensor):
                gate, up = fused.chunk(2, dim=0)
                named += [
                    (f"{prefix}{e}.gate_proj.weight", gate),
                    (f"{prefix}{e}.up_proj.weight", up),
                ]
        elif name.endswith("down_proj") and tensor.dim() == 3:
            prefix = name.removesuffix("down_proj")
            named += [(f"{prefix}{e}.down_proj.weight", t) for e, t in enumerate(tensor)]
        else:
            named.append((name, tensor))
    check_update_names(other.model, [n for n, _ in named])
    return named


@pytest.mark.parametrize("scheme", quant.SCHEMES)
def test_a_quantized_push_loads_by_checkpoint_name(scheme):
    spec = QuantSpec(scheme, 32)
    engine = _engine(spec, dtype="bfloat16")
    named = _source_weights(seed=5)
    pushed = list(quant.quantize_named(named, spec, dtype=torch.bfloat16))
    layer = engine.model.get_submodule("model.layers.1.self_attn.o_proj")
    before = layer.served().clone()
    asyncio.run(engine.update_weights_from_tensors(pushed, weight_version="7"))
    assert engine.weight_version == "7"
    source = dict(named)["model.layers.1.self_attn.o_proj.weight"]
    expected = quant.dequantize(quant.quantize(source, spec, dtype=torch.bfloat16), torch.bfloat16)
    assert torch.equal(layer.served(), expected) and not torch.equal(before, expected)
    expert = engine.model.get_submodule("model.layers.0.mlp.experts.3.down_proj")
    source = dict(named)["model.layers.0.mlp.experts.3.down_proj.weight"]
    assert torch.equal(expert.served(), _served_bf16(source, spec))
    # Sent full-precision tensors smaller than the model's would be; they arrive quantized.
    sent = sum(t.numel() * t.element_size() for _, t in pushed)
    full = sum(t.numel() * 2 for _, t in named)
    assert sent < 0.75 * full
    out = engine.generate_sync(
        [GenerateRequest(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=4))]
    )
    assert len(out[0].output_ids) > 0


def _served_bf16(w, spec):
    return quant.dequantize(quant.quantize(w, spec, dtype=torch.bfloat16), torch.bfloat16)


@pytest.mark.parametrize("scheme", quant.SCHEMES)
def test_a_full_precision_push_is_refused_before_anything_is_copied(scheme):
    engine = _engine(QuantSpec(scheme, 32))
    state = {n: t.clone() for n, t in engine.model.state_dict().items()}
    named = _source_weights(seed=5)
    with pytest.raises(
        ValueError, match=r"arrives unquantized \(torch.float32\): the engine serves"
    ) as info:
        asyncio.run(engine.update_weights_from_tensors(named, weight_version="1"))
    assert "\n" not in str(info.value)
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, state[name]), name


def test_bad_quantized_tensors_are_refused():
    spec = QuantSpec("int4_w4a16", 32)
    engine = _engine(spec)
    name = "model.layers.0.self_attn.o_proj."
    good = quant.quantize(torch.randn(64, 64), spec, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"o_proj.weight_scale'.*dtype torch.bfloat16"):
        asyncio.run(
            engine.update_weights_from_tensors(
                [(name + "weight_scale", good["weight_scale"].bfloat16())], partial=True
            )
        )
    with pytest.raises(ValueError, match=r"weight_shape'.*\[64, 32\] is not the engine's"):
        asyncio.run(
            engine.update_weights_from_tensors(
                [(name + "weight_shape", torch.tensor([64, 32]))], partial=True
            )
        )
    with pytest.raises(ValueError, match="weight_packed'.*shape"):
        asyncio.run(
            engine.update_weights_from_tensors(
                [(name + "weight_packed", good["weight_packed"][:, :4])], partial=True
            )
        )


def test_the_served_weight_follows_every_load():
    spec = QuantSpec("fp8_block", 32)
    layer = QuantLinear(spec, torch.randn(64, 64))
    first = layer.served()
    assert layer.served() is first  # dequantized once per load
    new = quant.quantize(torch.randn(64, 64), spec)
    with torch.no_grad():
        layer.weight.copy_(new["weight"])
        layer.weight_scale_inv.copy_(new["weight_scale_inv"])
    assert torch.equal(layer.served(), quant.dequantize(new, torch.float32))
    x = torch.randn(3, 64)
    expected = F.linear(quant.fake_quantize_activation(x, 32), quant.dequantize(new, torch.float32))
    assert torch.equal(layer(x), expected)


def test_nothing_to_quantize_is_one_line():
    model = build_family_model("qwen3_moe")
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=17,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    with pytest.raises(ValueError, match="has no weight to quantize; it has no routed experts"):
        quantize_model(llama, QuantSpec("fp8_block", 32, "experts"))
    with pytest.raises(ValueError, match="k_proj.weight: fp8_block group size 64 does not divide"):
        quantize_model(model, QuantSpec("fp8_block", 64))


def test_the_served_weight_is_one_tensor_written_in_place_even_in_inference_mode():
    """The engine decodes in inference mode; its served weights must stay ordinary tensors
    written in place, whose version counters tell `exact.packed_weight` to pack again (an
    inference tensor would be packed at every product, a new tensor per load would leave the
    old packings behind)."""
    spec = QuantSpec("fp8_block", 32)
    layer = QuantLinear(spec, torch.randn(64, 64))
    with torch.inference_mode():
        served = layer.served()
    assert not served.is_inference()
    version = served._version
    new = quant.quantize(torch.randn(64, 64), spec)
    with torch.no_grad():
        layer.weight.copy_(new["weight"])
        layer.weight_scale_inv.copy_(new["weight_scale_inv"])
    with torch.inference_mode():
        again = layer.served()
    assert again is served and served._version > version
    assert torch.equal(served, quant.dequantize(new, torch.float32))
