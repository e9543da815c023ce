"""Tests for ember_core.algorithms advantage estimators, against hand-computed numbers."""

import math
import statistics

import pytest
import torch

from ember_core.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    compute_advantages,
    whiten_advantages,
)


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def flat(tensors: list[torch.Tensor]) -> list[float]:
    return torch.cat(tensors).tolist()


def assert_close(actual: list[float], expected: list[float], tol: float = 1e-5) -> None:
    assert len(actual) == len(expected), (actual, expected)
    for a, e in zip(actual, expected, strict=True):
        assert a == pytest.approx(e, abs=tol), (actual, expected)


def whiten_by_hand(xs: list[float]) -> list[float]:
    mean, var = statistics.mean(xs), statistics.variance(xs)  # variance: unbiased
    return [(x - mean) / math.sqrt(var + 1e-8) for x in xs]


def test_registered_estimators_and_flags() -> None:
    assert ADVANTAGE_ESTIMATORS.names() == [
        "gae",
        "grpo",
        "gspo",
        "ppo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
    ]
    assert ADVANTAGE_ESTIMATORS.get("ppo").uses_critic
    assert ADVANTAGE_ESTIMATORS.get("gae") is ADVANTAGE_ESTIMATORS.get("ppo")
    assert ADVANTAGE_ESTIMATORS.get("gspo").sequence_ratio
    assert not ADVANTAGE_ESTIMATORS.get("grpo").sequence_ratio
    assert not ADVANTAGE_ESTIMATORS.get("grpo").uses_critic


