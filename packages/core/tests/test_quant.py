"""ember_core.quant: the FP8 block and INT4 group formats, and fake quantization."""

from __future__ import annotations

import pytest
import torch

from ember_core import quant
from ember_core.quant import QuantSpec


@pytest.fixture
def weight() -> torch.Tensor:
    torch.manual_seed(0)
    w = torch.randn(64, 96) * 0.02
    w[3, 70] = 0.5  # an outlier: its block's (group's) scale is set by it
    return w


def test_fp8_block_layout_and_scales(weight):
    tensors = quant.quantize(weight, QuantSpec("fp8_block", 32))
    q, scale = tensors["weight"], tensors["weight_scale_inv"]
    assert q.dtype == torch.float8_e4m3fn and q.shape == weight.shape
    assert scale.dtype == torch.float32 and scale.shape == (2, 3)
    blocks = weight.reshape(2, 32, 3, 32).abs().amax(dim=(1, 3))
    torch.testing.assert_close(scale, blocks / 448.0, rtol=0, atol=0)
    # The largest entry of each block maps to +-448 exactly.
    assert q.float().abs().amax() == 448.0
    served = quant.dequantize(tensors, torch.float32)
    # e4m3 keeps 3 mantissa bits: every entry within half a step (2^-4 relative) of its block.
    step = (scale.repeat_interleave(32, 0).repeat_interleave(32, 1) * 448.0) / 16
    assert ((served - weight).abs() <= step).all()
    assert served[3, 70] == pytest.approx(0.5, rel=1e-7)


def test_int4_groups_values_and_packing(weight):
    tensors = quant.quantize(weight, QuantSpec("int4_w4a16", 32), dtype=torch.bfloat16)
    packed, scale, shape = (tensors[k] for k in ("weight_packed", "weight_scale", "weight_shape"))
    assert packed.dtype == torch.int32 and packed.shape == (64, 12)
    assert scale.dtype == torch.bfloat16 and scale.shape == (64, 3)
    assert shape.tolist() == [64, 96]
    values = quant.unpack_int4(packed, 96)
    assert values.min() >= -8 and values.max() <= 7
    expected = torch.round(weight.reshape(64, 3, 32) / scale.float()[..., None]).clamp(-8, 7)
    assert torch.equal(values.float(), expected.reshape(64, 96))
    assert values[3, 70] == 7  # the group's largest magnitude
    served = quant.dequantize(tensors, torch.float32)
    assert torch.equal(served, (expected * scale.float()[..., None]).reshape(64, 96))


def test_int4_pack_order_is_compressed_tensors():
    # Column 8c + i sits in bits 4i..4i+3 of word c, offset by 8.
    values = torch.tensor([[-8, -7, 0, 1, 2, 3, 6, 7, 7, 7, 7, 7, 7, 7, 7, -1]], dtype=torch.int8)
    packed = quant.pack_int4(values)
    nibbles = [v + 8 for v in values[0].tolist()]
    words = [sum(n << (4 * i) for i, n in enumerate(nibbles[c * 8 : c * 8 + 8])) for c in (0, 1)]
    signed = [w - (1 << 32) if w >= 1 << 31 else w for w in words]
    assert packed.tolist() == [signed]
    assert torch.equal(quant.unpack_int4(packed, 16), values)


def test_activation_quantization_per_token_group():
    torch.manual_seed(1)
    x = torch.randn(2, 5, 64)
    x[0, 0, 40] = 30.0
    y = quant.fake_quantize_activation(x, 32)
    assert y.shape == x.shape and y.dtype == x.dtype
    # The outlier changes only its own group's scale: the token's other group is untouched by it.
    alone = quant.fake_quantize_activation(x[0, 0, :32].reshape(1, 32), 32)
    assert torch.equal(y[0, 0, :32], alone[0])
    assert y[0, 0, 40] == 30.0
    assert not torch.equal(y, x) and (y - x).abs().max() < 2.0
    assert torch.equal(quant.fake_quantize_activation(torch.zeros(3, 32), 32), torch.zeros(3, 32))


@pytest.mark.parametrize("scheme", quant.SCHEMES)
def test_fake_quantize_serves_the_dequantized_weight_with_straight_through_gradients(
    weight, scheme
):
    spec = QuantSpec(scheme, 32)
    w = weight.clone().requires_grad_()
    served = quant.fake_quantize(w, spec)
    assert torch.equal(served, quant.dequantize(quant.quantize(weight, spec), torch.float32))
    (served * torch.arange(96.0)).sum().backward()
    assert torch.equal(w.grad, torch.arange(96.0).expand(64, 96))


