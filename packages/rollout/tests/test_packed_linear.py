"""Linear layers packed once for oneDNN: the same products as `F.linear`, never stale, and only
where they apply."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, make_engine
from test_hf_engine import PROMPTS, requests
from torch import nn

from ember_rollout.models import build_tiny_model, load_hf_weights
from ember_rollout.packed_linear import PackedLinear, pack_linears, packing_available

pytestmark = pytest.mark.skipif(
    not packing_available(), reason="this torch build has no oneDNN linear packing"
)


def tiny_model(dtype=torch.float32, seed=TINY.init_seed, vocab_size=32):
    tiny = dataclasses.replace(TINY, init_seed=seed)
    return build_tiny_model(tiny, vocab_size=vocab_size, dtype=dtype).eval()


def logits(model, tokens):
    with torch.inference_mode():
        return model(input_ids=torch.tensor(tokens)).logits


def plain_linears(model):
    return [m for m in model.modules() if type(m) is nn.Linear]


def test_packed_layers_compute_what_plain_ones_do():
    plain, packed = tiny_model(), tiny_model()
    count = len(plain_linears(packed))
    assert pack_linears(packed, batch_hint=4, min_elements=0) == count > 0
    assert not plain_linears(packed)
    assert all(isinstance(m, PackedLinear) for m in packed.modules() if isinstance(m, nn.Linear))
    assert packed.state_dict().keys() == plain.state_dict().keys()
    for rows in ([PROMPTS[0]], [p[:3] for p in PROMPTS], [PROMPTS[3]] * 7):
        got, want = logits(packed, rows), logits(plain, rows)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The packed product is oneDNN's own: it ran (the packed copies exist), it is not F.linear.
    assert all(
        m._packed is not None and m._packed.is_mkldnn
        for m in packed.modules()
        if isinstance(m, PackedLinear)
    )


def test_a_weight_load_repacks_before_the_next_forward():
    """load_hf_weights writes in place; the packed copies follow, with nothing to call."""
    packed, other = tiny_model(), tiny_model(seed=11)
    pack_linears(packed, batch_hint=4, min_elements=0)
    before = logits(packed, [PROMPTS[1]])
    load_hf_weights(packed, other.state_dict().items())
    after, want = logits(packed, [PROMPTS[1]]), logits(other, [PROMPTS[1]])
    assert not torch.allclose(before, want, atol=1e-3)
    torch.testing.assert_close(after, want, rtol=1e-5, atol=1e-5)


def test_a_weight_whose_storage_is_replaced_repacks_before_the_next_forward():
    """`param.data = t` (and a new Parameter in the layer) leaves the version counter as it
    was; the packed copy must follow the new storage all the same."""
    packed, other = tiny_model(), tiny_model(seed=11)
    pack_linears(packed, batch_hint=4, min_elements=0)
    before = logits(packed, [PROMPTS[1]])
    wanted = dict(other.named_parameters())
    for name, param in packed.named_parameters():
        param.data = wanted[name].detach().clone()
    after, want = logits(packed, [PROMPTS[1]]), logits(other, [PROMPTS[1]])
    assert not torch.allclose(before, want, atol=1e-3)
    torch.testing.assert_close(after, want, rtol=1e-5, atol=1e-5)
    # A new Parameter of the same version counter (0) in the layer: followed too.
    layer = next(m for m in packed.modules() if isinstance(m, PackedLinear))
    x = torch.randn(3, layer.in_features)
    for _ in range(2):  # the second replacement may reuse the first one's freed memory
        new = torch.randn_like(layer.weight)
        layer.weight = nn.Parameter(new, requires_grad=False)
        with torch.inference_mode():
            torch.testing.assert_close(layer(x), F.linear(x, new, layer.bias))


def test_training_and_other_dtypes_run_unpacked():
    bf16 = tiny_model(torch.bfloat16)
    assert pack_linears(bf16, batch_hint=4, min_elements=0) == 0
    assert plain_linears(bf16)

    # Autograd recording a weight's gradient gets F.linear's product and its gradient.
    plain, packed = tiny_model(), tiny_model()
    pack_linears(packed, batch_hint=4, min_elements=0)
    grads = []
    for model in (plain, packed):
        model(input_ids=torch.tensor([PROMPTS[0]])).logits.square().sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, msg=name)


def test_small_weights_stay_with_f_linear():
    model = tiny_model()
    sizes = sorted({m.weight.numel() for m in plain_linears(model)})
    assert pack_linears(model, batch_hint=4, min_elements=sizes[-1]) == sum(
        m.weight.numel() == sizes[-1] for m in model.modules() if isinstance(m, nn.Linear)
    )
    assert all(m.weight.numel() < sizes[-1] for m in plain_linears(model))
    # The tiny model's layers are all below the default: packing them would only cost.
    assert pack_linears(tiny_model(), batch_hint=4) == 0


def test_engine_samples_the_same_with_and_without_packing(monkeypatch):
    monkeypatch.setattr("ember_rollout.packed_linear.PACK_MIN_ELEMENTS", 0)
    packed, plain = make_engine(), make_engine(pack_linears=False)
    assert any(isinstance(m, PackedLinear) for m in packed.model.modules())
    assert not any(isinstance(m, PackedLinear) for m in plain.model.modules())
    kw = dict(temperature=0.9, max_new_tokens=10)

    def same_samples():
        for got, want in zip(
            packed.generate_sync(requests(**kw)), plain.generate_sync(requests(**kw)), strict=True
        ):
            assert got.output_ids == want.output_ids
            assert got.output_log_probs == pytest.approx(want.output_log_probs, abs=1e-5)

    same_samples()
    before = packed.generate_sync(requests(**kw))
    # A weight update through the engine's own path: the packed engine serves the new weights.
    vocab = packed.model_info.vocab_size
    named = list(tiny_model(seed=11, vocab_size=vocab).state_dict().items())
    for engine in (packed, plain):
        asyncio.run(engine.update_weights_from_tensors(iter(named), weight_version="v1"))
    same_samples()
    after = packed.generate_sync(requests(**kw))
    assert [o.output_log_probs for o in after] != [o.output_log_probs for o in before]