@pytest.mark.parametrize("whiten", [False, True])
@pytest.mark.parametrize("name", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_reinforce_plus_plus_whitens_once_with_the_given_whitening(name, whiten) -> None:
    """The estimator whitens by definition; `whiten=True` must not whiten a second time, and a
    trainer's whitening (over all data-parallel ranks) replaces the local one."""
    inputs = grpo_inputs()
    calls = []

    def whiten_fn(advantages, masks):
        calls.append([a.clone() for a in advantages])
        return [a * 0 + 7.0 for a in advantages]

    advantages, returns = compute_advantages(name, inputs, whiten=whiten, whiten_fn=whiten_fn)
    assert len(calls) == 1
    assert flat(calls[0]) == flat(returns)  # it received the unwhitened returns
    assert flat(advantages) == [7.0] * sum(inputs.response_lengths)
    # Without a whitening function: ember-core's, once.
    local, _ = compute_advantages(name, inputs, whiten=whiten)
    assert_close(flat(local), whiten_by_hand(flat(returns)))
    assert ADVANTAGE_ESTIMATORS.get(name).whitens


@pytest.mark.parametrize("name", ["grpo", "gspo", "ppo"])
def test_other_estimators_whiten_only_on_request(name) -> None:
    inputs = grpo_inputs(values=[torch.zeros(n) for n in grpo_inputs().response_lengths])
    calls = []
    compute_advantages(name, inputs, whiten_fn=lambda a, m: calls.append(1) or a)
    assert calls == [] and not ADVANTAGE_ESTIMATORS.get(name).whitens
    compute_advantages(name, inputs, whiten=True, whiten_fn=lambda a, m: calls.append(1) or a)
    assert calls == [1]


# ----------------------------------------------------------------------------- GRPO


def grpo_inputs(**overrides) -> AdvantageInputs:
    kwargs = dict(
        rewards=t(1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5),
        response_lengths=[2, 1, 3, 1, 2, 2, 1, 1],
        n_samples_per_prompt=4,
    )
    kwargs.update(overrides)
    return AdvantageInputs(**kwargs)


@pytest.mark.parametrize("name", ["grpo", "gspo"])
def test_grpo_group_normalised_unbiased_std(name: str) -> None:
    advantages, returns = compute_advantages(name, grpo_inputs())
    # group 0: mean 0.5, unbiased std sqrt(4 * 0.25 / 3); group 1: all equal -> 0.
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert [x.numel() for x in advantages] == [2, 1, 3, 1, 2, 2, 1, 1]
    assert_close(flat(advantages), [a, a, -a, -a, -a, -a, a] + [0.0] * 6)
    assert torch.equal(torch.cat(advantages[4:]), torch.zeros(6))  # exactly 0, not ~1e-3
    assert_close(flat(returns), flat(advantages))
    assert all(x.dtype == torch.float32 for x in advantages)


def test_grpo_without_std_normalisation() -> None:
    advantages, _ = compute_advantages("grpo", grpo_inputs(normalize_std=False))
    assert_close(flat(advantages), [0.5, 0.5, -0.5, -0.5, -0.5, -0.5, 0.5] + [0.0] * 6)


def test_grpo_equal_rewards_with_rounding_residue_are_exactly_zero() -> None:
    inputs = AdvantageInputs(
        rewards=t(0.9, 0.9, 0.9), response_lengths=[1, 1, 1], n_samples_per_prompt=3
    )
    # In float32, (0.9 + 0.9 + 0.9) / 3 != 0.9: a naive mean leaves a ~6e-8 residue that
    # the equally tiny std would inflate to ~0.06.
    advantages, _ = compute_advantages("grpo", inputs)
    assert flat(advantages) == [0.0, 0.0, 0.0]


def test_grpo_single_sample_groups_give_zeros_not_nan() -> None:
    inputs = AdvantageInputs(rewards=t(0.3, 0.7), response_lengths=[2, 1])
    advantages, returns = compute_advantages("grpo", inputs)
    assert flat(advantages) == [0.0, 0.0, 0.0]
    assert torch.isfinite(torch.cat(returns)).all()


def test_grpo_explicit_group_ids() -> None:
    inputs = AdvantageInputs(
        rewards=t(1.0, 2.0, 3.0, 6.0), response_lengths=[1, 1, 1, 1], group_ids=[7, 3, 7, 3]
    )
    advantages, _ = compute_advantages("grpo", inputs)
    # group 7: (1, 3), mean 2, std sqrt(2); group 3: (2, 6), mean 4, std sqrt(8).
    a7, a3 = 1 / (math.sqrt(2) + 1e-6), 2 / (math.sqrt(8) + 1e-6)
    assert_close(flat(advantages), [-a7, -a3, a7, a3])


def test_whiten_flag_centres_over_counted_tokens() -> None:
    masks = [t(1, 0), t(1), t(1, 1, 1), t(1), t(1, 1), t(1, 1), t(1), t(1)]
    inputs = grpo_inputs(normalize_std=False, loss_masks=masks)
    advantages, _ = compute_advantages("grpo", inputs, whiten=True)
    counted = [a for a, m in zip(flat(advantages), flat(masks), strict=True) if m]
    raw = [0.5, -0.5, -0.5, -0.5, -0.5, 0.5] + [0.0] * 6
    assert_close(counted, whiten_by_hand(raw))


def test_whiten_advantages_joint_over_samples() -> None:
    out = whiten_advantages([t(1.0, 2.0), t(3.0)], [t(1, 1), t(1)])
    assert [x.numel() for x in out] == [2, 1]
    assert_close(flat(out), [-1.0, 0.0, 1.0])  # mean 2, unbiased var 1


# ----------------------------------------------------------------------------- REINFORCE++


def test_reinforce_plus_plus_discounted_returns_with_kl_penalty() -> None:
    lp = [t(-1.0, -2.0, -0.5), t(-1.0, -1.0)]
    ref = [t(-1.2, -1.6, -1.5), t(-1.5, -1.0)]  # r = [0.2, -0.4, 1.0], [0.5, 0.0]
    inputs = AdvantageInputs(
        rewards=t(1.0, 0.0),
        response_lengths=[3, 2],
        log_probs=lp,
        ref_log_probs=ref,
        gamma=0.5,
        kl_coef=0.1,
        kl_kind="k1",
    )
    advantages, returns = compute_advantages("reinforce_plus_plus", inputs)
    # token rewards: [-0.02, 0.04, -0.1 + 1.0], [-0.05, 0.0]; G_t = r_t + 0.5 * G_{t+1}.
    g0_2 = 0.9
    g0_1 = 0.04 + 0.5 * g0_2
    g0_0 = -0.02 + 0.5 * g0_1
    expected_returns = [g0_0, g0_1, g0_2, -0.05, 0.0]
    assert_close(flat(returns), expected_returns)
    assert_close(flat(advantages), whiten_by_hand(expected_returns))


def test_reinforce_plus_plus_reward_on_last_counted_token() -> None:
    lp = [t(-1.0, -2.0, -0.5), t(-1.0)]
    ref = [t(-1.2, -1.6, -5.0), t(-1.0)]  # r = [0.2, -0.4, 4.5 (masked)], [0.0]
    inputs = AdvantageInputs(
        rewards=t(1.0, 0.5),
        response_lengths=[3, 1],
        loss_masks=[t(1, 1, 0), t(1)],
        log_probs=lp,
        ref_log_probs=ref,
        gamma=1.0,
        kl_coef=0.1,
    )
    advantages, returns = compute_advantages("reinforce_plus_plus", inputs)
    # token rewards: [-0.02, 0.04 + 1.0, 0 (masked: no KL, no reward)], [0.5].
    assert_close(flat(returns), [1.02, 1.04, 0.0, 0.5])
    counted = [flat(advantages)[i] for i in (0, 1, 3)]
    assert_close(counted, whiten_by_hand([1.02, 1.04, 0.5]))


def test_reinforce_plus_plus_baseline_group_mean_no_kl() -> None:
    inputs = AdvantageInputs(
        rewards=t(1.0, 0.0, 0.5, 0.5), response_lengths=[2, 1, 1, 2], n_samples_per_prompt=2
    )
    advantages, returns = compute_advantages("reinforce_plus_plus_baseline", inputs)
    raw = [0.5, 0.5, -0.5, 0.0, 0.0, 0.0]  # r - group mean, broadcast (no std division)
    assert_close(flat(returns), raw)
    assert_close(flat(advantages), whiten_by_hand(raw))


def test_reinforce_plus_plus_baseline_with_kl_penalty() -> None:
    lp = [t(-1.0, -1.0), t(-1.0)]
    ref = [t(-1.2, -1.4), t(-1.1)]  # r = [0.2, 0.4], [0.1]
    inputs = AdvantageInputs(
        rewards=t(1.0, 0.0),
        response_lengths=[2, 1],
        n_samples_per_prompt=2,
        log_probs=lp,
        ref_log_probs=ref,
        kl_coef=0.5,
    )
    advantages, returns = compute_advantages("reinforce_plus_plus_baseline", inputs)
    # baseline 0.5: token rewards [-0.1, -0.2 + 0.5], [-0.05 - 0.5]; gamma 1 -> cumulative.
    expected = [-0.1 + 0.3, 0.3, -0.55]
    assert_close(flat(returns), expected)
    assert_close(flat(advantages), whiten_by_hand(expected))


# ----------------------------------------------------------------------------- PPO / GAE


def test_gae_matches_hand_unrolled_recursion() -> None:
    gamma, lam = 0.9, 0.8
    inputs = AdvantageInputs(
        rewards=t(1.0, 0.0),
        response_lengths=[3, 2],
        values=[t(0.5, 0.4, 0.8), t(0.3, -0.2)],
        gamma=gamma,
        lambd=lam,
    )
    advantages, returns = compute_advantages("ppo", inputs)
    # sample 0, token rewards [0, 0, 1], V after the end = 0.
    d2 = 1.0 + gamma * 0.0 - 0.8
    d1 = 0.0 + gamma * 0.8 - 0.4
    d0 = 0.0 + gamma * 0.4 - 0.5
    a2 = d2
    a1 = d1 + gamma * lam * a2
    a0 = d0 + gamma * lam * a1
    # sample 1 (shorter: padding must not leak), token rewards [0, 0].
    e1 = 0.0 + gamma * 0.0 - (-0.2)
    e0 = 0.0 + gamma * (-0.2) - 0.3
    b1 = e1
    b0 = e0 + gamma * lam * b1
    assert_close(flat(advantages), [a0, a1, a2, b0, b1])
    assert_close(flat(returns), [a0 + 0.5, a1 + 0.4, a2 + 0.8, b0 + 0.3, b1 - 0.2])
    assert a0 == pytest.approx(0.19408)


def test_gae_lambda_one_gamma_one_is_monte_carlo_with_kl() -> None:
    values = [t(0.2, 0.1, 0.4).requires_grad_()]
    inputs = AdvantageInputs(
        rewards=t(2.0),
        response_lengths=[3],
        values=values,
        log_probs=[t(-1.0, -1.0, -1.0)],
        ref_log_probs=[t(-1.5, -1.0, -2.0)],
        kl_coef=0.2,
        kl_kind="k1",
    )
    advantages, returns = compute_advantages("gae", inputs)
    # token rewards: [-0.1, 0, -0.2 + 2]; return-to-go: [1.7, 1.8, 1.8]; A = G - V.
    assert_close(flat(returns), [1.7, 1.8, 1.8])
    assert_close(flat(advantages), [1.5, 1.7, 1.4])
    assert not advantages[0].requires_grad and not returns[0].requires_grad


def test_gae_requires_values() -> None:
    inputs = AdvantageInputs(rewards=t(1.0), response_lengths=[2])
    with pytest.raises(ValueError, match="values is required by the 'ppo'"):
        compute_advantages("ppo", inputs)


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rewards": t(1.0, 0.0, float("nan"))}, r"rewards\[2\] = nan is not finite"),
        ({"rewards": t(1.0, float("inf"), 0.0)}, r"rewards\[1\] = inf is not finite"),
        ({"rewards": torch.zeros(3, 1)}, r"rewards must be a 1-D tensor"),
        ({"response_lengths": [1, 2]}, r"response_lengths has 2 entries but rewards has 3"),
        ({"response_lengths": [1, -1, 1]}, r"response_lengths\[1\] must be >= 0, got -1"),
        ({"loss_masks": [t(1), t(1), t(1)]}, r"loss_masks\[1\] has shape \(1,\) .* = 2"),
        ({"loss_masks": [t(1)]}, r"loss_masks has 1 samples but rewards has 3"),
        ({"values": [t(1), t(1, 1), t(1)]}, r"values\[2\] has shape \(1,\) .* = 3"),
        ({"n_samples_per_prompt": 2}, r"n_samples_per_prompt .* batch size 3, got 2"),
        ({"n_samples_per_prompt": 0}, r"n_samples_per_prompt .* got 0"),
        ({"group_ids": [0, 1]}, r"group_ids has 2 entries but rewards has 3"),
        ({"gamma": 1.5}, r"gamma must be in \[0, 1\], got 1\.5"),
        ({"lambd": -0.1}, r"lambd must be in \[0, 1\], got -0\.1"),
        ({"kl_coef": -1.0}, r"kl_coef must be .*>= 0, got -1\.0"),
        ({"kl_coef": 0.1}, r"kl_coef=0\.1 needs log_probs and ref_log_probs"),
        ({"kl_kind": "k9"}, r"unknown KL kind 'k9'; known: k1, k2, k3, low_var_kl"),
    ],
)
def test_advantage_inputs_validation(kwargs: dict, match: str) -> None:
    base = dict(rewards=t(1.0, 0.0, 1.0), response_lengths=[1, 2, 3])
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        AdvantageInputs(**base)


