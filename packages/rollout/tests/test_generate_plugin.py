"""`ember_generate`: a plugin owns the generation of each prompt group through an engine client
on the real embedded engine; its samples are checked, numbered and batched like built-in ones."""

from __future__ import annotations

import asyncio
import math

import pytest
from conftest import TINY

from ember_core.config import SamplingConfig
from ember_core.hookspecs import hookimpl
from ember_core.plugins import EmberPlugins
from ember_core.types import Sample, SampleStatus
from ember_rollout.config import (
    DataConfig,
    EngineConfig,
    HFEngineConfig,
    RolloutSections,
    ToyTaskConfig,
)
from ember_rollout.rollout import RolloutGenerator

SECTIONS = RolloutSections(
    engine=EngineConfig(kind="hf", hf=HFEngineConfig(dtype="float32", tiny=TINY)),
    data=DataConfig(toy=ToyTaskConfig(num_prompts=64, seed=5)),
)
SAMPLING = SamplingConfig(rollout_batch_size=4, n_samples_per_prompt=3, max_response_len=12)
INSERTED = [2, 3, 4]
"""What the two-turn plugin inserts after the first turn (the digits 0 1 2): 'tool output'."""


class TwoTurns:
    """Generates up to 3 tokens, inserts `INSERTED`, then generates the rest of the budget."""

    def __init__(self, first_turn: int = 3) -> None:
        self.first_turn = first_turn

    @hookimpl
    async def ember_generate(self, client, prompt_ids, sampling, routed_experts):
        async def one(j: int) -> Sample:
            first = await client.generate(prompt_ids, sample=j, max_new_tokens=self.first_turn)
            context = [*prompt_ids, *first.output_ids, *INSERTED]
            used = len(first.output_ids) + len(INSERTED)
            second = await client.generate(
                context, sample=j, max_new_tokens=sampling.max_new_tokens - used
            )
            generated = len(second.output_ids)
            return Sample(
                tokens=[*context, *second.output_ids],
                response_length=used + generated,
                loss_mask=[1] * len(first.output_ids) + [0] * len(INSERTED) + [1] * generated,
                rollout_log_probs=[
                    *first.output_log_probs,
                    *[math.nan] * len(INSERTED),
                    *second.output_log_probs,
                ],
                rollout_routed_experts=second.routed_experts,
                status=second.status,
                metadata={"first": list(first.output_ids), "second": list(second.output_ids)},
            )

        return await asyncio.gather(*(one(j) for j in range(sampling.n)))


class Declines:
    @hookimpl
    def ember_generate(self):
        return None


class SingleTurn:
    """The built-in generation written as a plugin: one call per sample, nothing inserted."""

    @hookimpl
    async def ember_generate(self, client, prompt_ids, sampling):
        samples = []
        for j in range(sampling.n):
            out = await client.generate(prompt_ids, sample=j)
            samples.append(
                Sample(
                    tokens=[*prompt_ids, *out.output_ids],
                    response_length=len(out.output_ids),
                    rollout_log_probs=list(out.output_log_probs),
                    status=out.status,
                )
            )
        return samples


class AsksForExperts:
    @hookimpl
    def ember_rollout_request_fields(self):
        return {"return_routed_experts": True}


def rollout(engine, *plugins, sampling=SAMPLING, rollout_id=0):
    host = EmberPlugins()
    for k, plugin in enumerate(plugins):
        host.register(plugin, f"p{k}")
    generator = RolloutGenerator.from_config(
        engine=engine, sampling=sampling, sections=SECTIONS, plugins=host
    )
    return asyncio.run(generator.generate(rollout_id)), generator


def test_without_a_taker_the_built_in_generation_runs(fp32_engine):
    builtin, _ = rollout(fp32_engine)
    declined, _ = rollout(fp32_engine, Declines())
    as_plugin, _ = rollout(fp32_engine, SingleTurn())
    for other in (declined, as_plugin):
        assert [s.tokens for s in other.samples] == [s.tokens for s in builtin.samples]
        assert [s.reward for s in other.samples] == [s.reward for s in builtin.samples]
        for a, b in zip(other.samples, builtin.samples, strict=True):
            assert a.rollout_log_probs == pytest.approx(b.rollout_log_probs, abs=1e-5)
            assert (a.index, a.group_index, a.status) == (b.index, b.group_index, b.status)


