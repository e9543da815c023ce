"""The calc_tool example plugin: its calculator and reward, its config through real run-config
loading, and two-turn rollouts on a real embedded engine."""

from __future__ import annotations

import asyncio
import json
import re
from fractions import Fraction
from pathlib import Path

import pytest

from ember.config import load_config
from ember_calc_tool import SECTION, CalcToolConfig, calc_reward, calculate
from ember_calc_tool import plugin as calc_plugin
from ember_calc_tool.task import CALC, write_task_files
from ember_core.config import CoreConfig, SamplingConfig
from ember_core.plugins import EmberPlugins
from ember_core.types import Sample, SampleStatus
from ember_rollout import RolloutGenerator
from ember_rollout.config import (
    DataConfig,
    EngineConfig,
    HFEngineConfig,
    RewardConfig,
    RolloutSections,
    TinyModelConfig,
)
from ember_rollout.hf_engine import HFEngine
from ember_rollout.models import write_tiny_checkpoint
from ember_rollout.tokenizer import load_tokenizer, toy_tokenizer

CONFIG = "examples/calc_tool.yaml"
DATA = Path(__file__).resolve().parents[1] / "data"
SAMPLING = SamplingConfig(rollout_batch_size=16, n_samples_per_prompt=8, max_response_len=8)


def test_calculator_adds_and_refuses_anything_else():
    assert calculate("3+4") == "7" and calculate("1 + 2 + 30") == "33" and calculate("5") == "5"
    for bad in ("3++4", "+3", "", "3+", "3*4", "?"):
        assert calculate(bad) == "?", bad


def scored(call: list[str], answer: list[str], *, prompt="3 + 4 =", label="7") -> float:
    sample = Sample(
        tokens=[1, 2, 3],
        response_length=1,
        prompt=prompt,
        label=label,
        metadata={SECTION: {"call": call, "answer": answer}},
    )
    return calc_reward(sample)["score"]


def test_reward_counts_the_call_token_by_token_and_the_answer_after_the_right_call():
    assert scored(["3", "+", "4", CALC], ["7"]) == 1.0
    assert scored(["3", "+", "4", CALC], ["8"]) == 4 / 5
    # A wrong call computes the wrong sum; a right answer after it is not the calculator's.
    assert scored(["3", "+", "5", CALC], ["7"]) == 3 / 5
    assert scored(["3", "+", "4", "4", CALC], ["7"]) == 3 / 6  # an extra token costs one
    assert scored(["7", "<eos>"], []) == 0.0  # answering without the calculator earns nothing
    assert scored([], []) == 0.0


def test_reward_names_a_sample_it_cannot_score():
    foreign = Sample(tokens=[1, 2], response_length=1, index=3, group_index=1, label="7")
    with pytest.raises(ValueError, match=r"sample 3 \(group 1\): no 'calc_tool' record"):
        calc_reward(foreign)
    unlabelled = Sample(
        tokens=[1, 2], response_length=1, metadata={SECTION: {"call": [], "answer": []}}
    )
    with pytest.raises(ValueError, match="no label"):
        calc_reward(unlabelled)


def test_checked_in_task_files_are_what_the_task_writes(tmp_path, data_dir):
    fresh = write_task_files(tmp_path)
    assert (data_dir / "prompts.jsonl").read_text() == (fresh / "prompts.jsonl").read_text()
    records = [json.loads(line) for line in (data_dir / "prompts.jsonl").read_text().splitlines()]
    assert len(records) == 25
    # What the task promises, read off the records: every sum `a + b =` of digits 0..4, once,
    # in order, labelled with its value, which is one digit (so one token).
    assert records[0] == {"prompt": "0 + 0 =", "label": "0"}
    assert records[7] == {"prompt": "1 + 2 =", "label": "3"}
    assert records[-1] == {"prompt": "4 + 4 =", "label": "8"}
    pairs = []
    for r in records:
        a, b = re.fullmatch(r"([0-4]) \+ ([0-4]) =", r["prompt"]).groups()
        assert r["label"] == str(int(a) + int(b)) and len(r["label"]) == 1, r
        pairs.append((a, b))
    assert pairs == sorted(set(pairs)) and len(pairs) == 25
    ours = load_tokenizer(data_dir / "tokenizer")
    assert ours.get_vocab() == load_tokenizer(fresh / "tokenizer").get_vocab()
    assert len(ours) == 19 and toy_tokenizer().get_vocab().items() <= ours.get_vocab().items()


# -- the config section, through real run-config loading ---------------------------------------


def test_the_example_config_enables_the_plugin_and_its_section(reset_plugins, repo_root):
    config, plugins = load_config(repo_root / CONFIG)
    assert plugins.enabled == [SECTION] and plugins.has_generate()
    assert config.plugin_sections[SECTION] == CalcToolConfig(max_call_tokens=6)
    tokenizer = load_tokenizer(repo_root / config.data.tokenizer_path)
    assert config.train.model_config().vocab_size == len(tokenizer)
    with pytest.raises(ValueError, match=r"calc_tool.max_call_tokens=1: expected an integer >= 2"):
        load_config(repo_root / CONFIG, overrides=["calc_tool.max_call_tokens=1"])
    with pytest.raises(ValueError, match=r"rollout.max_response_len=7: expected >= 8"):
        load_config(repo_root / CONFIG, overrides=["rollout.max_response_len=7"])


