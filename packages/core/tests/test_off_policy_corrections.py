"""Sequence-level TIS and the named off-policy corrections, against hand computation."""

from __future__ import annotations

import math

import pytest
import torch

from ember_core.algorithms import (
    OFF_POLICY_CORRECTIONS,
    TIS_LEVELS,
    reduce_loss,
    tis_policy_loss,
    tis_weights,
)
from ember_core.config import AlgorithmConfig, CoreConfig, from_dict, to_dict

LOW, HIGH = 0.5, 2.0

# Four samples of 3, 1, 4 and 2 response tokens; sample 0's middle token is not counted and
# carries a log-ratio large enough to push its sample out of the band if it were summed, and
# sample 3 has no counted token at all.
LENGTHS = [3, 1, 4, 2]
MASK = [1, 0, 1, 1, 1, 1, 1, 1, 0, 0]
LOG_RATIO = [0.4, 9.0, -1.0, 0.9, -0.35, 0.0, 0.3, 0.25, 5.0, -5.0]
ADVANTAGES = [1.0, 1.0, 1.0, -1.0, -0.5, 0.5, 1.5, -1.0, 2.0, 2.0]


def t(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def bound(ratio: float, mode: str) -> float:
    if mode == "truncate":
        return min(max(ratio, LOW), HIGH)
    return ratio if LOW <= ratio <= HIGH else 0.0


def hand_sequence_ratios() -> list[float]:
    """Per token: exp of its sample's log-ratio summed over the sample's counted tokens."""
    ratios, start = [], 0
    for length in LENGTHS:
        total = sum(LOG_RATIO[j] for j in range(start, start + length) if MASK[j])
        ratios += [math.exp(total)] * length
        start += length
    return ratios


def close(actual: torch.Tensor, expected: list[float], tol: float = 1e-12) -> None:
    assert actual.shape == (len(expected),)
    assert torch.allclose(actual.double(), t(expected), atol=tol, rtol=tol), (actual, expected)


def test_levels_and_corrections_are_registered_by_name():
    assert TIS_LEVELS.names() == ["sequence", "token"]
    names = ["behaviour_clip", "decoupled", "mis", "seq_tis", "tis"]
    assert OFF_POLICY_CORRECTIONS.names() == names


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_sequence_weights_bound_each_samples_summed_ratio(mode):
    rollout = t([-0.2 * j - 0.5 for j in range(len(MASK))])
    old = rollout + t(LOG_RATIO)
    weights, metrics = tis_weights(
        old.requires_grad_(),
        rollout,
        tis_clip=HIGH,
        tis_clip_low=LOW,
        mode=mode,
        level="sequence",
        loss_mask=t(MASK),
        lengths=LENGTHS,
    )
    ratios = hand_sequence_ratios()
    # exp(-0.6), exp(0.9), exp(0.2), exp(0): inside, above, inside, inside (no counted token).
    assert [round(r, 4) for r in ratios[::3][:2]] == [0.5488, 2.4596]
    close(weights, [bound(r, mode) for r in ratios])
    close(metrics["tis"], ratios)
    out = {"truncate": "tis_clipfrac", "mask": "tis_maskfrac"}[mode]
    close(metrics[out], [float(not LOW <= r <= HIGH) for r in ratios])
    assert not weights.requires_grad
    # The token level of the same inputs bounds each token's own ratio.
    per_token, _ = tis_weights(old, rollout, tis_clip=HIGH, tis_clip_low=LOW, mode=mode)
    close(per_token, [bound(math.exp(x), mode) for x in LOG_RATIO])


def test_sequence_weights_below_the_band():
    # One sample, two tokens: exp(-0.6 - 0.5) = 0.33 < LOW.
    rollout, old = t([-1.0, -1.0]), t([-1.6, -1.5])
    for mode, expected in (("truncate", LOW), ("mask", 0.0)):
        weights, metrics = tis_weights(
            old,
            rollout,
            tis_clip=HIGH,
            tis_clip_low=LOW,
            mode=mode,
            level="sequence",
            loss_mask=t([1, 1]),
            lengths=[2],
        )
        close(weights, [expected, expected])
        close(metrics["tis"], [math.exp(-1.1)] * 2)


def test_a_long_sequence_ratio_stays_finite_in_float32():
    # 200 tokens of log-ratio +-1: exp(+-200) is outside float32's range.
    for sign, expected_weight in ((1.0, HIGH), (-1.0, LOW)):
        rollout = torch.zeros(200, dtype=torch.bfloat16)
        old = torch.full((200,), sign, dtype=torch.bfloat16)
        weights, metrics = tis_weights(
            old,
            rollout,
            tis_clip=HIGH,
            tis_clip_low=LOW,
            level="sequence",
            loss_mask=torch.ones(200),
            lengths=[200],
        )
        assert weights.dtype == torch.float32 and metrics["tis"].dtype == torch.float32
        assert torch.isfinite(metrics["tis"]).all()
        assert torch.equal(weights, torch.full((200,), expected_weight))
        assert metrics["tis"][0].item() == pytest.approx(1e30 if sign > 0 else 1e-30, rel=1e-5)
        assert metrics["tis_clipfrac"].eq(1).all()
        # The reduction of the ratio metric stays finite too.
        assert math.isfinite(reduce_loss(metrics["tis"], torch.ones(200), [200]).item())


def test_the_sequence_level_needs_the_mask_and_lengths():
    with pytest.raises(ValueError, match="TIS level 'sequence' needs the loss mask"):
        tis_weights(t([0.0]), t([0.0]), tis_clip=2.0, level="sequence")
    with pytest.raises(ValueError, match="TIS level 'samples'"):
        tis_weights(t([0.0]), t([0.0]), tis_clip=2.0, level="samples")


def test_sequence_tis_with_the_engine_as_old_policy_weighs_every_token_by_its_sample():
    """Bypass at the sequence level: L_t = -w_i * A_t in value and in gradient, w_i the
    bounded ratio of the sample's summed pi_theta / pi_rollout."""
    rollout = t([-0.1 * j - 0.4 for j in range(len(MASK))])
    for mode in ("truncate", "mask"):
        leaf = (rollout + t(LOG_RATIO)).requires_grad_()
        loss, metrics = tis_policy_loss(
            leaf,
            rollout,
            t(ADVANTAGES),
            old_log_probs=None,
            tis_clip=HIGH,
            tis_clip_low=LOW,
            mode=mode,
            level="sequence",
            loss_mask=t(MASK),
            lengths=LENGTHS,
            eps_clip=0.2,
        )
        expected = [
            -bound(r, mode) * a for r, a in zip(hand_sequence_ratios(), ADVANTAGES, strict=True)
        ]
        close(loss.detach(), expected)
        loss.sum().backward()
        close(leaf.grad, expected)
        close(metrics["pg_clipfrac"], [0.0] * len(MASK))


# ----------------------------------------------------------------------------- config


CORRECTION_FLAGS = {
    # name: (use_rollout_log_probs, use_tis, tis_mode, tis_level)
    "behaviour_clip": (True, False, "truncate", "token"),
    "decoupled": (False, True, "truncate", "token"),
    "tis": (True, True, "truncate", "token"),
    "seq_tis": (True, True, "truncate", "sequence"),
    "mis": (True, True, "mask", "token"),
}


def flags(algorithm: AlgorithmConfig) -> tuple:
    return (
        algorithm.use_rollout_log_probs,
        algorithm.use_tis,
        algorithm.tis_mode,
        algorithm.tis_level,
    )


@pytest.mark.parametrize("name", list(CORRECTION_FLAGS))
def test_a_named_correction_sets_its_flags_and_its_resolved_config_reads_back(name):
    config = from_dict(CoreConfig, {"algorithm": {"off_policy_correction": name}})
    assert config.algorithm.off_policy_correction == name
    assert flags(config.algorithm) == CORRECTION_FLAGS[name]
    written = to_dict(config)
    assert written["algorithm"]["off_policy_correction"] == name
    again = from_dict(CoreConfig, written)
    assert again == config and to_dict(again) == written
    # Its own values given explicitly, as strings from --set, are no contradiction.
    use_rollout, use_tis, mode, level = CORRECTION_FLAGS[name]
    explicit = {
        "off_policy_correction": name,
        "use_rollout_log_probs": str(use_rollout).lower(),
        "use_tis": str(use_tis).lower(),
        "tis_mode": mode,
        "tis_level": level,
    }
    assert from_dict(CoreConfig, {"algorithm": explicit}) == config


def test_null_keeps_the_flags_as_given():
    algorithm = AlgorithmConfig(use_tis=True, tis_mode="mask", tis_level="sequence")
    assert flags(algorithm) == (False, True, "mask", "sequence")
    assert AlgorithmConfig().use_tis is None  # left for resolve_tis


@pytest.mark.parametrize(
    ("name", "given", "message"),
    [
        (
            "decoupled",
            {"use_rollout_log_probs": True},
            "off_policy_correction='decoupled' sets use_rollout_log_probs=false, but "
            "use_rollout_log_probs=true was given; drop use_rollout_log_probs (or set it to "
            "false), or set off_policy_correction=null",
        ),
        (
            "decoupled",
            {"use_tis": False},
            "off_policy_correction='decoupled' sets use_tis=true, but use_tis=false was given; "
            "drop use_tis (or set it to true), or set off_policy_correction=null",
        ),
        (
            "behaviour_clip",
            {"use_tis": True},
            "off_policy_correction='behaviour_clip' sets use_tis=false, but use_tis=true was "
            "given; drop use_tis (or set it to false), or set off_policy_correction=null",
        ),
        (
            "tis",
            {"use_tis": False},
            "off_policy_correction='tis' sets use_tis=true, but use_tis=false was given; drop "
            "use_tis (or set it to true), or set off_policy_correction=null",
        ),
        (
            "tis",
            {"tis_mode": "mask"},
            "off_policy_correction='tis' sets tis_mode=truncate, but tis_mode=mask was given; "
            "drop tis_mode (or set it to truncate), or set off_policy_correction=null",
        ),
        (
            "seq_tis",
            {"tis_mode": "mask"},
            "off_policy_correction='seq_tis' sets tis_mode=truncate, but tis_mode=mask was "
            "given; drop tis_mode (or set it to truncate), or set off_policy_correction=null",
        ),
        (
            "mis",
            {"tis_level": "sequence"},
            "off_policy_correction='mis' sets tis_level=token, but tis_level=sequence was "
            "given; drop tis_level (or set it to token), or set off_policy_correction=null",
        ),
        (
            "behaviour_clip",
            {"tis_mode": "mask"},
            "off_policy_correction='behaviour_clip' sets tis_mode=truncate, but tis_mode=mask "
            "was given; drop tis_mode (or set it to truncate), or set off_policy_correction=null",
        ),
    ],
)
def test_a_flag_that_contradicts_the_correction_is_refused_in_one_line(name, given, message):
    with pytest.raises(ValueError) as info:
        from_dict(CoreConfig, {"algorithm": {"off_policy_correction": name, **given}})
    assert str(info.value) == f"algorithm.{message}"


def test_flags_at_their_defaults_give_way_to_the_correction():
    # false, truncate and token cannot be told from unset: the correction's values win.
    assert (
        flags(AlgorithmConfig(off_policy_correction="tis", use_rollout_log_probs=False))
        == (CORRECTION_FLAGS["tis"])
    )
    assert AlgorithmConfig(off_policy_correction="mis", tis_mode="truncate").tis_mode == "mask"
    seq = AlgorithmConfig(off_policy_correction="seq_tis", tis_level="token")
    assert seq.tis_level == "sequence"


@pytest.mark.parametrize(
    ("given", "start"),
    [
        (
            {"off_policy_correction": "importance"},
            "algorithm.off_policy_correction='importance': expected one of behaviour_clip, "
            "decoupled, mis, seq_tis, tis, or null",
        ),
        ({"tis_level": "sample"}, "algorithm.tis_level='sample': expected one of sequence, token"),
    ],
)
def test_unknown_names_are_refused(given, start):
    with pytest.raises(ValueError) as info:
        from_dict(CoreConfig, {"algorithm": given})
    assert str(info.value) == start


@pytest.mark.parametrize("name", ["tis", "seq_tis", "mis"])
def test_gspo_and_dual_clip_are_refused_where_the_weight_replaces_the_ratio(name):
    level = CORRECTION_FLAGS[name][3]
    with pytest.raises(ValueError) as info:
        AlgorithmConfig(off_policy_correction=name, advantage_estimator="gspo")
    assert str(info.value) == (
        f"advantage_estimator='gspo' with off_policy_correction={name!r} (use_tis=true and "
        f"use_rollout_log_probs=true): the {level} TIS weight would replace its sequence-level "
        "ratio; choose off_policy_correction=decoupled or behaviour_clip"
    )
    with pytest.raises(ValueError) as info:
        AlgorithmConfig(off_policy_correction=name, eps_clip_c=3.0)
    assert str(info.value).startswith(
        f"eps_clip_c=3.0 with off_policy_correction={name!r} (use_tis=true and "
    )


@pytest.mark.parametrize("name", ["behaviour_clip", "decoupled"])
def test_gspo_and_dual_clip_are_accepted_where_a_ratio_is_clipped(name):
    AlgorithmConfig(off_policy_correction=name, advantage_estimator="gspo")
    AlgorithmConfig(off_policy_correction=name, eps_clip_c=3.0)