def test_targets():
    assert quant.is_target("model.layers.0.self_attn.q_proj.weight", "linear")
    assert quant.is_target("model.layers.3.mlp.experts.7.down_proj.weight", "experts")
    assert quant.is_target("model.layers.3.block_sparse_moe.experts.1.w3.weight", "experts")
    assert not quant.is_target("model.layers.0.self_attn.q_proj.weight", "experts")
    assert not quant.is_target("model.layers.1.mlp.shared_experts.up_proj.weight", "experts")
    for name in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.layers.0.mlp.gate.weight",  # a router
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_proj.bias",
    ):
        assert not quant.is_target(name, "linear"), name


def test_bad_input_is_one_line():
    with pytest.raises(ValueError, match="not one of fp8_block, int4_w4a16"):
        QuantSpec("fp4")
    with pytest.raises(ValueError, match="multiple of 8"):
        QuantSpec("int4_w4a16", 12)
    with pytest.raises(ValueError, match=r"q_proj.weight: fp8_block group size 128 does not "):
        quant.check_shape(
            "model.layers.0.self_attn.q_proj.weight", (576, 576), QuantSpec("fp8_block")
        )
    # INT4 groups run along the input only: 192 outputs are fine, 576 inputs are not.
    quant.check_shape("x.weight", (192, 512), QuantSpec("int4_w4a16"))
    with pytest.raises(ValueError, match=r"input size 576 .*a divisor such as 64$"):
        quant.check_shape("x.weight", (192, 576), QuantSpec("int4_w4a16"))


def test_quantize_named_shrinks_the_push(weight):
    named = [
        ("model.embed_tokens.weight", torch.randn(32, 96)),
        ("model.layers.0.self_attn.o_proj.weight", weight),
        ("model.layers.0.mlp.gate.weight", torch.randn(4, 96)),
    ]
    full = sum(t.numel() * 2 for _, t in named)  # in bfloat16
    for scheme, names in (
        ("fp8_block", ["weight", "weight_scale_inv"]),
        ("int4_w4a16", ["weight_packed", "weight_scale", "weight_shape"]),
    ):
        out = dict(quant.quantize_named(named, QuantSpec(scheme, 32), dtype=torch.bfloat16))
        stem = "model.layers.0.self_attn.o_proj."
        assert [n for n in out if n.startswith(stem)] == [stem + s for s in names]
        assert out["model.embed_tokens.weight"].dtype == torch.bfloat16
        assert out["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16
        sent = sum(t.numel() * t.element_size() for t in out.values())
        # The 64 x 96 weight: FP8 bytes plus a 2 x 3 fp32 scale grid, or INT4 nibbles plus a
        # bf16 scale per 32 inputs of a row and the int64 shape.
        held = 64 * 96 + 2 * 3 * 4 if scheme == "fp8_block" else 64 * 96 // 2 + 64 * 3 * 2 + 16
        assert sent == full - 64 * 96 * 2 + held


def test_certify_bars_by_scheme():
    from ember_core.certify import (
        EXACT_BARS,
        FP8_BARS,
        FP8_QAT_BARS,
        FP32_BARS,
        INT4_BARS,
        LOW_PRECISION_BARS,
        mismatch_ceiling,
    )

    def bars(**kw):
        return mismatch_ceiling("float32", "float32", **kw)

    assert bars(quantization="fp8_block") is FP8_BARS
    qat = bars(quantization="fp8_block", qat=True)
    assert qat is FP8_QAT_BARS and qat.mean == FP8_BARS.mean  # activations still round
    # FP8 without QAT measured a KL mean of 2.8e-2 and 2.3e-2 on SmolLM2: over the QAT bars.
    assert qat.kl_mean < 2.3e-2 < FP8_BARS.kl_mean
    assert bars(quantization="int4_w4a16") is INT4_BARS
    assert bars(quantization="int4_w4a16", qat=True) is FP32_BARS
    assert bars(quantization="int4_w4a16", qat=True, exact=True) is EXACT_BARS
    low = mismatch_ceiling("bfloat16", "float32", quantization="int4_w4a16", qat=True)
    assert (low.mean, low.max) == (LOW_PRECISION_BARS.mean, LOW_PRECISION_BARS.max)
    assert FP8_BARS.mean < INT4_BARS.mean
