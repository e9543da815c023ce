"""The sglang engine against the real SGLang server (sglang 0.5.23 on CPU, `sglang_real`).

Everything Ember asks of SGLang is asked here of the server itself: generation with log-probs
and routed experts, weight versions, update sessions and their refusals, disk, tensor and
distributed updates (Ember's own weight group as the sender), memory release and resume, abort
and timeouts. Where a test changes the served weights it loads the original ones back.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors.torch import load_file
from sglang_real import broadcast_weights, hf_log_probs, hf_model

from ember_rollout.engine import EngineError, GenerateRequest, SamplingParams
from ember_rollout.routing import ROUTED_EXPERTS_DTYPE_KEY, ROUTED_EXPERTS_KEY
from ember_rollout.sglang_weights import serialize_named_tensors

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

PROMPTS = [[3, 4, 5, 6, 7], [9, 8, 2], [5, 5, 5, 5, 5, 5, 1]]

FP32_LOG_PROB_TOL = 1e-5
"""fp32 server against fp32 transformers on the same checkpoint: the same math with different
kernels (SGLang's torch-native attention and fused MoE vs transformers'); measured 2.4e-7 on a
2-core AMD EPYC (AVX2 and AVX-512F), so 1e-5 leaves room for another processor's summation
order."""


def requests(*, temperature=1.0, max_new_tokens=6, routed=False, top_k=-1, ignore_eos=True):
    sampling = dict(
        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, ignore_eos=ignore_eos
    )
    return [
        GenerateRequest(
            input_ids=list(prompt),
            sampling=SamplingParams(**sampling),
            fields={"return_routed_experts": True} if routed else {},
            name=f"prompt {i}",
        )
        for i, prompt in enumerate(PROMPTS)
    ]


def greedy(engine):
    return engine.generate(requests(top_k=1, max_new_tokens=8))


async def post(engine, path, payload):
    async with engine._http.post(f"{engine.urls[0]}{path}", json=payload) as answer:
        return answer.status, await answer.json(content_type=None)


async def model_info(engine):
    async with engine._http.get(f"{engine.urls[0]}/model_info") as answer:
        assert answer.status == 200
        return await answer.json()


def assert_same_outputs(outputs, expected):
    """The same tokens, and log-probs equal to fp32 rounding: a batch composed differently, or a
    prompt found in the prefix cache, changes the order of the kernels' sums."""
    assert [o.output_ids for o in outputs] == [o.output_ids for o in expected]
    for out, want in zip(outputs, expected, strict=True):
        diff = torch.tensor(out.output_log_probs) - torch.tensor(want.output_log_probs)
        assert diff.abs().max().item() < FP32_LOG_PROB_TOL


def assert_log_probs_match(path, outputs, temperature=1.0):
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        want, _ = hf_log_probs(path, prompt + out.output_ids, len(prompt), temperature)
        got = torch.tensor(out.output_log_probs, dtype=torch.float64)
        assert (got - want).abs().max().item() < FP32_LOG_PROB_TOL, (got, want)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_are_the_sampled_tokens_at_the_rollout_temperature(real_sglang, temperature):
    """SGLang's log-probs are of the temperature-scaled distribution it sampled from, as the
    trainer's PolicyHead computes them."""
    outputs = real_sglang.run(lambda e: e.generate(requests(temperature=temperature)))
    assert [len(o.output_ids) for o in outputs] == [6, 6, 6]
    assert {o.finish_reason for o in outputs} == {"length"}
    assert_log_probs_match(real_sglang.base, outputs, temperature)
    if temperature != 1.0:  # and not of the unscaled one
        prompt, out = PROMPTS[0], outputs[0]
        unscaled, _ = hf_log_probs(real_sglang.base, prompt + out.output_ids, len(prompt))
        assert (torch.tensor(out.output_log_probs) - unscaled).abs().max() > 1e-3


