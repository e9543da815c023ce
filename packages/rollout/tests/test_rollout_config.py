"""Config sections of the rollout package: parsing, validation messages, field docs."""

from __future__ import annotations

import dataclasses

import pytest

from ember_core.config import field_docs, from_dict
from ember_rollout import config as cfg
from ember_rollout.engine import SamplingParams


def test_nested_sections_parse_from_strings():
    sections = from_dict(
        cfg.RolloutSections,
        {
            "engine": {
                "kind": "sglang",
                "sglang": {"urls": "http://127.0.0.1:1,http://127.0.0.1:2"},
            },
            "data": {"max_prompt_len": "128", "overlong_prompt": "truncate"},
            "group_sampling": {"dynamic_filter": "true", "over_sampling_batch_size": "16"},
            "reward": {"reward_fn": "math"},
        },
    )
    assert sections.engine.kind == "sglang"
    assert sections.engine.sglang.urls == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert sections.data.max_prompt_len == 128 and sections.data.overlong_prompt == "truncate"
    assert sections.group_sampling.dynamic_filter is True
    assert sections.engine.hf.dtype == "bfloat16", "bf16 is the hf engine's default"


@pytest.mark.parametrize(
    ("section", "data", "message"),
    [
        (cfg.EngineConfig, {"kind": "vllm"}, "kind='vllm': expected one of hf, sglang"),
        (cfg.HFEngineConfig, {"dtype": "int8"}, "dtype: 'int8' is not one of"),
        (cfg.HFEngineConfig, {"max_batch_size": 0}, "max_batch_size=0: expected >= 1"),
        (cfg.HFEngineConfig, {"device": "tpu"}, "device='tpu'"),
        (cfg.SGLangEngineConfig, {"urls": ["localhost:3000"]}, "urls='localhost:3000'"),
        (cfg.SGLangEngineConfig, {"max_retries": -1}, "max_retries=-1"),
        (cfg.SGLangEngineConfig, {"mem_fraction_static": 1.5}, "mem_fraction_static=1.5"),
        (cfg.TinyModelConfig, {"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
        (cfg.TinyModelConfig, {"dense_layers": [7]}, r"dense_layers=\[7\]"),
        (cfg.ToyTaskConfig, {"min_digits": 5, "max_digits": 3}, "max_digits=3"),
        (cfg.DataConfig, {"overlong_prompt": "skip"}, "overlong_prompt: 'skip' is not one of"),
        (cfg.GroupSamplingConfig, {"max_rounds": 0}, "max_rounds=0"),
        (cfg.RewardConfig, {"max_concurrency": 0}, "max_concurrency=0"),
    ],
)
def test_bad_values_name_key_and_value(section, data, message):
    with pytest.raises(ValueError, match=message):
        from_dict(section, data)


def test_nested_error_names_the_dotted_key():
    with pytest.raises(ValueError, match=r"engine\.hf\.tiny\.num_layers"):
        from_dict(cfg.RolloutSections, {"engine": {"hf": {"tiny": {"num_layers": "x"}}}})


def test_every_field_has_a_docstring():
    sections = [
        getattr(cfg, name)
        for name in cfg.__all__
        if dataclasses.is_dataclass(getattr(cfg, name, None))
    ]
    assert len(sections) == 9
    for section in sections:
        names = {f.name for f in dataclasses.fields(section)}
        assert names == set(field_docs(section)), section.__name__
    assert set(field_docs(SamplingParams)) == {f.name for f in dataclasses.fields(SamplingParams)}


def test_sampling_params_validate():
    with pytest.raises(ValueError, match="top_p=0"):
        SamplingParams(max_new_tokens=1, top_p=0)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="top_k=0"):
        SamplingParams(max_new_tokens=1, top_k=0)