def test_installed_but_not_enabled_the_plugin_takes_no_group(reset_plugins):
    config, plugins = load_config({SECTION: {"max_call_tokens": 5}})
    assert plugins.enabled == [] and not plugins.has_generate()
    assert SECTION not in config.plugin_sections


# -- two-turn rollouts on a real engine --------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """An fp32 embedded engine serving a tiny random Qwen3-MoE over the task's vocabulary."""
    tokenizer = load_tokenizer(DATA / "tokenizer")
    path = write_tiny_checkpoint(
        tmp_path_factory.mktemp("calc_model"),
        TinyModelConfig(num_layers=2, init_seed=3),
        tokenizer=tokenizer,
    )
    engine = HFEngine(HFEngineConfig(model_path=str(path), dtype="float32"))
    engine.load()
    return engine


@pytest.fixture
def host(reset_plugins):
    plugins = EmberPlugins()
    plugins.register(calc_plugin, SECTION)
    plugins.configure(CoreConfig(plugins=[SECTION], rollout=SAMPLING), {SECTION: CalcToolConfig()})
    try:
        yield plugins
    finally:
        plugins.unregister(SECTION)


def rollout(engine, host, data_dir, *, tokenizer=None):
    sections = RolloutSections(
        engine=EngineConfig(kind="hf", hf=HFEngineConfig(dtype="float32")),
        data=DataConfig(
            prompt_data=str(data_dir / "prompts.jsonl"),
            tokenizer_path=str(tokenizer or data_dir / "tokenizer"),
        ),
        reward=RewardConfig(reward_fn="ember_calc_tool.task:calc_reward"),
    )
    generator = RolloutGenerator.from_config(
        engine=engine, sampling=SAMPLING, sections=sections, plugins=host
    )
    return asyncio.run(generator.generate(0)), generator.tokenizer


def hand_reward(prompt: str, call: list[str], answer: list[str]) -> Fraction:
    """calc_reward's documented score, worked out here: the call's tokens that match the right
    call `a + b calc` position by position, plus one for the right answer after the right call,
    over one more than the longer of the two calls."""
    a, b = re.fullmatch(r"([0-9]) \+ ([0-9]) =", prompt).groups()
    right_call = [a, "+", b, "calc"]
    matches = sum(1 for i in range(min(len(call), 4)) if call[i] == right_call[i])
    answered = call == right_call and answer == [str(int(a) + int(b))]
    return Fraction(matches + answered, max(len(call), 4) + 1)


def test_hand_reward_agrees_with_the_worked_examples():
    assert hand_reward("3 + 4 =", ["3", "+", "4", CALC], ["7"]) == 1
    assert hand_reward("3 + 4 =", ["3", "+", "5", CALC], ["7"]) == Fraction(3, 5)
    assert hand_reward("3 + 4 =", ["3", "+", "4", "4", CALC], ["7"]) == Fraction(3, 6)


def test_the_calculators_output_is_inserted_with_loss_mask_zero(
    engine, host, data_dir, calculator_output
):
    batch, tokenizer = rollout(engine, host, data_dir)
    vocab = tokenizer.get_vocab()
    called = 0
    for s in batch.samples:
        record = s.metadata[SECTION]
        # The toy tokenizer has one token per character: "3 + 4 =" is 3, +, 4, =.
        prompt = [vocab[c] for c in str(s.prompt).replace(" ", "")]
        response = s.tokens[s.prompt_length :]
        assert s.tokens[: s.prompt_length] == prompt
        assert response[: len(record["call"])] == [vocab[t] for t in record["call"]]
        words = tokenizer.convert_ids_to_tokens(response)
        if CALC not in words:  # never called: every response token is the model's
            assert s.loss_mask == [1] * s.response_length and "output" not in record
            assert record["call"] == words and record["answer"] == []
            assert s.reward == float(hand_reward(str(s.prompt), words, [])), words
            continue
        called += 1
        call = words[: words.index(CALC) + 1]
        assert record["call"] == call
        # The calculator's answer to this call, as characters, then one token of the model's.
        output = [vocab[c] for c in calculator_output(call)]
        answer = response[len(call) + len(output) :]
        assert response == [vocab[t] for t in call] + output + answer, (words, s.loss_mask)
        assert len(answer) == 1
        assert s.loss_mask == [1] * len(call) + [0] * len(output) + [1]
        assert s.rollout_log_probs[len(call) : len(call) + len(output)] == [0.0] * len(output)
        assert all(lp < 0 for lp, m in zip(s.rollout_log_probs, s.loss_mask, strict=True) if m)
        assert s.status == SampleStatus.COMPLETED and s.metadata["engine_calls"] == 2
        # Both sides divide two small integers, which IEEE 754 rounds correctly: exact.
        expected = hand_reward(str(s.prompt), call, tokenizer.convert_ids_to_tokens(answer))
        assert s.reward == float(expected), (words, s.reward, expected)
    # An untrained model ends its first turn with `calc` often enough to call.
    assert called >= 10, called
    assert batch.metrics["rollout/loss_tokens_mean"] < batch.metrics["rollout/response_len_mean"]


def test_a_tokenizer_without_calc_is_named(engine, host, data_dir, tmp_path):
    toy_tokenizer().save_pretrained(tmp_path / "toy")
    with pytest.raises(ValueError, match=r"no 'calc' token; set data.tokenizer_path"):
        rollout(engine, host, data_dir, tokenizer=tmp_path / "toy")