def test_top_p_log_probs_mean_the_same_on_sglang_and_the_embedded_engine(real_sglang):
    """The same requests at top_p 0.5 to the real server and to the embedded engine on the same
    checkpoint: each draws its tokens from the nucleus and reports log softmax(logits / T) of
    them over the whole vocabulary, unrenormalised, as the trainer computes them."""
    from ember_rollout.config import HFEngineConfig
    from ember_rollout.hf_engine import HFEngine

    temperature, top_p = 0.7, 0.5
    sampling = dict(max_new_tokens=8, temperature=temperature, top_p=top_p, ignore_eos=True)
    batch = [
        GenerateRequest(input_ids=list(p), sampling=SamplingParams(**sampling, seed=i))
        for i, p in enumerate(PROMPTS)
    ]
    served = real_sglang.run(lambda e: e.generate(batch))
    embedded = HFEngine(
        HFEngineConfig(model_path=str(real_sglang.base), dtype="float32", num_threads=1)
    ).generate_sync(batch)
    model = hf_model(real_sglang.base)
    for engine, outputs in (("sglang", served), ("hf", embedded)):
        cut = 0
        for prompt, out in zip(PROMPTS, outputs, strict=True):
            tokens = prompt + out.output_ids
            with torch.no_grad():
                logits = model(torch.tensor([tokens])).logits[0].double()
            rows = logits[len(prompt) - 1 : len(tokens) - 1] / temperature
            full = torch.log_softmax(rows, -1)  # [R, V]
            picked = full.gather(1, torch.tensor(out.output_ids)[:, None])[:, 0]
            got = torch.tensor(out.output_log_probs, dtype=torch.float64)
            assert (got - picked).abs().max().item() < FP32_LOG_PROB_TOL, (engine, got, picked)
            # SGLang's rule: a token is kept while the mass ranked before it is below top_p.
            probs = full.exp()
            mass_before = probs * (probs > probs.gather(1, torch.tensor(out.output_ids)[:, None]))
            assert (mass_before.sum(-1) < top_p).all(), f"{engine} sampled outside the nucleus"
            sorted_probs = probs.sort(-1, descending=True).values
            kept_mass = (sorted_probs * ((sorted_probs.cumsum(-1) - sorted_probs) < top_p)).sum(-1)
            cut += int((kept_mass < 0.99).sum())  # renormalised log-probs would differ there
        assert cut >= 8, f"{engine}: top_p=0.5 must cut the distribution ({cut} steps did)"


def test_routed_experts_are_the_served_models_routing(real_sglang):
    """The routed experts R3 replays, parsed by the engine, are every layer's router top-k of
    every forwarded position (prompt and response, the last token excepted)."""
    outputs = real_sglang.run(lambda e: e.generate(requests(routed=True)))
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        tokens = prompt + out.output_ids
        _, routing = hf_log_probs(real_sglang.base, tokens, len(prompt))
        experts = out.routed_experts
        assert experts.dtype == torch.int32 and experts.shape == (len(tokens) - 1, 4, 2)
        assert torch.equal(experts.sort(-1).values.long(), routing)


def test_greedy_generation_is_repeatable_and_weight_versions_follow_disk_loads(real_sglang):
    async def body(engine):
        first, again = await greedy(engine), await greedy(engine)
        start = await model_info(engine)
        await engine.update_weights_from_disk(real_sglang.other, weight_version="7")
        other = await greedy(engine)
        info = await model_info(engine)
        await engine.update_weights_from_disk(real_sglang.base, weight_version="8")
        back = await greedy(engine)
        return first, again, start, other, info, back

    first, again, start, other, info, back = real_sglang.run(body)
    assert [o.output_ids for o in first] == [o.output_ids for o in again]
    assert start["weight_version"] != "7"
    assert info["weight_version"] == "7"
    assert {o.meta_info["weight_version"] for o in other} == {"7"}
    # The spans the server reports (one per request: no update overlapped one) parse.
    assert [o.weight_spans("greedy") for o in other] == [[(0, "7")]] * len(other)
    assert [o.output_ids for o in other] != [o.output_ids for o in first]
    assert_log_probs_match(real_sglang.other, other)
    assert_same_outputs(back, first)
    assert {o.meta_info["weight_version"] for o in back} == {"8"}


