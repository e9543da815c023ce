"""forward_only over packed micro-batches for the actor, reference and critic roles."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from ember_core.types import Sample
from ember_megatron_backend.forward import forward_only, plan_micro_batches
from ember_megatron_backend.model import ModelConfig, build_model
from ember_megatron_backend.weights import export_hf_checkpoint

SHAPES = [(9, 4), (6, 1), (13, 7), (8, 5), (5, 2)]  # (total length, response length)


def _samples(cfg, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [
        Sample(
            tokens=torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist(),
            response_length=r,
            index=i,
        )
        for i, (n, r) in enumerate(SHAPES)
    ]


@pytest.fixture(scope="module")
def actor(dist_env, tmp_path_factory):
    """A tiny MoE actor with non-trivial weights and its transformers export."""
    cfg = ModelConfig.preset("tiny-moe").replace(init_method_std=0.15)
    model = build_model(cfg, seed=3)
    path = export_hf_checkpoint(model, cfg, tmp_path_factory.mktemp("actor") / "hf")
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    return cfg, model, hf


def test_plan_by_samples_and_by_tokens():
    assert plan_micro_batches([3, 3, 3, 3, 3], micro_batch_size=2) == [[0, 1], [2, 3], [4]]
    # budget 10: 4+5 fit, 9 alone, 12 exceeds the budget and goes alone, 1+2+3 fit
    assert plan_micro_batches([4, 5, 9, 12, 1, 2, 3], max_tokens_per_micro_batch=10) == [
        [0, 1],
        [2],
        [3],
        [4, 5, 6],
    ]
    with pytest.raises(ValueError, match="exactly one"):
        plan_micro_batches([1], micro_batch_size=1, max_tokens_per_micro_batch=4)
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        plan_micro_batches([1], max_tokens_per_micro_batch=0)


def test_actor_log_probs_and_entropy_match_transformers(actor):
    cfg, model, hf = actor
    samples = _samples(cfg)
    temperature = 0.6
    out = forward_only(
        model,
        samples,
        role="actor",
        temperature=temperature,
        with_entropy=True,
        max_tokens_per_micro_batch=20,
    )
    for s, lp, ent in zip(samples, out.log_probs, out.entropy, strict=True):
        ids = torch.tensor([s.tokens])
        with torch.no_grad():
            logits = hf(ids).logits[0].double() / temperature
        rows = logits[len(s.tokens) - s.response_length - 1 : -1]
        ref_lp = rows.log_softmax(-1).gather(1, ids[0, -s.response_length :, None])[:, 0]
        ref_ent = -(rows.softmax(-1) * rows.log_softmax(-1)).sum(-1)
        torch.testing.assert_close(lp.double(), ref_lp, atol=1e-4, rtol=0)
        torch.testing.assert_close(ent.double(), ref_ent, atol=1e-4, rtol=0)


def test_micro_batching_does_not_change_results(actor):
    cfg, model, _ = actor
    samples = _samples(cfg)
    whole = forward_only(model, samples, role="actor")
    for limits in ({"micro_batch_size": 1}, {"max_tokens_per_micro_batch": 15}):
        split = forward_only(model, samples, role="actor", **limits)
        for a, b in zip(whole.log_probs, split.log_probs, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_ref_with_actor_weights_gives_identical_log_probs(actor):
    cfg, model, _ = actor
    samples = _samples(cfg)
    ref = build_model(cfg, seed=99)
    ref.load_state_dict(model.state_dict())
    a = forward_only(model, samples, role="actor", temperature=0.8, micro_batch_size=2)
    b = forward_only(ref, samples, role="ref", temperature=0.8, micro_batch_size=2)
    for x, y in zip(a.log_probs, b.log_probs, strict=True):
        assert torch.equal(x, y)


def test_critic_values_ignore_temperature(dist_env):
    cfg = ModelConfig.preset("tiny-moe")
    critic = build_model(cfg, critic=True, seed=0)
    with torch.no_grad():
        critic.output_layer.weight.normal_()
    samples = _samples(cfg)
    hot = forward_only(critic, samples, role="critic", temperature=0.5)
    cold = forward_only(critic, samples, role="critic", temperature=1.0)
    assert hot.log_probs is None
    for s, v, w in zip(samples, hot.values, cold.values, strict=True):
        assert v.shape == (s.response_length,)
        assert torch.equal(v, w)
    assert torch.cat(hot.values).abs().sum() > 0


def test_bad_input_names_the_sample_or_role(actor):
    cfg, model, _ = actor
    samples = _samples(cfg)
    samples[3].response_length = 50  # longer than its 8 tokens
    with pytest.raises(ValueError, match="sample 3"):
        forward_only(model, samples, role="actor")
    with pytest.raises(ValueError, match="unknown role 'policy'"):
        forward_only(model, _samples(cfg), role="policy")
