"""TIS / masked IS weights and the TIS-weighted policy loss, against hand computation."""

from __future__ import annotations

import math

import pytest
import torch

from ember_core.algorithms import TIS_MODES, tis_policy_loss, tis_weights
from ember_core.config import AlgorithmConfig, CoreConfig, from_dict


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def close(actual: torch.Tensor, expected: list[float], tol: float = 1e-12) -> None:
    assert actual.shape == (len(expected),)
    assert torch.allclose(actual, t(*expected), atol=tol, rtol=0), (actual, expected)


RATIOS = (0.05, 0.6, 1.0, 1.9, 3.0)


def _log_probs_with_ratios(ratios: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    rollout = t(*[-0.3 - 0.2 * i for i in range(len(ratios))])
    return rollout + t(*[math.log(r) for r in ratios]), rollout


def test_modes_are_registered_by_name():
    assert TIS_MODES.names() == ["mask", "truncate"]


def test_mask_keeps_the_ratio_inside_the_band_and_zeroes_it_outside():
    train, rollout = _log_probs_with_ratios(RATIOS)
    weights, metrics = tis_weights(
        train.requires_grad_(), rollout, tis_clip=2.0, tis_clip_low=0.5, mode="mask"
    )
    close(weights, [0.0, 0.6, 1.0, 1.9, 0.0])
    close(metrics["tis_maskfrac"], [1.0, 0.0, 0.0, 0.0, 1.0])
    close(metrics["tis"], list(RATIOS))
    assert "tis_clipfrac" not in metrics and not weights.requires_grad
    truncated, metrics = tis_weights(train, rollout, tis_clip=2.0, tis_clip_low=0.5)
    close(truncated, [0.5, 0.6, 1.0, 1.9, 2.0])
    close(metrics["tis_clipfrac"], [1.0, 0.0, 0.0, 0.0, 1.0])
    # The band's bounds are inside it.
    at_bounds, outside = TIS_MODES.get("mask")(t(0.5, 2.0), 0.5, 2.0)
    close(at_bounds, [0.5, 2.0])
    close(outside, [0.0, 0.0])


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="TIS mode 'clip'"):
        tis_weights(t(0.0), t(0.0), tis_clip=2.0, mode="clip")


def _ppo(r: float, a: float, eps: float = 0.2) -> float:
    return max(-r * a, -min(max(r, 1 - eps), 1 + eps) * a)


def test_with_the_trainers_old_log_probs_the_ppo_loss_is_weighted_by_old_over_rollout():
    # Per token: current/old ratio r, old/rollout ratio q, advantage a.
    r = (1.5, 0.7, 1.1, 0.9)
    q = (3.0, 0.4, 1.2, 0.05)
    a = (1.0, -2.0, 0.5, -1.0)
    rollout = t(-0.5, -1.0, -1.5, -2.0)
    old = rollout + t(*[math.log(x) for x in q])
    lp = (old + t(*[math.log(x) for x in r])).requires_grad_()
    for mode, bound in (
        ("truncate", lambda x: min(max(x, 0.1), 2.0)),
        ("mask", lambda x: x if 0.1 <= x <= 2.0 else 0.0),
    ):
        loss, metrics = tis_policy_loss(
            lp,
            rollout,
            t(*a),
            old_log_probs=old,
            tis_clip=2.0,
            tis_clip_low=0.1,
            mode=mode,
            eps_clip=0.2,
        )
        close(
            loss.detach(),
            [_ppo(ri, ai) * bound(qi) for ri, qi, ai in zip(r, q, a, strict=True)],
            1e-9,
        )
        close(metrics["tis"], list(q), 1e-9)
        close(metrics["pg_clipfrac"], [1.0, 1.0, 0.0, 0.0])


def test_with_the_engine_as_old_policy_the_weight_is_current_over_rollout_and_unclipped():
    """use_rollout_log_probs: the anchor is the forward's own log-probs, so the PPO ratio is 1
    and the loss is -w * A with w = bound(pi_theta / pi_rollout); its gradient in lp is -w * A
    (the bounded IS policy gradient), even for ratios far outside the PPO clip range."""
    a = (1.0, -2.0, 0.5, 1.0, -1.0)
    lp, rollout = _log_probs_with_ratios(RATIOS)
    for mode, expected_w in (
        ("truncate", [0.5, 0.6, 1.0, 1.9, 2.0]),
        ("mask", [0.0, 0.6, 1.0, 1.9, 0.0]),
    ):
        leaf = lp.clone().requires_grad_()
        loss, metrics = tis_policy_loss(
            leaf,
            rollout,
            t(*a),
            old_log_probs=None,
            tis_clip=2.0,
            tis_clip_low=0.5,
            mode=mode,
            eps_clip=0.2,
            eps_clip_high=0.28,
        )
        close(loss.detach(), [-w * ai for w, ai in zip(expected_w, a, strict=True)])
        loss.sum().backward()
        close(leaf.grad, [-w * ai for w, ai in zip(expected_w, a, strict=True)])
        close(metrics["tis"], list(RATIOS), 1e-12)
        close(metrics["pg_clipfrac"], [0.0] * 5)
        close(metrics["ppo_kl"], [0.0] * 5)


def test_engine_as_old_policy_differs_from_the_engine_anchored_clip():
    # The behaviour-anchored PPO loss clips ratio 3 with A > 0 (no gradient); TIS weighs it by
    # tis_clip instead: the two modes are different objectives, not one with a factor of 1.
    lp, rollout = _log_probs_with_ratios((3.0,))
    leaf = lp.clone().requires_grad_()
    loss, _ = tis_policy_loss(leaf, rollout, t(1.0), old_log_probs=None, tis_clip=2.0, eps_clip=0.2)
    loss.sum().backward()
    close(leaf.grad, [-2.0])


def test_config_accepts_tis_with_engine_old_log_probs_and_reads_the_mode():
    config = from_dict(
        CoreConfig,
        {"algorithm": {"use_tis": "true", "use_rollout_log_probs": "true", "tis_mode": "mask"}},
    )
    assert config.algorithm.use_tis and config.algorithm.tis_mode == "mask"


@pytest.mark.parametrize(
    ("kwargs", "start"),
    [
        ({"tis_mode": "clip"}, "tis_mode='clip': expected one of mask, truncate"),
        ({"advantage_estimator": "gspo"}, "advantage_estimator='gspo' with use_tis=true and "),
        ({"eps_clip_c": 3.0}, "eps_clip_c=3.0 with use_tis=true and use_rollout_log_probs=true"),
    ],
)
def test_bad_combinations_name_the_key_in_one_line(kwargs, start):
    with pytest.raises(ValueError) as info:
        AlgorithmConfig(use_tis=True, use_rollout_log_probs=True, **kwargs)
    assert str(info.value).startswith(start) and "\n" not in str(info.value)
    # Each is fine without the engine as old policy (tis_mode aside).
    if "tis_mode" not in kwargs:
        AlgorithmConfig(use_tis=True, use_rollout_log_probs=False, **kwargs)