def test_updates_outside_a_session_and_nested_sessions_are_refused_by_the_server(real_sglang):
    async def body(engine):
        # A well-formed body: the server checks the request before the session.
        payload = serialize_named_tensors([("model.norm.weight", torch.ones(64))])
        tensor_update = {"serialized_named_tensors": [payload], "load_format": None}
        outside = await post(engine, "/update_weights_from_tensor", tensor_update)
        end_without_begin = await post(engine, "/end_weight_update", {})
        await engine.begin_weight_update()
        try:
            async with real_sglang.engine() as second:  # another client of the same server
                with pytest.raises(EngineError) as nested:
                    await second.begin_weight_update()
        finally:
            await engine.end_weight_update()
        with pytest.raises(EngineError, match="must run between begin_weight_update"):
            await engine.update_weights_from_distributed(["w"], ["float32"], [[1]], group_name="g")
        bad_body = await post(engine, "/update_weights_from_disk", {"model_path": 3})
        return outside, end_without_begin, str(nested.value), bad_body

    outside, end_without_begin, nested, bad_body = real_sglang.run(body)
    assert outside[0] == 400
    assert "must run between begin_weight_update() and end_weight_update()" in str(outside[1])
    assert end_without_begin[0] == 400 or end_without_begin[1].get("success") is False
    assert "begin_weight_update on http://127.0.0.1" in nested
    assert bad_body[0] == 400


def test_tensor_update_from_cpu_tensors_inside_a_session(real_sglang):
    """CPU tensors reach the server by shared-memory file name (torch's file_system strategy)."""
    other = load_file(real_sglang.other / "model.safetensors")
    base = load_file(real_sglang.base / "model.safetensors")

    async def body(engine):
        before = await greedy(engine)
        await engine.update_weights_from_tensors(other.items(), weight_version="t1")
        updated = await greedy(engine)
        await engine.update_weights_from_tensors(base.items(), weight_version="t2")
        return before, updated, await greedy(engine)

    before, updated, back = real_sglang.run(body)
    assert {o.meta_info["weight_version"] for o in updated} == {"t1"}
    assert_log_probs_match(real_sglang.other, updated)
    assert_same_outputs(back, before)


def test_distributed_update_from_embers_weight_group_over_gloo(real_sglang):
    """The trainer's broadcast path: the server joins Ember's weight group (gloo on CPU) and
    loads flattened buckets; broadcasting the original weights back restores them exactly."""
    other = load_file(real_sglang.other / "model.safetensors")
    base = load_file(real_sglang.base / "model.safetensors")

    async def push(engine, weights, version):
        return await broadcast_weights(engine, weights, bucket_bytes=20_000, version=version)

    async def body(engine):
        before = await greedy(engine)
        buckets = await push(engine, other, "d1")
        updated = await greedy(engine)
        await push(engine, base, "d2")
        return buckets, before, updated, await greedy(engine)

    buckets, before, updated, back = real_sglang.run(body)
    assert buckets > 1, "several buckets, so the bucket boundaries are exercised"
    assert {o.meta_info["weight_version"] for o in updated} == {"d1"}
    assert_log_probs_match(real_sglang.other, updated)
    assert_same_outputs(back, before)


def test_memory_release_and_resume_keep_serving_the_same_weights(real_sglang):
    """Without --enable-memory-saver (no GPU) SGLang only flushes its cache on release; the
    engine's tag bookkeeping and the calls' answers are the real server's."""

    async def body(engine):
        before = await greedy(engine)
        await engine.release_memory()
        with pytest.raises(EngineError, match="already released"):
            await engine.release_memory(["kv_cache"])
        await engine.resume_memory()
        return before, await greedy(engine)

    before, after = real_sglang.run(body)
    assert_same_outputs(after, before)


def test_an_aborted_request_and_a_timed_out_one(real_sglang):
    long = GenerateRequest(
        input_ids=[3, 4, 5],
        sampling=SamplingParams(max_new_tokens=400, ignore_eos=True),
        name="long one",
    )

    async def aborted(engine):
        pending = asyncio.ensure_future(engine.generate([long]))
        await asyncio.sleep(0.5)
        await post(engine, "/abort_request", {"abort_all": True})
        (out,) = await pending
        return out

    out = real_sglang.run(aborted)
    assert out.finish_reason == "abort"
    assert len(out.output_ids) == len(out.output_log_probs) < 400

    async def timed_out(engine):
        with pytest.raises(
            EngineError, match=r"long one: POST .*/generate failed after 1 attempts"
        ):
            await engine.generate([long])

    real_sglang.run(timed_out, request_timeout_s=0.2, max_retries=0)

    async def after(engine):
        # The engine aborted the request it gave up on, so nothing runs on the server and a
        # weight update that flushes the cache succeeds (sglang refuses it while one runs).
        await engine.update_weights_from_disk(real_sglang.base, weight_version="after")
        return await greedy(engine)

    assert len(real_sglang.run(after)) == 3


