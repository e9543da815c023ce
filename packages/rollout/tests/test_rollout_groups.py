"""Group runners: the generator hands whole prompt groups to a runner (one local engine or a
pool of them), and every sample records the weight version its engine reported."""

from __future__ import annotations

import asyncio

import pytest
from conftest import TINY, make_engine

from ember_core.config import SamplingConfig
from ember_rollout.config import (
    DataConfig,
    EngineConfig,
    HFEngineConfig,
    RolloutSections,
    ToyTaskConfig,
)
from ember_rollout.engine import EngineError
from ember_rollout.rollout import LocalGroups, PromptGroup, RolloutGenerator

SECTIONS = RolloutSections(
    engine=EngineConfig(kind="hf", hf=HFEngineConfig(dtype="float32", tiny=TINY)),
    data=DataConfig(toy=ToyTaskConfig(num_prompts=64, seed=3)),
)
SAMPLING = SamplingConfig(rollout_batch_size=5, n_samples_per_prompt=3, max_response_len=5)


class TwoEngines:
    """A pool of two local engines: groups alternate between them, each call whole groups."""

    kind = "hf"

    def __init__(self, tokenizer, engines):
        self.runners = [LocalGroups(e, tokenizer) for e in engines]
        self.calls: list[list[list[int]]] = [[], []]

    async def generate_groups(self, groups: list[PromptGroup]):
        mine = [[g for g in groups if g.index % 2 == k] for k in range(2)]
        for k, part in enumerate(mine):
            self.calls[k].append([g.index for g in part])
        done = await asyncio.gather(
            *(r.generate_groups(p) for r, p in zip(self.runners, mine, strict=True))
        )
        out = {
            g.index: s
            for part, res in zip(mine, done, strict=True)
            for g, s in zip(part, res, strict=True)
        }
        return [out[g.index] for g in groups]


def local(engine) -> RolloutGenerator:
    return RolloutGenerator.from_config(engine=engine, sampling=SAMPLING, sections=SECTIONS)


def test_samples_record_the_weight_version_their_engine_reported(fp32_engine):
    before = fp32_engine.weight_version
    try:
        fp32_engine.weight_version = "7"
        batch = asyncio.run(local(fp32_engine).generate(0))
        assert {s.weight_version for s in batch.samples} == {"7"}
        fp32_engine.weight_version = None
        batch = asyncio.run(local(fp32_engine).generate(0))
        assert {s.weight_version for s in batch.samples} == {None}
    finally:
        fp32_engine.weight_version = before


def test_groups_spread_over_two_engines_give_the_batch_of_one(fp32_engine):
    one = asyncio.run(local(fp32_engine).generate(0))
    pool_engines = [make_engine("float32"), make_engine("float32")]
    pool = TwoEngines(local(fp32_engine).tokenizer, pool_engines)
    spread = RolloutGenerator.from_config(
        runner=pool, model_info=fp32_engine.model_info, sampling=SAMPLING, sections=SECTIONS
    )
    two = asyncio.run(spread.generate(0))
    assert pool.calls == [[[0, 2, 4]], [[1, 3]]]  # both engines, whole groups each
    # Each request samples from its own seed, so the tokens are the same whatever engine and
    # batch a group ran in; the log-probs agree to float rounding (batch shapes differ).
    assert [(s.index, s.group_index, s.tokens, s.reward) for s in two.samples] == [
        (s.index, s.group_index, s.tokens, s.reward) for s in one.samples
    ]
    for a, b in zip(two.samples, one.samples, strict=True):
        assert a.rollout_log_probs == pytest.approx(b.rollout_log_probs, abs=1e-5)


class Short:
    kind = "hf"

    async def generate_groups(self, groups):
        return [[] for _ in groups[1:]]


def test_a_runner_that_drops_groups_is_an_error_naming_the_round(fp32_engine):
    gen = RolloutGenerator.from_config(
        runner=Short(), model_info=fp32_engine.model_info, sampling=SAMPLING, sections=SECTIONS
    )
    with pytest.raises(EngineError, match=r"rollout 4 round 0: asked for 5 groups of 3, got"):
        asyncio.run(gen.generate(4))


def test_from_config_takes_exactly_one_of_engine_and_runner(fp32_engine):
    with pytest.raises(TypeError, match="exactly one of engine, runner"):
        RolloutGenerator.from_config(sampling=SAMPLING, sections=SECTIONS)
    with pytest.raises(TypeError, match="exactly one of engine, runner"):
        RolloutGenerator.from_config(
            engine=fp32_engine, runner=Short(), sampling=SAMPLING, sections=SECTIONS
        )


def test_prompt_groups_carry_one_seeded_request_per_sample(fp32_engine):
    gen = local(fp32_engine)
    prompts = gen._next_prompts(2)
    groups = gen.prompt_groups(prompts, rollout_id=3, round_id=1)
    assert [g.index for g in groups] == [0, 1]
    for g, group in enumerate(groups):
        assert group.prompt_ids == prompts[g][1] and len(group.requests) == 3
        assert [r.name for r in group.requests] == [
            f"rollout 3 round 1 sample {g * 3 + j} (group {g})" for j in range(3)
        ]
        assert len({r.sampling.seed for r in group.requests}) == 3
