"""Weights that reach the hf engine while it generates (`rollout.partial_rollouts`): taken
between decode steps, never half-loaded, each token drawn from and scored by the weights in
force at its step, the samples carrying the spans; without partial rollouts a load waits for
`generate`."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from typing import Any

import pytest
import torch
from conftest import TINY
from test_generate_plugin import INSERTED, TwoTurns
from test_hf_engine import PROMPTS, full_forward, reference_support, requests

from ember_core.hookspecs import hookimpl
from ember_core.plugins import EmberPlugins
from ember_core.types import Sample
from ember_rollout.config import HFEngineConfig
from ember_rollout.data import PromptRecord
from ember_rollout.engine import Engine, EngineError, GenerateRequest
from ember_rollout.hf_engine import HFEngine
from ember_rollout.rollout import LocalGroups, PromptGroup
from ember_rollout.tokenizer import toy_tokenizer

NEW = dataclasses.replace(TINY, init_seed=TINY.init_seed + 1)
PAUSE_AT = 4
"""The model forward held while a weight update starts (0 is the prefill, k the decode pass
after k sampled tokens). The update must wait for it, so its logits draw token PAUSE_AT with
the old weights, and the new ones draw from token SWITCH on."""
SWITCH = PAUSE_AT + 1
MAX_NEW = [12, 3, 6, 12]
"""Row 1 finishes before the update, row 2 one token after it."""
TEMPERATURE = 0.9
WAIT_S = 60.0


def engine(tiny=TINY, **kwargs: Any) -> HFEngine:
    built = HFEngine(HFEngineConfig(dtype="float32", tiny=tiny), **kwargs)
    built.load()
    return built


def weights(model) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


@pytest.fixture(scope="module")
def models():
    """(old, new): fp32 engines of two seeds; the old one is what every test engine starts as."""
    return engine(), engine(NEW)


class HeldForward:
    """A forward pre-hook on `model`: holds forward `at` until `release()`, and records, at the
    start of every forward, whether the weights are all `old`, all `new`, or a mix."""

    def __init__(self, model, at: int, old: dict, new: dict) -> None:
        self.model, self.at, self.old, self.new = model, at, old, new
        self.count = 0
        self.seen: list[str] = []
        self.inside, self._go = threading.Event(), threading.Event()
        self._handle = model.register_forward_pre_hook(self._hook)

    def _state(self) -> str:
        state = self.model.state_dict()
        for label, wanted in (("old", self.old), ("new", self.new)):
            if all(torch.equal(state[k], v) for k, v in wanted.items()):
                return label
        return "mixed"

    def _hook(self, module, args) -> None:
        self.seen.append(self._state())
        if self.count == self.at:
            self.inside.set()
            assert self._go.wait(WAIT_S), "the test never released the held forward"
        self.count += 1

    def release(self) -> None:
        self._go.set()

    def close(self) -> None:
        self._go.set()
        self._handle.remove()


def push_while_held(target: HFEngine, held: HeldForward, version: str) -> list[str]:
    """Once the decoder is inside the held forward: open a session (which must wait for that
    forward), load `held.new` in three buckets with pauses between them (time for a decoder
    that does not wait to run on half-loaded weights), close it. Returns what happened, in
    order. Runs on the test's thread, with event loops of its own, as the engine actor's weight
    thread does."""
    events: list[str] = []
    assert held.inside.wait(WAIT_S), "generation never reached the held forward"
    opened = threading.Event()

    def begin() -> None:
        asyncio.run(target.begin_weight_update())
        events.append("session open")
        opened.set()

    opener = threading.Thread(target=begin)
    opener.start()
    time.sleep(0.3)
    if not opened.is_set():
        events.append("decode step still running")
    held.release()
    opener.join(WAIT_S)
    named = list(held.new.items())
    size = -(-len(named) // 3)

    async def load() -> None:
        for start in range(0, len(named), size):
            last = start + size >= len(named)
            await target.update_weights_from_tensors(
                named[start : start + size], weight_version=version if last else None, partial=True
            )
            assert target.weight_version == "0", "served before the session closed"
            await asyncio.sleep(0.05)
        await target.end_weight_update()

    asyncio.run(load())
    events.append("session closed")
    return events


def in_thread(function, *args: Any) -> tuple[threading.Thread, dict]:
    """Start `function(*args)` on a thread; its result (or error) lands in the dict."""
    result: dict = {}

    def run() -> None:
        try:
            result["value"] = function(*args)
        except BaseException as exc:  # re-raised by `joined`
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def joined(thread: threading.Thread, result: dict) -> Any:
    thread.join(WAIT_S)
    assert not thread.is_alive(), "generation hung"
    if "error" in result:
        raise result["error"]
    return result["value"]


def update_mid_generation(models, generate, reqs):
    """A partial-rollouts engine serving the old weights as version "0" runs `generate(engine,
    reqs)` on a thread; the new weights arrive as version "1" while forward PAUSE_AT is held.
    Returns (engine, held, events, what `generate` returned)."""
    _, new_ref = models
    target = engine(partial_rollouts=True)
    target.weight_version = "0"
    held = HeldForward(target.model, PAUSE_AT, weights(target.model), weights(new_ref.model))
    try:
        thread, result = in_thread(generate, target, reqs)
        events = push_while_held(target, held, "1")
        value = joined(thread, result)
    finally:
        held.close()
    return target, held, events, value


def staggered_requests() -> list[GenerateRequest]:
    reqs = requests(TEMPERATURE, max_new_tokens=max(MAX_NEW), ignore_eos=True, routed=True, seed=3)
    for request, n in zip(reqs, MAX_NEW, strict=True):
        request.sampling.max_new_tokens = n
    return reqs


def top_experts(router_logits) -> list[torch.Tensor]:
    return [torch.topk(r, TINY.num_experts_per_tok, dim=-1).indices.int() for r in router_logits]


def test_weights_loaded_mid_generation_switch_the_policy_between_decode_steps(models):
    old_ref, new_ref = models
    target, held, events, outputs = update_mid_generation(
        models, HFEngine.generate_sync, staggered_requests()
    )
    # The session opened only once the decode step in flight had ended; no forward ran on a
    # half-loaded model; the old weights ran the prefill and passes 1 .. PAUSE_AT, the new ones
    # every pass after.
    assert events == ["decode step still running", "session open", "session closed"]
    new_passes = len(held.seen) - SWITCH
    assert new_passes > 0 and held.seen == ["old"] * SWITCH + ["new"] * new_passes
    assert target.weight_version == "1"

    moe_layers = target.model_info.moe_layers
    gaps, rerouted = [], 0
    for ids, out, n in zip(PROMPTS, outputs, MAX_NEW, strict=True):
        assert len(out.output_ids) == n
        # SGLang's layout: contiguous spans to the response's end, `weight_version` the last.
        if n <= SWITCH:
            spans = [{"version": "0", "start": 0, "end": n}]
        else:
            spans = [
                {"version": "0", "start": 0, "end": SWITCH},
                {"version": "1", "start": SWITCH, "end": n},
            ]
        assert out.meta_info["weight_versions"] == spans
        assert out.meta_info["weight_version"] == spans[-1]["version"]
        tokens = ids + out.output_ids
        # Position p predicts token p + 1: the weights in force when token p + 1 was drawn
        # forwarded it, the old ones up to position `boundary` - 1, the new ones from there.
        boundary = len(ids) - 1 + SWITCH
        old_logits, old_router = full_forward(old_ref, tokens[:-1])
        new_logits, new_router = full_forward(new_ref, tokens[:-1])
        for i, (token, lp) in enumerate(zip(out.output_ids, out.output_log_probs, strict=True)):
            p = len(ids) - 1 + i
            mine, other = (old_logits, new_logits) if p < boundary else (new_logits, old_logits)
            # The distribution the token was drawn from, over the whole prefix without a cache.
            # fp32, same model code: batched cached passes differ from one uncached pass by
            # summation order only (test_hf_engine's bound).
            drawn_from = reference_support(mine[p], TEMPERATURE, -1, 1.0)
            assert lp == pytest.approx(drawn_from[token], abs=1e-5)
            gaps.append(abs(reference_support(other[p], TEMPERATURE, -1, 1.0)[token] - lp))
        for layer, old_top, new_top in zip(
            moe_layers, top_experts(old_router), top_experts(new_router), strict=True
        ):
            got = out.routed_experts[:, layer]
            assert torch.equal(got[:boundary], old_top[:boundary]), layer
            assert torch.equal(got[boundary:], new_top[boundary:]), layer
            rerouted += int((old_top[boundary:] != new_top[boundary:]).any(-1).sum())
    # The checks tell the versions apart: the other version's log-probs and routing differ.
    assert max(gaps) > 0.05 and rerouted > 0, (max(gaps), rerouted)


def test_rows_that_agree_share_the_prefill_again_after_a_mid_generation_update(models):
    """Copies of two requests (same prompt, same seed: the same tokens) share the prefill, and
    again the prefill that a weight update forces, and get what the originals get."""
    reqs = staggered_requests()
    copies = [dataclasses.replace(reqs[i], name=f"copy of {i}") for i in (0, 3)]
    shapes: list[tuple[int, int]] = []

    def generate(target: HFEngine, batch: list[GenerateRequest]) -> list:
        hook = target.model.register_forward_pre_hook(
            lambda _, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
            with_kwargs=True,
        )
        try:
            return target.generate_sync(batch)
        finally:
            hook.remove()

    _, held, _, outputs = update_mid_generation(models, generate, reqs + copies)
    assert held.seen[SWITCH:] and set(held.seen[SWITCH:]) == {"new"}
    # The first prefill: 4 distinct prompts for 6 rows. The update's: rows 0, 2, 3 and the two
    # copies still running (row 1 stopped at 3 tokens), 3 distinct sequences.
    assert shapes[0][0] == 4 and shapes[SWITCH][0] == 3 and shapes[SWITCH][1] > 1
    for original, copy in zip([outputs[0], outputs[3]], outputs[4:], strict=True):
        assert copy.output_ids == original.output_ids
        assert copy.output_log_probs == original.output_log_probs
        assert torch.equal(copy.routed_experts, original.routed_experts)
        assert copy.meta_info["weight_versions"] == original.meta_info["weight_versions"]
        assert len(original.meta_info["weight_versions"]) == 2


def test_without_partial_rollouts_a_weight_load_waits_for_generate(models):
    old_ref, new_ref = models
    target = engine()
    target.weight_version = "0"
    new = weights(new_ref.model)
    held = HeldForward(target.model, PAUSE_AT, weights(target.model), new)
    reqs = staggered_requests()

    async def scenario():
        generation = asyncio.create_task(target.generate(reqs))
        assert await asyncio.to_thread(held.inside.wait, WAIT_S)
        load = asyncio.create_task(
            target.update_weights_from_tensors(list(new.items()), weight_version="1")
        )
        await asyncio.sleep(0.3)
        waited = not load.done()
        held.release()
        outputs = await generation
        await load
        return waited, outputs

    try:
        waited, outputs = asyncio.run(scenario())
    finally:
        held.close()
    assert waited, "the load ran while generate was decoding"
    assert set(held.seen) == {"old"} and target.weight_version == "1"
    assert all(torch.equal(v, new[k]) for k, v in target.model.state_dict().items())
    for ids, out in zip(PROMPTS, outputs, strict=True):
        assert out.meta_info["weight_version"] == "0"
        n = len(out.output_ids)
        assert out.meta_info["weight_versions"] == [{"version": "0", "start": 0, "end": n}]
        logits, _ = full_forward(old_ref, ids + out.output_ids, router_logits=False)
        for i, (token, lp) in enumerate(zip(out.output_ids, out.output_log_probs, strict=True)):
            allowed = reference_support(logits[len(ids) - 1 + i], TEMPERATURE, -1, 1.0)
            assert lp == pytest.approx(allowed[token], abs=1e-5)


# -- a push that stops partway -------------------------------------------------------------------

EMBED = "model.embed_tokens.weight"
UNVERSIONED = "serves no weight version until a complete update"


def complete_push(target: HFEngine, new: dict[str, torch.Tensor], version: str) -> None:
    """Every tensor of `new` in two buckets of one session, `version` with the last."""
    named = list(new.items())
    half = len(named) // 2

    async def push() -> None:
        await target.begin_weight_update()
        await target.update_weights_in_session(named[:half])
        await target.update_weights_in_session(named[half:], weight_version=version)
        await target.end_weight_update()

    asyncio.run(push())


def test_a_refused_push_leaves_no_version_and_generation_waits_for_a_complete_one(models):
    """Buckets are copied as they arrive: a session that closes incomplete (an engine of the
    push died, the sender failed) leaves weights of two versions, which no version names. The
    engine then serves none, and with partial rollouts generation waits behind the closed gate
    until a complete push, and runs on that."""
    _, new_ref = models
    target = engine(partial_rollouts=True)
    target.weight_version = "3"
    embed = target.model.get_input_embeddings().weight

    async def refused() -> None:
        await target.begin_weight_update()
        zeros = [(EMBED, torch.zeros_like(embed))]
        await target.update_weights_from_tensors(zeros, partial=True)
        with pytest.raises(EngineError, match=f"leaves out .*{UNVERSIONED}"):
            await target.end_weight_update()

    asyncio.run(refused())
    assert not embed.any(), "the bucket was copied as it arrived"
    assert target.weight_version is None, "weights of two versions carry no version"
    reqs = requests(TEMPERATURE, max_new_tokens=6, ignore_eos=True, seed=5)
    thread, result = in_thread(target.generate_sync, reqs)
    thread.join(0.5)
    assert thread.is_alive(), "generation ran on weights no version names"
    complete_push(target, weights(new_ref.model), "4")
    outputs, wanted = joined(thread, result), new_ref.generate_sync(reqs)
    for got, want in zip(outputs, wanted, strict=True):
        n = len(got.output_ids)
        assert got.meta_info["weight_versions"] == [{"version": "4", "start": 0, "end": n}]
        # Exact: the same model code, the same seeds, the new weights from the prefill on.
        assert got.output_log_probs == want.output_log_probs


def test_a_decoder_held_by_a_refused_push_continues_on_the_next_complete_one(models):
    """Mid-generation: the refused session's half of the new weights never reaches a forward;
    the decoder waits at its next step and continues on the next complete push, and the spans
    name the old version and the complete one only."""
    _, new_ref = models
    target = engine(partial_rollouts=True)
    target.weight_version = "0"
    new = weights(new_ref.model)
    held = HeldForward(target.model, PAUSE_AT, weights(target.model), new)
    reqs = requests(max_new_tokens=12, ignore_eos=True)[:1]
    try:
        thread, result = in_thread(target.generate_sync, reqs)
        assert held.inside.wait(WAIT_S)
        opener = threading.Thread(target=lambda: asyncio.run(target.begin_weight_update()))
        opener.start()
        deadline = time.monotonic() + WAIT_S
        while not target._gate.closed:  # closed first; it waits for the held forward to end
            assert time.monotonic() < deadline, "the session never closed the gate"
            time.sleep(0.01)
        held.release()
        opener.join(WAIT_S)
        half = list(new.items())[: len(new) // 2]

        async def refused() -> None:
            await target.update_weights_in_session(half, weight_version="1")
            with pytest.raises(EngineError, match=UNVERSIONED):
                await target.end_weight_update()

        asyncio.run(refused())
        time.sleep(0.3)  # time for a decoder that does not wait to run on the mix
        assert len(held.seen) == SWITCH, "a forward ran after the refused push"
        complete_push(target, new, "2")
        (out,) = joined(thread, result)
    finally:
        held.close()
    assert "mixed" not in held.seen and held.seen[SWITCH:] and set(held.seen[SWITCH:]) == {"new"}
    n = len(out.output_ids)
    assert out.meta_info["weight_versions"] == [
        {"version": "0", "start": 0, "end": SWITCH},
        {"version": "2", "start": SWITCH, "end": n},
    ]


def test_without_partial_rollouts_weights_no_version_names_refuse_to_generate(models, tmp_path):
    """The same rule for the in-process copy (`update_weights_in_session`) and without partial
    rollouts, where nothing can wait behind a gate: `generate` refuses, naming why, until a
    complete load (from disk here)."""
    from ember_rollout.models import write_tiny_checkpoint

    target = engine()
    target.weight_version = "3"
    embed = target.model.get_input_embeddings().weight

    async def refused() -> None:
        await target.begin_weight_update()
        await target.update_weights_in_session([(EMBED, torch.zeros_like(embed))])
        with pytest.raises(EngineError, match=UNVERSIONED):
            await target.end_weight_update()

    asyncio.run(refused())
    assert target.weight_version is None
    reqs = requests(max_new_tokens=4)
    for generate in (target.generate_sync, target.generate_uncached):
        with pytest.raises(EngineError, match=f"weight-update session .*{UNVERSIONED}"):
            generate(reqs)
    with pytest.raises(EngineError, match=UNVERSIONED):
        asyncio.run(target.generate(reqs))
    # An empty session changes nothing, and does not make the weights whole.
    asyncio.run(target.begin_weight_update())
    asyncio.run(target.end_weight_update())
    with pytest.raises(EngineError, match=UNVERSIONED):
        target.generate_sync(reqs)
    checkpoint = write_tiny_checkpoint(tmp_path / "new", NEW)
    asyncio.run(target.update_weights_from_disk(checkpoint, weight_version="5"))
    assert target.weight_version == "5"
    assert [o.meta_info["weight_version"] for o in target.generate_sync(reqs)] == ["5"] * 4


def test_a_load_outside_a_session_that_stops_partway_leaves_no_version(models):
    """A shape that does not fit is refused before anything is copied: the model and its
    version stay. A copy that fails midway (a tensor whose data cannot be read, last) leaves
    the tensors before it copied: no version names that."""
    _, new_ref = models
    target = engine()
    target.weight_version = "3"
    before = weights(target.model)
    named = list(weights(new_ref.model).items())
    last = named[-1][0]
    misfit = [*named[:-1], (last, torch.zeros(3, 1))]
    with pytest.raises(ValueError, match=rf"{last}.*shape"):
        asyncio.run(target.update_weights_from_tensors(misfit, weight_version="4"))
    assert target.weight_version == "3"
    assert all(torch.equal(v, before[k]) for k, v in target.model.state_dict().items())
    unreadable = [*named[:-1], (last, torch.empty(named[-1][1].shape, device="meta"))]
    with pytest.raises(NotImplementedError, match="meta"):
        asyncio.run(target.update_weights_from_tensors(unreadable, weight_version="4"))
    assert target.weight_version is None
    with pytest.raises(EngineError, match=f"failed after copying part of it.*{UNVERSIONED}"):
        target.generate_sync(requests(max_new_tokens=2))


# -- samples ------------------------------------------------------------------------------------


def prompt_group(reqs: list[GenerateRequest]) -> PromptGroup:
    return PromptGroup(
        record=PromptRecord(prompt="p", source="test:0"),
        prompt_ids=list(reqs[0].input_ids),
        requests=reqs,
        index=0,
    )


def samples_of(target: Engine, reqs, *plugins: object) -> list[Sample]:
    host = None
    if plugins:
        host = EmberPlugins()
        for k, plugin in enumerate(plugins):
            host.register(plugin, f"p{k}")
    groups = LocalGroups(target, toy_tokenizer(), host)
    (samples,) = asyncio.run(groups.generate_groups([prompt_group(reqs)]))
    return samples


def test_samples_carry_the_spans_of_a_single_call_and_of_a_plugins_calls(models):
    reqs = requests(max_new_tokens=12, ignore_eos=True)[:1]
    _, _, _, (sample,) = update_mid_generation(models, samples_of, reqs)
    assert sample.weight_versions == [(0, "0"), (SWITCH, "1")] and sample.weight_version == "0"

    # Two engine calls with tokens inserted between them. Forwards: call 1 is the prefill and
    # the passes after tokens 1 and 2 (it stops at 3); call 2 is the prefill (3), then the
    # held pass 4 after its first token, whose logits draw its second; the new weights draw
    # its third token on, at response position 3 + len(INSERTED) + 2.
    def two_turns(target, reqs):
        return samples_of(target, reqs, TwoTurns(first_turn=3))

    _, _, _, (sample,) = update_mid_generation(models, two_turns, reqs)
    assert sample.weight_versions == [(0, "0"), (3 + len(INSERTED) + 2, "1")]
    assert sample.weight_version == "0" and sample.metadata["engine_calls"] == 2

    # Without partial rollouts the response is one span, of the version the engine serves (an
    # engine serving no version, as models[0], reports no spans at all, partial or not).
    still = engine()
    still.weight_version = "0"
    (plain,) = samples_of(still, reqs)
    assert plain.weight_versions == [(0, "0")] and plain.weight_version == "0"
    (unversioned,) = samples_of(models[0], reqs)
    assert unversioned.weight_versions is None and unversioned.weight_version is None


class RewritesItsCall:
    """One engine call, whose first response token the sample replaces."""

    @hookimpl
    async def ember_generate(self, client, prompt_ids, sampling):
        out = await client.generate(prompt_ids, sample=0)
        first = 3 if out.output_ids[0] != 3 else 4
        return [
            Sample(
                tokens=[*prompt_ids, first, *out.output_ids[1:]],
                response_length=len(out.output_ids),
                rollout_log_probs=list(out.output_log_probs),
                status=out.status,
            )
        ]


def test_a_plugin_that_rewrites_a_calls_output_across_versions_must_give_the_spans(models):
    def rewrites(target, reqs):
        return samples_of(target, reqs, RewritesItsCall())

    with pytest.raises(
        ValueError,
        match=r"^sample 0: its engine calls were generated by weight "
        r"versions \['0', '1'\], and call 0's output is not at response position 0",
    ):
        update_mid_generation(models, rewrites, requests(max_new_tokens=12, ignore_eos=True)[:1])


def span(version: Any, start: Any, end: Any) -> dict[str, Any]:
    return {"version": version, "start": start, "end": end}


class EditedSpans(Engine):
    """The real engine, each answer's `meta_info["weight_versions"]` replaced by `spans`."""

    kind = "hf"

    def __init__(self, inner: HFEngine, spans: Any) -> None:
        self.inner, self.spans = inner, spans

    @property
    def model_info(self):
        return self.inner.model_info

    async def generate(self, requests):
        outputs = await self.inner.generate(requests)
        for out in outputs:
            out.meta_info["weight_version"] = "0"
            out.meta_info["weight_versions"] = self.spans
        return outputs

    async def update_weights_from_tensors(self, named_tensors, *, weight_version=None):
        raise NotImplementedError

    async def update_weights_from_disk(self, path, *, weight_version=None):
        raise NotImplementedError

    async def health(self):
        return True

    async def shutdown(self):
        return None


