"""The hf engine against one full no-cache forward of the same transformers model."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from conftest import TINY, make_engine

from ember_rollout.config import HFEngineConfig
from ember_rollout.engine import EngineError, GenerateRequest, SamplingParams
from ember_rollout.hf_engine import HFEngine
from ember_rollout.routing import decode_routed_experts

PROMPTS = [[12, 5, 3, 16], [13, 2, 9, 9, 4, 16], [14, 7, 16], [12, 3, 3, 3, 3, 3, 1, 16]]


def requests(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=12, seed=0, routed=False, **kw):
    return [
        GenerateRequest(
            input_ids=ids,
            sampling=SamplingParams(
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                seed=seed + i,
                **kw,
            ),
            fields={"return_routed_experts": True} if routed else {},
            name=f"sample {i}",
        )
        for i, ids in enumerate(PROMPTS)
    ]


def reference_support(logits_V, temperature, top_k, top_p):
    """{token: log-prob} over the tokens the filter keeps, each log-prob under the full tempered
    distribution (the one reported), computed row by row in float64."""
    probs = torch.softmax(logits_V.double() / temperature, dim=-1).tolist()
    order = sorted(range(len(probs)), key=lambda t: (-probs[t], t))
    kept, mass = [], 0.0
    for rank, token in enumerate(order):
        if (top_k > 0 and rank >= top_k) or (rank > 0 and mass >= top_p):
            break
        kept.append(token)
        mass += probs[token]
    return {t: math.log(probs[t]) for t in kept}


def full_forward(engine, tokens, router_logits=True):
    """Logits [T, V] (fp32) and router logits of every MoE layer, no cache, no padding."""
    with torch.no_grad():
        out = engine.model(input_ids=torch.tensor([tokens]), output_router_logits=router_logits)
    return out.logits[0].float(), out.router_logits if router_logits else None


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, -1, 1.0), (0.7, -1, 1.0), (1.3, 5, 0.8)]
)
def test_fp32_log_probs_equal_full_forward(family_engine, temperature, top_k, top_p):
    """Every MoE family (conftest's `family_engine`, loaded from an exported directory)."""
    outputs = family_engine.generate_sync(requests(temperature, top_p, top_k))
    for ids, out in zip(PROMPTS, outputs, strict=True):
        logits, _ = full_forward(family_engine, ids + out.output_ids, router_logits=False)
        rows = logits[len(ids) - 1 : len(ids) + len(out.output_ids) - 1]
        for row, token, lp in zip(rows, out.output_ids, out.output_log_probs, strict=True):
            allowed = reference_support(row, temperature, top_k, top_p)
            assert token in allowed, "sampled a token the filter removes"
            assert lp == pytest.approx(allowed[token], abs=1e-5)


def test_bf16_log_probs_within_bf16_tolerance(bf16_engine):
    outputs = bf16_engine.generate_sync(requests(temperature=0.8, max_new_tokens=16))
    gaps = []
    for ids, out in zip(PROMPTS, outputs, strict=True):
        logits, _ = full_forward(bf16_engine, ids + out.output_ids)
        rows = logits[len(ids) - 1 : len(ids) + len(out.output_ids) - 1]
        reference = torch.log_softmax(rows / 0.8, dim=-1)
        chosen = reference.gather(1, torch.tensor(out.output_ids).unsqueeze(1)).squeeze(1)
        gaps.append((chosen - torch.tensor(out.output_log_probs)).abs())
    gaps = torch.cat(gaps)
    # bf16 keeps 8 mantissa bits: logits of magnitude ~1 carry errors of ~1e-2.
    assert gaps.max() < 0.1 and gaps.mean() < 0.02, (gaps.max(), gaps.mean())


def test_routed_experts_equal_top_k_of_full_forward_router_logits(fp32_engine):
    outputs = fp32_engine.generate_sync(requests(routed=True))
    info = fp32_engine.model_info
    assert info.moe_layers == (0, 2) and info.num_layers == 3 and info.topk == 2
    for ids, out in zip(PROMPTS, outputs, strict=True):
        tokens = ids + out.output_ids
        _, router_logits = full_forward(fp32_engine, tokens[:-1])
        experts = out.routed_experts
        assert experts.dtype == torch.int32
        assert experts.shape == (len(tokens) - 1, 3, TINY.num_experts_per_tok)
        for layer, logits in zip(info.moe_layers, router_logits, strict=True):
            expected = torch.topk(logits, TINY.num_experts_per_tok, dim=-1).indices
            assert torch.equal(experts[:, layer], expected.int())
        assert not experts[:, 1].any(), "the dense layer must report zeros"
        decoded = decode_routed_experts(
            out.meta_info["routed_experts"],
            num_tokens=len(tokens),
            num_layers=3,
            topk=2,
            where="test",
        )
        assert torch.equal(decoded, experts)


def test_meta_info_uses_sglang_layout(fp32_engine):
    out = fp32_engine.generate_sync(requests(max_new_tokens=3, ignore_eos=True))[0]
    meta = out.meta_info
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    assert meta["prompt_tokens"] == len(PROMPTS[0]) and meta["completion_tokens"] == 3
    assert [[lp, t] for lp, t, _ in meta["output_token_logprobs"]] == [
        [lp, t] for lp, t in zip(out.output_log_probs, out.output_ids, strict=True)
    ]
    assert all(text is None for _, _, text in meta["output_token_logprobs"])
    assert "routed_experts" not in meta and out.routed_experts is None


def test_same_seed_same_samples_whatever_the_batch(fp32_engine):
    first = fp32_engine.generate_sync(requests(seed=3))
    again = make_engine("float32").generate_sync(requests(seed=3))
    alone = [fp32_engine.generate_sync([r])[0] for r in requests(seed=3)]
    other = fp32_engine.generate_sync(requests(seed=4))
    assert [o.output_ids for o in first] == [o.output_ids for o in again]
    assert [o.output_ids for o in first] == [o.output_ids for o in alone]
    assert [o.output_ids for o in first] != [o.output_ids for o in other]
    for a, b in zip(first, alone, strict=True):
        assert a.output_log_probs == pytest.approx(b.output_log_probs, abs=1e-5)


def test_batched_cached_generation_matches_uncached_reference(fp32_engine):
    batched = fp32_engine.generate_sync(requests(temperature=0.9, top_k=6, seed=11))
    uncached = fp32_engine.generate_uncached(requests(temperature=0.9, top_k=6, seed=11))
    for a, b in zip(batched, uncached, strict=True):
        assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason
        assert a.output_log_probs == pytest.approx(b.output_log_probs, abs=1e-5)


def test_dropping_finished_rows_does_not_change_results(family_engine):
    """Every MoE family's KV cache (DeepSeek-V3's holds MLA latents) drops rows alike."""
    model = family_engine.model
    every_step = HFEngine(HFEngineConfig(dtype="float32", compact_every=1), model=model)
    never = HFEngine(HFEngineConfig(dtype="float32", compact_every=0), model=model)
    reqs = requests(max_new_tokens=20, routed=True, seed=5)
    reqs[1].sampling.max_new_tokens = 2  # finishes early, so compaction happens
    a, b = every_step.generate_sync(reqs), never.generate_sync(reqs)
    for x, y in zip(a, b, strict=True):
        assert x.output_ids == y.output_ids
        assert torch.equal(x.routed_experts, y.routed_experts)
        assert x.output_log_probs == pytest.approx(y.output_log_probs, abs=1e-5)


def test_a_group_of_one_prompt_is_prefilled_once_and_samples_as_if_alone(family_engine):
    """A GRPO group's samples share their prompt: the prefill forwards each distinct prompt once
    and hands every sample a copy of its cache, logits and routed experts, with the same tokens,
    log-probs and experts as when each sample is generated alone."""
    group = [
        GenerateRequest(
            input_ids=PROMPTS[p],
            sampling=SamplingParams(max_new_tokens=10, temperature=0.9, seed=20 + i),
            fields={"return_routed_experts": True},
            name=f"prompt {p} sample {i}",
        )
        for i in range(3)
        for p in (0, 1)  # interleaved: the copies follow each row, not runs of equal rows
    ]
    prefill_rows = []
    model = family_engine.model
    hook = model.register_forward_pre_hook(
        lambda _, args, kwargs: prefill_rows.append(kwargs["input_ids"].shape),
        with_kwargs=True,
    )
    try:
        together = family_engine.generate_sync(group)
    finally:
        hook.remove()
    assert prefill_rows[0] == (2, len(PROMPTS[1])), "one prefill row per distinct prompt"
    assert all(shape[1] == 1 for shape in prefill_rows[1:]), "then one token per step"
    assert len({tuple(o.output_ids) for o in together}) > 2, "seeds differ, samples differ"
    for request, out in zip(group, together, strict=True):
        alone = family_engine.generate_sync([request])[0]
        assert out.output_ids == alone.output_ids and out.finish_reason == alone.finish_reason
        assert torch.equal(out.routed_experts, alone.routed_experts)
        assert out.output_log_probs == pytest.approx(alone.output_log_probs, abs=1e-5)


def test_top_p_samples_from_the_nucleus_and_reports_the_unfiltered_tempered_log_prob(fp32_engine):
    """The meaning of rollout log-probs on every engine: log softmax(logits / T) of the sampled
    token over the whole vocabulary, what the trainer computes and SGLang returns, while the
    token itself is drawn from the top-p nucleus."""
    temperature, top_p = 0.7, 0.5
    outputs = fp32_engine.generate_sync(requests(temperature, top_p, max_new_tokens=16))
    cut = 0
    for ids, out in zip(PROMPTS, outputs, strict=True):
        logits, _ = full_forward(fp32_engine, ids + out.output_ids, router_logits=False)
        rows = logits[len(ids) - 1 : len(ids) + len(out.output_ids) - 1].double()
        full = torch.log_softmax(rows / temperature, dim=-1)
        for row, token, lp, step in zip(
            rows, out.output_ids, out.output_log_probs, full, strict=True
        ):
            nucleus = reference_support(row, temperature, -1, top_p)
            assert token in nucleus, "sampled a token outside the nucleus"
            assert lp == pytest.approx(step[token].item(), abs=1e-5)
            kept_mass = sum(math.exp(v) for v in nucleus.values())
            cut += kept_mass < 0.99  # renormalising would have moved lp by -log(kept_mass)
    assert cut > 10, "top_p=0.5 must cut the distribution for this test to mean anything"


def test_top_k_one_is_greedy_with_the_tempered_log_prob(fp32_engine):
    outputs = fp32_engine.generate_sync(requests(temperature=0.8, top_k=1))
    for out, ids in zip(outputs, PROMPTS, strict=True):
        logits, _ = full_forward(fp32_engine, ids + out.output_ids)
        rows = logits[len(ids) - 1 : len(ids) + len(out.output_ids) - 1]
        assert out.output_ids == rows.argmax(-1).tolist()
        expected = torch.log_softmax(rows / 0.8, dim=-1).max(-1).values
        assert out.output_log_probs == pytest.approx(expected.tolist(), abs=1e-5)
        assert max(out.output_log_probs) < -1e-3  # not the 0.0 of the point mass sampled


def test_stop_token_ends_generation_and_is_returned(fp32_engine):
    probe = fp32_engine.generate_sync(requests(max_new_tokens=8, ignore_eos=True, seed=21))
    stop = probe[0].output_ids[2]
    outs = fp32_engine.generate_sync(
        requests(max_new_tokens=8, ignore_eos=True, seed=21, stop_token_ids=[stop])
    )
    first = probe[0].output_ids.index(stop)
    assert outs[0].output_ids == probe[0].output_ids[: first + 1]
    assert outs[0].finish_reason == "stop"
    assert outs[0].meta_info["finish_reason"] == {"type": "stop", "matched": stop}


def test_model_eos_stops_unless_ignored(fp32_engine):
    eos = fp32_engine.model_info.eos_token_ids
    assert eos == (0,)
    outs = fp32_engine.generate_sync(requests(max_new_tokens=40, temperature=2.0, seed=1))
    for out in outs:
        assert (out.finish_reason == "stop") == (0 in out.output_ids)
        assert 0 not in out.output_ids[:-1]


def test_bad_requests_name_the_request(fp32_engine):
    too_long = GenerateRequest(
        input_ids=[3] * TINY.max_position_embeddings,
        sampling=SamplingParams(max_new_tokens=1),
        name="sample 9 (group 2)",
    )
    with pytest.raises(EngineError, match=r"sample 9 \(group 2\).*context length"):
        fp32_engine.generate_sync([too_long])
    bad_token = GenerateRequest(
        input_ids=[3, 99], sampling=SamplingParams(max_new_tokens=1), name="sample 4"
    )
    with pytest.raises(EngineError, match=r"sample 4: prompt token ids \[99\]"):
        fp32_engine.generate_sync([bad_token])


def test_context_limit_truncates_generation(fp32_engine):
    room = 3
    request = GenerateRequest(
        input_ids=[3] * (TINY.max_position_embeddings - room),
        sampling=SamplingParams(max_new_tokens=50, ignore_eos=True, seed=0),
    )
    out = fp32_engine.generate_sync([request])[0]
    assert len(out.output_ids) == room and out.finish_reason == "length"


def test_async_interface_and_lifecycle():
    engine = make_engine("float32")

    async def run():
        async with engine:
            assert await engine.health()
            outs = await engine.generate(requests(max_new_tokens=4))
        assert not await engine.health()
        return outs

    outs = asyncio.run(run())
    assert len(outs) == len(PROMPTS) and all(1 <= len(o.output_ids) <= 4 for o in outs)