def test_unknown_estimator_lists_known_names() -> None:
    inputs = AdvantageInputs(rewards=t(1.0), response_lengths=[1])
    with pytest.raises(
        ValueError,
        match=r"unknown advantage estimator 'rloo'; known: gae, grpo, gspo, ppo, "
        r"reinforce_plus_plus, reinforce_plus_plus_baseline",
    ):
        compute_advantages("rloo", inputs)


# ----------------------------------------------------------------------------- multi-turn

TWO_TURNS = t(1, 1, 0, 0, 1, 1)
"""Response [a1 a2 | tool t1 t2 | b1 b2]: the tool's two tokens are not the model's."""


def two_turn_inputs(tool_values: tuple[float, float], **overrides) -> AdvantageInputs:
    kwargs = dict(
        rewards=t(1.0),
        response_lengths=[6],
        loss_masks=[TWO_TURNS],
        values=[t(0.1, 0.2, *tool_values, 0.5, 0.6)],
        gamma=0.9,
        lambd=0.8,
    )
    kwargs.update(overrides)
    return AdvantageInputs(**kwargs)


def test_gae_steps_over_tool_tokens_of_a_two_turn_sample() -> None:
    """With gamma and lambda below 1, the untrained critic values of the tool's tokens must not
    bootstrap the counted token before them: GAE runs over a1 a2 b1 b2 alone.

    By hand (gamma 0.9, lambda 0.8, gamma * lambda 0.72, V = 0.1 0.2 0.5 0.6, reward 1 on b2):
    b2: delta = 1 - 0.6 = 0.4, A = 0.4; b1: delta = 0.9 * 0.6 - 0.5 = 0.04,
    A = 0.04 + 0.72 * 0.4 = 0.328; a2: delta = 0.9 * 0.5 - 0.2 = 0.25,
    A = 0.25 + 0.72 * 0.328 = 0.48616; a1: delta = 0.9 * 0.2 - 0.1 = 0.08,
    A = 0.08 + 0.72 * 0.48616 = 0.4300352.
    """
    expected = [0.4300352, 0.48616, 0.328, 0.4]
    for tool_values in ((5.0, 7.0), (0.0, -3.0)):
        (advantages,), (returns,) = compute_advantages("ppo", two_turn_inputs(tool_values))
        counted = advantages[TWO_TURNS > 0].tolist()
        assert_close(counted, expected, tol=1e-6)
        values = torch.tensor([0.1, 0.2, 0.5, 0.6])
        assert_close(returns[TWO_TURNS > 0].tolist(), (torch.tensor(expected) + values).tolist())


def test_reinforce_plus_plus_discounts_over_counted_tokens_only() -> None:
    """G over b2, b1, a2, a1 with gamma 0.9: 1, 0.9, 0.81, 0.729; the tool's tokens are no
    discount step (they carry b1's return)."""
    (_,), (returns,) = compute_advantages("reinforce_plus_plus", two_turn_inputs((0.0, 0.0)))
    assert_close(returns.tolist(), [0.729, 0.81, 0.9, 0.9, 0.9, 1.0], tol=1e-6)
