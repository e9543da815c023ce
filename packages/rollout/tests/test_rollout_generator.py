"""Rollout batches end to end on the real hf engine: groups, rewards, filter, plugins, metrics."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from conftest import TINY

from ember_core import hookimpl
from ember_core.config import SamplingConfig
from ember_core.plugins import EmberPlugins
from ember_core.types import SampleStatus
from ember_rollout.config import (
    DataConfig,
    EngineConfig,
    GroupSamplingConfig,
    HFEngineConfig,
    RewardConfig,
    RolloutSections,
    ToyTaskConfig,
)
from ember_rollout.rewards import register_reward
from ember_rollout.rollout import RolloutGenerator, prompts_of
from ember_rollout.toy_task import toy_score


def sampling(**kw):
    defaults = dict(rollout_batch_size=3, n_samples_per_prompt=4, max_response_len=6, seed=5)
    return SamplingConfig(**{**defaults, **kw})


def generator(engine, *, data=None, reward="toy", group_sampling=None, plugins=None, **kw):
    sections = RolloutSections(
        engine=EngineConfig(kind="hf", hf=HFEngineConfig(dtype="float32", tiny=TINY)),
        data=data or DataConfig(toy=ToyTaskConfig(num_prompts=64, seed=2)),
        reward=RewardConfig(reward_fn=reward),
        group_sampling=group_sampling or GroupSamplingConfig(),
    )
    return RolloutGenerator.from_config(
        engine=engine, sampling=sampling(**kw), sections=sections, plugins=plugins
    )


def test_toy_rollout_groups_samples_rewards_and_metrics(fp32_engine):
    gen = generator(fp32_engine)
    batch = asyncio.run(gen.generate(rollout_id=0))
    samples = batch.samples
    assert len(samples) == 12
    assert [s.index for s in samples] == list(range(12))
    assert [s.group_index for s in samples] == [g for g in range(3) for _ in range(4)]
    for group in range(3):
        members = samples[group * 4 : group * 4 + 4]
        assert len({tuple(s.tokens[: s.prompt_length]) for s in members}) == 1
        assert len({s.label for s in members}) == 1
    for s in samples:
        response = s.tokens[s.prompt_length :]
        assert 1 <= s.response_length <= 6 and len(s.rollout_log_probs) == s.response_length
        assert s.prompt.endswith("=") and s.label.isdigit()
        stopped = s.status == SampleStatus.COMPLETED
        assert s.reward == toy_score(s.response, s.label, stopped=stopped)
        assert s.response == gen.tokenizer.decode(response, skip_special_tokens=True)
        eos = gen.tokenizer.eos_token_id
        expected = SampleStatus.COMPLETED if response[-1] == eos else SampleStatus.TRUNCATED
        assert s.status == expected and s.metadata["source"].startswith("toy:")
    m = batch.metrics
    lengths = [s.response_length for s in samples]
    assert m["rollout/response_len_mean"] == pytest.approx(sum(lengths) / 12)
    assert m["rollout/response_len_max"] == max(lengths)
    assert m["rollout/rewards"] == pytest.approx(sum(s.reward for s in samples) / 12)
    assert m["rollout/truncated_ratio"] == pytest.approx(
        sum(s.status == SampleStatus.TRUNCATED for s in samples) / 12
    )
    assert m["rollout/dropped_groups"] == 0 and m["rollout/sampling_rounds"] == 1
    assert m["perf/rollout_tokens_per_s"] > 0 and m["perf/rollout_time_s"] > 0
    assert all(k.startswith(("rollout/", "perf/")) for k in m)


def test_same_seed_same_batch_and_next_rollout_differs(fp32_engine):
    a = asyncio.run(generator(fp32_engine).generate(0)).samples
    b = asyncio.run(generator(fp32_engine).generate(0)).samples
    gen = generator(fp32_engine)
    asyncio.run(gen.generate(0))
    c = asyncio.run(gen.generate(1)).samples
    assert [s.tokens for s in a] == [s.tokens for s in b]
    assert [s.tokens for s in a] != [s.tokens for s in c]


def test_resuming_from_state_dict_continues_the_same_stream(fp32_engine):
    gen = generator(fp32_engine)
    asyncio.run(gen.generate(0))
    state = gen.state_dict()
    expected = asyncio.run(gen.generate(1)).samples
    resumed = generator(fp32_engine)
    resumed.load_state_dict(state)
    assert [s.tokens for s in asyncio.run(resumed.generate(1)).samples] == [
        s.tokens for s in expected
    ]


def test_a_rollout_generated_again_from_its_prompts_is_the_same_rollout(fp32_engine):
    """`generate(rollout_id, prompts=prompts_of(samples))` (a restored rollout generated again)
    asks the same prompts, in the same groups, with the same request seeds, and leaves the
    prompt stream where it was: on the same weights it is the same rollout, and the next one
    is the one that would have followed."""
    gen = generator(fp32_engine, data=DataConfig(toy=ToyTaskConfig(num_prompts=64, seed=2)))
    first = asyncio.run(gen.generate(3)).samples
    state = gen.state_dict()
    prompts = prompts_of(first)
    assert [record.label for record, _ in prompts] == [s.label for s in first[::4]]
    again = asyncio.run(gen.generate(3, prompts=prompts)).samples
    assert gen.state_dict() == state
    fields = ("tokens", "prompt", "label", "group_index", "rollout_log_probs", "metadata")
    for a, b in zip(first, again, strict=True):
        assert {f: getattr(a, f) for f in fields} == {f: getattr(b, f) for f in fields}
    follows = generator(fp32_engine)
    asyncio.run(follows.generate(3))
    want = asyncio.run(follows.generate(4)).samples
    assert [s.tokens for s in asyncio.run(gen.generate(4)).samples] == [s.tokens for s in want]


class RoutingProbe:
    """Asks for routed experts and records what `process_sample` receives."""

    def __init__(self):
        self.seen = []

    @hookimpl
    def ember_rollout_request_fields(self, engine):
        return {"return_routed_experts": True}

    @hookimpl
    def ember_process_sample(self, sample, meta_info, engine):
        self.seen.append((sample.index, engine, sorted(meta_info)))


def test_plugin_request_fields_and_process_sample(fp32_engine):
    probe = RoutingProbe()
    plugins = EmberPlugins()
    plugins.register(probe, "probe")
    batch = asyncio.run(generator(fp32_engine, plugins=plugins).generate(0))
    assert len(probe.seen) == 12 and {e for _, e, _ in probe.seen} == {"hf"}
    for *_, keys in probe.seen:
        assert "routed_experts" in keys and "output_token_logprobs" in keys
    for s in batch.samples:
        experts = s.rollout_routed_experts
        assert experts.shape == (len(s.tokens) - 1, TINY.num_layers, TINY.num_experts_per_tok)
        assert experts.dtype == torch.int32


@register_reward("test_flat_groups", group=True)
def flat_groups(samples):
    """Groups of prompts labelled "flat" get equal rewards (no signal); others do not."""
    if samples[0].label == "flat":
        return [0.5] * len(samples)
    return [float(i % 2) for i in range(len(samples))]


def labelled_data(tmp_path, labels):
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"copy {i}{i} =", "label": label} for i, label in enumerate(labels)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return DataConfig(prompt_data=str(path), shuffle=False)


def test_dynamic_filter_drops_flat_groups_and_over_samples(fp32_engine, tmp_path):
    data = labelled_data(tmp_path, ["flat", "ok", "flat", "flat", "ok", "ok", "ok", "flat"])
    gs = GroupSamplingConfig(dynamic_filter=True, over_sampling_batch_size=4)
    batch = asyncio.run(
        generator(fp32_engine, data=data, reward="test_flat_groups", group_sampling=gs).generate(0)
    )
    labels = [batch.samples[g * 4].label for g in range(3)]
    assert labels == ["ok", "ok", "ok"]
    m = batch.metrics
    assert m["rollout/sampling_rounds"] == 2 and m["rollout/dropped_groups"] == 4
    assert m["rollout/unused_groups"] == 1 and m["rollout/zero_std_ratio"] == pytest.approx(4 / 8)


@pytest.mark.parametrize("policy", ["backfill", "partial", "error"])
def test_shortfall_policies(fp32_engine, tmp_path, policy):
    data = labelled_data(tmp_path, ["flat", "ok", "flat"])
    gs = GroupSamplingConfig(dynamic_filter=True, max_rounds=1, on_shortfall=policy)
    gen = generator(fp32_engine, data=data, reward="test_flat_groups", group_sampling=gs)
    if policy == "error":
        with pytest.raises(RuntimeError, match="1 of 3 groups kept after 1 rounds"):
            asyncio.run(gen.generate(0))
        return
    batch = asyncio.run(gen.generate(0))
    groups = len(batch.samples) // 4
    assert groups == (3 if policy == "backfill" else 1)
    assert batch.metrics["rollout/backfilled_groups"] == (2 if policy == "backfill" else 0)


def test_overlong_prompts_counted_in_metrics(fp32_engine, tmp_path):
    data = labelled_data(tmp_path, ["a", "b", "c"])
    data.max_prompt_len, data.overlong_prompt = 3, "truncate"
    batch = asyncio.run(generator(fp32_engine, data=data, reward="test_flat_groups").generate(0))
    assert batch.metrics["rollout/prompts_truncated"] == 3
    assert all(s.prompt_length == 3 for s in batch.samples)
    data.overlong_prompt = "error"
    with pytest.raises(ValueError, match=r"prompts.jsonl:1: the prompt has 4 tokens"):
        asyncio.run(generator(fp32_engine, data=data, reward="test_flat_groups").generate(0))


def test_evaluation_samples_each_prompt_n_times_at_its_temperature_and_scores_them(fp32_engine):
    from ember_rollout.data import load_eval_sets

    data = DataConfig(toy=ToyTaskConfig(num_prompts=64, seed=2))
    gen = generator(fp32_engine, data=data)
    records = load_eval_sets({}, data, prompts=5)["toy"]
    requests, scored = [], []
    runner, scorer = gen.runner.generate_groups, gen.scorer.score_groups

    async def record_requests(groups):
        requests.extend(r for g in groups for r in g.requests)
        return await runner(groups)

    async def record_scores(groups):
        await scorer(groups)
        scored.extend(groups)

    gen.runner.generate_groups, gen.scorer.score_groups = record_requests, record_scores
    position = gen.state_dict()
    metrics = asyncio.run(
        gen.evaluate("toy", records, rollout_id=4, temperature=0.05, samples_per_prompt=3)
    )
    assert len(requests) == 15 and {r.sampling.temperature for r in requests} == {0.05}
    assert [g[0].prompt for g in scored] == [r.prompt for r in records]
    samples = [s for g in scored for s in g]
    assert metrics["eval/toy/samples"] == 15
    assert metrics["eval/toy/reward"] == pytest.approx(sum(s.reward for s in samples) / 15)
    assert metrics["eval/toy/pass@3"] == pytest.approx(
        sum(any(s.reward >= 1.0 for s in g) for g in scored) / 5
    )
    assert set(metrics) == {
        f"eval/toy/{k}"
        for k in ("reward", "response_length", "truncated_ratio", "samples", "pass@3")
    }
    # Evaluation moves no prompt-stream position and draws seeds apart from the rollouts'.
    assert gen.state_dict() == position
    rollout_seeds = {
        r.sampling.seed
        for g in gen.prompt_groups([(r, [1, 2]) for r in records], 4, 0)
        for r in g.requests
    }
    assert not rollout_seeds & {r.sampling.seed for r in requests}
    one = asyncio.run(
        gen.evaluate("toy", records, rollout_id=4, temperature=0.05, samples_per_prompt=1)
    )
    assert "eval/toy/pass@1" not in one and one["eval/toy/samples"] == 5


def test_eval_sets_are_the_toy_task_drawn_again_or_named_files(tmp_path):
    from ember_rollout.data import load_eval_sets, load_prompts

    data = DataConfig(toy=ToyTaskConfig(num_prompts=64, seed=2))
    (toy,) = load_eval_sets({}, data, prompts=7).values()
    assert len(toy) == 7 and [r.prompt for r in toy] != [r.prompt for r in load_prompts(data)[:7]]
    path = tmp_path / "held.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"q{i}", "label": str(i)}) + "\n" for i in range(9))
    )
    sets = load_eval_sets({"held": str(path), "toy": "toy"}, data, prompts=4)
    assert [r.label for r in sets["held"]] == ["0", "1", "2", "3"] and len(sets["toy"]) == 4
    with pytest.raises(ValueError, match=r"run.eval_sets.gone='.*gone.jsonl': no such file"):
        load_eval_sets({"gone": str(tmp_path / "gone.jsonl")}, data, prompts=4)
    on_file = DataConfig(prompt_data=str(path))
    with pytest.raises(ValueError, match=r"run.eval_sets: empty, and the run trains on"):
        load_eval_sets({}, on_file, prompts=4)