# -- the fake against the real server ----------------------------------------------------------


def _scenario(model_path: str) -> list[tuple[str, object]]:
    """Requests Ember's fakes answer too, in an order whose session state matters."""
    sampling = {"max_new_tokens": 2, "ignore_eos": True}
    good = {"input_ids": [3, 4, 5], "sampling_params": sampling}
    update = {"names": ["w"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "g"}
    # One tensor of the served checkpoint, sent back unchanged inside a session.
    (name, tensor), *_ = load_file(f"{model_path}/model.safetensors").items()
    same = serialize_named_tensors([(name, tensor)])
    return [
        ("/update_weights_from_disk", {"model_path": model_path, "weight_version": "v0"}),
        ("/generate", good),
        ("/generate", {**good, "return_logprob": True}),
        ("/generate", {**good, "sampling_params": {**sampling, "seed": 3}}),
        ("/generate", {**good, "sampling_params": {**sampling, "top_k": "20"}}),
        ("/generate", {**good, "sampling_params": {**sampling, "top_p": 0}}),
        ("/generate", {"sampling_params": sampling}),
        ("/generate", {**good, "input_ids": ["a"]}),
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["x"], "load_format": None}),
        ("/update_weights_from_distributed", update),
        ("/end_weight_update", {}),
        ("/begin_weight_update", {"selector": "all"}),
        ("/begin_weight_update", {"selector": "all"}),
        ("/end_weight_update", {}),
        ("/update_weights_from_disk", {"model_path": 3}),
        ("/update_weights_from_disk", {"model_path": model_path, "weight_version": "v9"}),
        ("/generate", {**good, "return_logprob": True}),
        ("/release_memory_occupation", {"tags": None}),
        ("/resume_memory_occupation", {"tags": None}),
        ("/generate", {**good, "return_logprob": True, "return_routed_experts": True}),
        ("/abort_request", {"rid": "no-such-request"}),
        ("/pause_generation", {"mode": "in_place"}),
        ("/begin_weight_update", {"selector": "all"}),
        ("/update_weights_from_tensor", {"serialized_named_tensors": [same], "flush_cache": False}),
        ("/end_weight_update", {}),
        ("/continue_generation", {}),
        ("/generate", {**good, "return_logprob": True}),
    ]


def _what_must_agree(path: str, status: int, answer) -> tuple:
    """The parts of an answer Ember reads or shows, with the model's numbers left out."""
    if status >= 400:
        error = answer.get("error") if isinstance(answer, dict) else None
        if isinstance(error, str):
            return status, "error: <str>", error.split(":")[0].split(" at ")[0]
        if isinstance(error, dict):
            return status, "error: {message}", error.get("message")
        return status, "object: error" if answer.get("object") == "error" else repr(answer)[:80]
    if path == "/generate":
        meta = answer["meta_info"]
        entries = meta.get("output_token_logprobs")
        entry = None if entries is None else [type(v).__name__ for v in entries[0]]
        experts = meta.get(ROUTED_EXPERTS_KEY)
        return (
            status,
            meta["finish_reason"]["type"],
            answer["output_ids"] and True,
            entry,
            meta["weight_version"],
            meta.get("weight_versions"),
            None if experts is None else type(experts).__name__,
            meta.get(ROUTED_EXPERTS_DTYPE_KEY),
        )
    if isinstance(answer, dict):
        return status, answer.get("success"), answer.get("message"), answer.get("status")
    return status, answer


def _answers(engine, model_path: str):
    async def ask():
        out = []
        for path, body in _scenario(model_path):
            status, answer = await post(engine, path, body)
            out.append((path, _what_must_agree(path, status, answer)))
        return out

    return ask()


def test_the_fake_answers_as_the_real_server_does(real_sglang, tmp_path):
    from sglang_fake import FakeSGLang, run

    real = real_sglang.run(lambda engine: _answers(engine, str(real_sglang.base)))
    fake = run(FakeSGLang(), lambda engine: _answers(engine, str(real_sglang.base)))
    disagree = [(r, f) for r, f in zip(real, fake, strict=True) if r != f]
    assert not disagree, "\n".join(f"real {r}\nfake {f}" for r, f in disagree)