def test_two_turn_samples_carry_inserted_tokens_masked_and_every_position_routed(fp32_engine):
    batch, generator = rollout(fp32_engine, TwoTurns(), AsksForExperts())
    info, tokenizer = fp32_engine.model_info, generator.tokenizer
    assert len(batch.samples) == 12
    for k, s in enumerate(batch.samples):
        assert (s.index, s.group_index) == (k, k // 3)
        first, second = s.metadata["first"], s.metadata["second"]
        response = s.tokens[s.prompt_length :]
        assert response == [*first, *INSERTED, *second]
        assert s.loss_mask == [1] * len(first) + [0] * 3 + [1] * len(second)
        assert all(math.isnan(v) for v in s.rollout_log_probs[len(first) : len(first) + 3])
        assert s.metadata["engine_calls"] == 2 and s.reward is not None
        assert s.response == tokenizer.decode(response, skip_special_tokens=True)
        # One row per forwarded position, inserted ones included.
        assert s.rollout_routed_experts.shape == (len(s.tokens) - 1, info.num_layers, info.topk)
    # Counted tokens: the generated ones only.
    loss_tokens = sum(sum(s.loss_mask) for s in batch.samples) / 12
    assert batch.metrics["rollout/loss_tokens_mean"] == pytest.approx(loss_tokens)
    assert batch.metrics["rollout/response_len_mean"] > loss_tokens


def test_engine_calls_of_all_groups_go_out_together(fp32_engine, monkeypatch):
    sizes: list[int] = []
    generate = fp32_engine.generate

    async def counted(requests):
        sizes.append(len(requests))
        return await generate(requests)

    monkeypatch.setattr(fp32_engine, "generate", counted)
    rollout(fp32_engine, TwoTurns())
    assert sizes == [12, 12]  # two turns, each one batch of 4 groups x 3 samples


def test_a_rerun_repeats_the_samples_and_samples_of_a_group_differ(fp32_engine):
    a, _ = rollout(fp32_engine, TwoTurns())
    b, _ = rollout(fp32_engine, TwoTurns())
    assert [s.tokens for s in a.samples] == [s.tokens for s in b.samples]
    group = a.samples[:3]
    assert (
        len({tuple(s.metadata["second"]) for s in group}) > 1
        or len({tuple(s.metadata["first"]) for s in group}) > 1
    )


def test_evaluation_goes_through_the_plugin(fp32_engine):
    _, generator = rollout(fp32_engine, TwoTurns())
    records = generator.dataset.records[:2]
    metrics = asyncio.run(
        generator.evaluate("toy", records, rollout_id=0, temperature=1.0, samples_per_prompt=2)
    )
    assert metrics["eval/toy/samples"] == 4.0
    assert metrics["eval/toy/response_length"] > len(INSERTED)


# -- what a plugin returns is checked, naming the sample and the field --------------------------


class Broken:
    """Returns two-turn samples with one thing broken by `edit(sample)`."""

    def __init__(self, edit, first_turn: int = 3) -> None:
        self.edit = edit
        self.inner = TwoTurns(first_turn)

    @hookimpl
    async def ember_generate(self, client, prompt_ids, sampling, routed_experts):
        samples = await self.inner.ember_generate(client, prompt_ids, sampling, routed_experts)
        return self.edit(list(samples))


def nth(k, change):
    def edit(samples):
        change(samples[k])
        return samples

    return edit


def set_field(name, value):
    return lambda s: setattr(s, name, value(s) if callable(value) else value)


@pytest.mark.parametrize(
    ("edit", "experts", "message"),
    [
        (lambda s: s[:2], False, r"round 0 group 0: expected a list of n = 3 samples, got 2"),
        (nth(1, set_field("tokens", lambda s: [0, *s.tokens])), False, "sample 1 .*start with"),
        (
            nth(2, set_field("response_length", lambda s: s.response_length - 1)),
            False,
            r"sample 2 \(group 0\).*tokens do not start with the prompt",
        ),
        (nth(0, set_field("loss_mask", lambda s: s.loss_mask[1:])), False, "sample 0.*loss_mask"),
        (nth(0, set_field("rollout_log_probs", None)), False, "sample 0.*rollout_log_probs is"),
        (
            nth(1, lambda s: s.rollout_log_probs.__setitem__(0, math.nan)),
            False,
            r"sample 1 .*rollout_log_probs\[0\]=nan at a generated token",
        ),
        (nth(0, set_field("status", SampleStatus.PENDING)), False, "sample 0.*status='pending'"),
        (nth(2, set_field("tokens", lambda s: [*s.tokens[:-1], 999])), False, "sample 2.*999"),
        (
            nth(0, set_field("rollout_routed_experts", None)),
            True,
            "sample 0.*rollout_routed_experts is None, but the run replays routing",
        ),
        (
            nth(1, set_field("rollout_routed_experts", lambda s: s.rollout_routed_experts[1:])),
            True,
            r"sample 1 .*rollout_routed_experts has shape \[\d+, 3, 2\], expected",
        ),
        (
            nth(1, set_field("rollout_routed_experts", lambda s: s.rollout_routed_experts[:, :2])),
            True,
            r"sample 1 .*rollout_routed_experts has shape \[\d+, 2, 2\], "
            r"expected .* = \[\d+, 3, 2\]",
        ),
        (
            nth(1, set_field("rollout_routed_experts", lambda s: s.rollout_routed_experts.float())),
            True,
            r"sample 1 .*rollout_routed_experts must be an integer tensor",
        ),
        (lambda s: [*s[:2], "sample"], False, r"sample 2 \(group 0\): expected an ember_core"),
    ],
)
def test_a_broken_sample_is_named_with_its_field(fp32_engine, edit, experts, message):
    plugins = [Broken(edit)] + ([AsksForExperts()] if experts else [])
    with pytest.raises(ValueError, match=message):
        rollout(fp32_engine, *plugins)


def test_a_response_over_the_length_limit_is_refused(fp32_engine):
    class InsertsAtTheEnd:
        @hookimpl
        async def ember_generate(self, client, prompt_ids, sampling):
            samples = []
            for j in range(sampling.n):
                out = await client.generate(prompt_ids, sample=j)
                inserted = [2] * sampling.max_new_tokens
                samples.append(
                    Sample(
                        tokens=[*prompt_ids, *out.output_ids, *inserted],
                        response_length=len(out.output_ids) + len(inserted),
                        loss_mask=[1] * len(out.output_ids) + [0] * len(inserted),
                        rollout_log_probs=[*out.output_log_probs, *[0.0] * len(inserted)],
                        status=SampleStatus.TRUNCATED,
                    )
                )
            return samples

    with pytest.raises(ValueError, match=r"sample 0 .*exceeds rollout.max_response_len=12"):
        rollout(fp32_engine, InsertsAtTheEnd())


def test_the_client_names_a_bad_sample_index(fp32_engine):
    class Outside:
        @hookimpl
        async def ember_generate(self, client, prompt_ids, sampling):
            await client.generate(prompt_ids, sample=sampling.n)

    with pytest.raises(ValueError, match=r"sample=3: the group has 3 samples \(0 \.\. 2\)"):
        rollout(fp32_engine, Outside())
