"""Config sections: typed parsing, overrides as strings, and validation messages."""

from __future__ import annotations

import dataclasses

import pytest

from ember_core.config import (
    AlgorithmConfig,
    CIConfig,
    CoreConfig,
    SamplingConfig,
    field_docs,
    from_dict,
    to_dict,
)


def test_defaults_are_valid_and_round_trip():
    config = CoreConfig()
    assert from_dict(CoreConfig, to_dict(config)) == config


def test_nested_sections_parse_and_coerce_strings():
    config = from_dict(
        CoreConfig,
        {
            "rollout": {"temperature": "0.7", "top_k": "20", "n_samples_per_prompt": 8},
            "algorithm": {"eps_clip_high": "0.28", "use_kl_loss": "true", "eps_clip_c": "null"},
            "plugins": "r3_routing,ci_kl_checker",
            "ci": {"test": "yes"},
        },
    )
    assert config.rollout.temperature == 0.7 and config.rollout.top_k == 20
    assert config.algorithm.eps_clip_high == 0.28 and config.algorithm.use_kl_loss is True
    assert config.algorithm.eps_clip_c is None
    assert config.plugins == ["r3_routing", "ci_kl_checker"]
    assert config.ci.test is True


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"rollout": {"temperature": 0}}, "rollout.temperature=0.0: expected a finite number > 0"),
        ({"rollout": {"temperature": "hot"}}, "rollout.temperature: expected a number, got 'hot'"),
        ({"rollout": {"top_p": 1.5}}, "rollout.top_p=1.5: expected 0 < top_p <= 1"),
        ({"rollout": {"top_k": 0}}, "rollout.top_k=0: expected -1 (off) or >= 1"),
        ({"rollout": {"n_samples_per_prompt": 2.5}}, "expected an integer, got 2.5"),
        ({"rollout": {"temprature": 1}}, "rollout.temprature: unknown key; known keys here: "),
        (
            {"algorithm": {"advantage_estimator": "grpoo"}},
            "advantage_estimator='grpoo': expected one of ",
        ),
        ({"algorithm": {"kl_loss_type": "k9"}}, "kl_loss_type='k9': expected one of "),
        ({"algorithm": {"eps_clip_c": 0.5}}, "eps_clip_c=0.5: expected > 1"),
        (
            {"algorithm": {"loss_reduction": "batch"}},
            "algorithm.loss_reduction: 'batch' is not one of",
        ),
        (
            {"algorithm": {"tis_clip_low": 3.0}},
            "tis_clip_low=3.0: expected 0 <= tis_clip_low < tis_clip",
        ),
        ({"ci": {"test": "maybe"}}, "ci.test: expected true or false, got 'maybe'"),
        ({"plugins": ["r3 routing"]}, "plugins='r3 routing'"),
    ],
)
def test_bad_values_name_key_value_and_what_is_allowed(data, message):
    with pytest.raises(ValueError) as info:
        from_dict(CoreConfig, data)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_unknown_estimator_lists_the_registered_ones():
    with pytest.raises(ValueError, match="grpo.*gspo.*ppo.*reinforce_plus_plus"):
        AlgorithmConfig(advantage_estimator="nope")


def test_every_field_has_a_docstring():
    for cls in (SamplingConfig, AlgorithmConfig, CIConfig, CoreConfig):
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{cls.__name__} fields without a docstring: {missing}"
