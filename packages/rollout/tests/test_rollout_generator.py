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
from ember_rollout.rollout import RolloutGenerator
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