@pytest.mark.parametrize(
    ("spans", "message"),
    [
        ([span("0", 1, 10)], "from 0 to the response length 10"),
        ([span("0", 0, 4), span("1", 5, 10)], "each starting where the one before ends"),
        ([span("0", 0, 5), span("1", 5, 5), span("0", 5, 10)], "from 0 to the response"),
        ([span("0", 0, 9)], "from 0 to the response length 10"),
        ([span("0", 0, 10), span("1", 10, 11)], "from 0 to the response length 10"),
        ([{"version": 0, "start": 0, "end": 10}], "expected spans"),
        ([{"version": "0", "start": False, "end": 10}], "expected spans"),
        ([[0, "0"]], "expected spans"),
        ([], "expected spans"),
        ("0", "expected spans"),
        ([span("7", 0, 10)], r"\['weight_version'\]='0' is not the last span's version"),
        ([span("0", 0, 5), span("7", 5, 10)], r"is not the last span's version"),
    ],
)
def test_malformed_spans_from_an_engine_are_refused_naming_the_request(models, spans, message):
    reqs = requests(max_new_tokens=10, ignore_eos=True)[:1]
    with pytest.raises(EngineError, match=rf"^sample 0: meta_info.*{message}"):
        samples_of(EditedSpans(models[0], spans), reqs)
