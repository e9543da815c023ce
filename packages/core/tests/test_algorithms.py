"""Tests for ember_core.algorithms losses, reductions and the registry, against hand math."""

import math

import pytest
import torch

from ember_core.algorithms import (
    KL_ESTIMATORS,
    REDUCTIONS,
    Registry,
    approx_kl,
    compose_loss,
    gspo_log_ratio,
    gspo_policy_loss,
    masked_mean,
    masked_sample_mean,
    masked_whiten,
    policy_loss,
    reduce_loss,
    tis_weights,
    value_loss,
)


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def close(actual: torch.Tensor, expected: list[float], tol: float = 1e-6) -> None:
    assert actual.shape == (len(expected),)
    assert torch.allclose(actual, t(*expected), atol=tol, rtol=0), (actual, expected)


# ----------------------------------------------------------------------------- registry


def test_registry_register_alias_get_names() -> None:
    rewards: Registry[object] = Registry("reward function")

    @rewards.register("exact_match", "em")
    def exact_match(x: int) -> int:
        return x

    sentinel = object()
    assert rewards.add("other", sentinel) is sentinel
    assert rewards.get("em") is exact_match
    assert rewards.get("exact_match") is exact_match
    assert rewards.names() == ["em", "exact_match", "other"]
    assert "em" in rewards and "nope" not in rewards and ["x"] not in rewards


def test_registry_unknown_and_duplicate_names() -> None:
    reg: Registry[int] = Registry("widget")
    reg.add("zeta", 1)
    reg.add("alpha", 2)
    with pytest.raises(ValueError, match=r"unknown widget 'beta'; known: alpha, zeta"):
        reg.get("beta")
    with pytest.raises(ValueError, match="'alpha' is already registered"):
        reg.add("alpha", 3)
    with pytest.raises(ValueError, match="non-empty string"):
        reg.add("", 3)


# ----------------------------------------------------------------------------- KL


LP = t(-1.0, -2.0, -0.5)
REF = t(-1.5, -1.0, -0.5)  # r = lp - ref = [0.5, -1.0, 0.0]


def test_kl_k1_k2_k3() -> None:
    close(approx_kl(LP, REF, "k1"), [0.5, -1.0, 0.0])
    close(approx_kl(LP, REF, "k2"), [0.125, 0.5, 0.0])
    k3 = [math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1.0, 0.0]
    close(approx_kl(LP, REF, "k3"), k3)
    close(approx_kl(LP, REF, "low_var_kl"), k3)
    assert KL_ESTIMATORS.names() == ["k1", "k2", "k3", "low_var_kl"]


def test_low_var_kl_clamped_at_10() -> None:
    lp = t(-4.0, -3.5)
    ref = t(-1.0, -1.0)  # r = -3 -> e^3 - 4 = 16.09 (clamped); r = -2.5 -> e^2.5 - 3.5 = 8.68
    assert math.exp(3.0) - 4.0 > 10
    for kind in ("low_var_kl", "k3"):
        close(approx_kl(lp, ref, kind), [10.0, math.exp(2.5) - 3.5], tol=1e-5)
    close(approx_kl(lp, ref, "k2"), [4.5, 3.125])  # only k3 / low_var_kl are clamped


def test_kl_is_float32_and_validates() -> None:
    out = approx_kl(LP.bfloat16(), REF.bfloat16(), "k1")
    assert out.dtype == torch.float32
    with pytest.raises(ValueError, match=r"unknown KL kind 'k4'; known: k1, k2, k3, low_var_kl"):
        approx_kl(LP, REF, "k4")
    with pytest.raises(ValueError, match="ref_log_probs has shape"):
        approx_kl(LP, REF[:2], "k1")


# ----------------------------------------------------------------------------- PPO


RATIOS = [1.5, 0.5, 1.1, 1.25, 0.7]
ADV = t(1.0, 1.0, -1.0, 1.0, -1.0)


def _ratio_inputs(ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    old = t(*([-1.0] * len(ratios)))
    lp = (old + t(*[math.log(r) for r in ratios])).requires_grad_()
    return lp, old


def test_policy_loss_asymmetric_clip() -> None:
    lp, old = _ratio_inputs(RATIOS)
    loss, metrics = policy_loss(lp, old, ADV, eps_clip=0.2, eps_clip_high=0.28)
    # ratio 1.5,A=+1 -> capped at 1.28; 0.5,A=+1 unclipped; 1.1,A=-1 in range;
    # 1.25,A=+1 below 1.28 -> unclipped; 0.7,A=-1 -> max(0.7, 0.8) = 0.8 (clipped).
    close(loss, [-1.28, -0.5, 1.1, -1.25, 0.8], tol=1e-5)
    close(metrics["pg_clipfrac"], [1.0, 0.0, 0.0, 0.0, 1.0])
    close(metrics["ppo_kl"], [-math.log(r) for r in RATIOS], tol=1e-5)
    close(metrics["dual_clipfrac"], [0.0] * 5)
    assert not metrics["ppo_kl"].requires_grad


def test_policy_loss_eps_clip_high_defaults_to_eps_clip() -> None:
    lp, old = _ratio_inputs(RATIOS)
    loss, metrics = policy_loss(lp, old, ADV, eps_clip=0.2)
    close(loss, [-1.2, -0.5, 1.1, -1.2, 0.8], tol=1e-5)  # 1.25 now capped at 1.2
    close(metrics["pg_clipfrac"], [1.0, 0.0, 0.0, 1.0, 1.0])


def test_policy_loss_gradient_unclipped_and_clipped() -> None:
    lp, old = _ratio_inputs(RATIOS)
    loss, _ = policy_loss(lp, old, ADV, eps_clip=0.2, eps_clip_high=0.28)
    loss.sum().backward()
    # d(-ratio*A)/d lp = -A * ratio where unclipped; 0 where the clipped branch is taken.
    close(lp.grad, [0.0, -0.5, 1.1, -1.25, 0.0], tol=1e-5)


def test_policy_loss_dual_clip() -> None:
    lp, old = _ratio_inputs([10.0, 2.0, 10.0])
    adv = t(-1.0, -1.0, 1.0)
    loss, metrics = policy_loss(lp, old, adv, eps_clip=0.2, eps_clip_c=3.0)
    # A<0, ratio 10: max(10, 1.2) = 10 -> min(10, 3) = 3; ratio 2: max(2, 1.2) = 2 < 3;
    # A>0 untouched by dual clip: max(-10, -1.2) = -1.2.
    close(loss, [3.0, 2.0, -1.2], tol=1e-5)
    close(metrics["dual_clipfrac"], [1.0, 0.0, 0.0])
    close(metrics["pg_clipfrac"], [0.0, 0.0, 1.0])
    loss.sum().backward()
    close(lp.grad, [0.0, 2.0, 0.0], tol=1e-5)  # the dual bound -c*A is constant in lp
    without, _ = policy_loss(lp.detach(), old, adv, eps_clip=0.2)
    close(without, [10.0, 2.0, -1.2], tol=1e-4)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"eps_clip": 0.0}, r"eps_clip must be .*> 0, got 0\.0"),
        ({"eps_clip": -0.1}, r"eps_clip must be .*got -0\.1"),
        ({"eps_clip": 0.2, "eps_clip_high": 0.0}, r"eps_clip_high must be .*got 0\.0"),
        ({"eps_clip": 0.2, "eps_clip_c": 1.0}, r"eps_clip_c .*must be > 1, got 1\.0"),
        ({"eps_clip": 0.2, "eps_clip_c": 0.5}, r"eps_clip_c .*got 0\.5"),
    ],
)
def test_policy_loss_rejects_bad_clip(kwargs: dict, match: str) -> None:
    lp, old = _ratio_inputs(RATIOS)
    with pytest.raises(ValueError, match=match):
        policy_loss(lp, old, ADV, **kwargs)


def test_policy_loss_rejects_shape_mismatch() -> None:
    lp, old = _ratio_inputs(RATIOS)
    with pytest.raises(ValueError, match=r"advantages has shape \(4,\)"):
        policy_loss(lp, old, ADV[:4], eps_clip=0.2)


# ----------------------------------------------------------------------------- GSPO


def test_gspo_log_ratio_masked_sequence_mean_broadcast() -> None:
    old = t(-1.0, -1.0, -1.0, -2.0, -2.0, -0.5)
    diff = t(0.3, -0.6, 0.9, 0.2, 0.4, 5.0)
    mask = t(1, 0, 1, 1, 1, 0)
    # sample 0: (0.3 + 0.9) / 2 = 0.6 (the masked -0.6 is ignored); sample 1: 0.3;
    # sample 2 fully masked -> 0.
    out = gspo_log_ratio(old + diff, old, mask, [3, 2, 1])
    close(out, [0.6, 0.6, 0.6, 0.3, 0.3, 0.0], tol=1e-6)


def test_gspo_policy_loss_clips_sequence_ratio() -> None:
    old = t(-1.0, -1.0, -1.0, -2.0, -2.0)
    lp = (old + t(0.3, -0.6, 0.9, 0.2, 0.4)).requires_grad_()
    mask = t(1, 0, 1, 1, 1)
    adv = t(1.0, 1.0, 1.0, -1.0, -1.0)
    loss, metrics = gspo_policy_loss(lp, old, adv, mask, [3, 2], eps_clip=0.2)
    r1 = math.exp(0.3)  # sample 0: exp(0.6) = 1.82 -> capped at 1.2; sample 1 unclipped
    close(loss, [-1.2, -1.2, -1.2, r1, r1], tol=1e-5)
    close(metrics["pg_clipfrac"], [1.0, 1.0, 1.0, 0.0, 0.0])
    close(metrics["ppo_kl"], [-0.6, -0.6, -0.6, -0.3, -0.3], tol=1e-6)
    loss.sum().backward()
    # sample 1: sum_t L_t = 2 * exp(mean of 2 log-ratios) -> d/d lp_j = exp(0.3).
    close(lp.grad, [0.0, 0.0, 0.0, r1, r1], tol=1e-5)


# ----------------------------------------------------------------------------- TIS


def test_tis_weights_clamp_both_ends_and_detached() -> None:
    rollout = t(-1.0, -1.0, -1.0, -1.0)
    train = (rollout + t(*[math.log(x) for x in (0.05, 0.5, 1.0, 3.0)])).requires_grad_()
    weights, metrics = tis_weights(train, rollout, tis_clip=2.0, tis_clip_low=0.1)
    close(weights, [0.1, 0.5, 1.0, 2.0], tol=1e-6)
    close(metrics["tis_clipfrac"], [1.0, 0.0, 0.0, 1.0])
    close(metrics["tis"], [0.05, 0.5, 1.0, 3.0], tol=1e-6)
    assert not weights.requires_grad
    default_low, _ = tis_weights(train, rollout, tis_clip=2.0)
    close(default_low, [0.05, 0.5, 1.0, 2.0], tol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tis_clip": 2.0, "tis_clip_low": -0.1}, r"tis_clip_low must be .*got -0\.1"),
        ({"tis_clip": 0.5, "tis_clip_low": 0.5}, r"tis_clip must be > tis_clip_low=0\.5, got 0\.5"),
        ({"tis_clip": 0.0}, r"tis_clip must be .*got 0\.0"),
    ],
)
def test_tis_rejects_bad_bounds(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tis_weights(t(0.0), t(0.0), **kwargs)


# ----------------------------------------------------------------------------- value


def test_value_loss_clip_and_clipfrac() -> None:
    values = t(1.0, 0.5, 2.0).requires_grad_()
    old = t(0.5, 0.5, 1.0)
    returns = t(1.0, 0.0, 1.1)
    loss, metrics = value_loss(values, old, returns, value_clip=0.2)
    # t0: Vc = 0.7, max(0.3^2, 0) / 2; t1: both 0.25 -> 0.125, not clipped;
    # t2: Vc = 1.2, max(0.01, 0.81) / 2 = 0.405.
    close(loss, [0.045, 0.125, 0.405], tol=1e-6)
    close(metrics["value_clipfrac"], [1.0, 0.0, 0.0])
    loss.sum().backward()
    close(values.grad, [0.0, 0.5, 0.9], tol=1e-6)  # V - R on the unclipped branch


def test_value_loss_validates() -> None:
    with pytest.raises(ValueError, match=r"value_clip must be .*got 0\.0"):
        value_loss(t(1.0), t(1.0), t(1.0), value_clip=0.0)
    with pytest.raises(ValueError, match="returns has shape"):
        value_loss(t(1.0), t(1.0), t(1.0, 2.0), value_clip=0.2)


# ----------------------------------------------------------------------------- reductions


def test_reduce_loss_sample_vs_token() -> None:
    values = t(1, 2, 3, 4, 5, 6)
    mask = t(1, 1, 0, 1, 0, 1)
    lengths = [3, 1, 2]
    # per-sample means: (1+2)/2, 4, 6 -> mean 11.5/3; per token: (1+2+4+6)/4.
    assert reduce_loss(values, mask, lengths).item() == pytest.approx(11.5 / 3)
    assert reduce_loss(values, mask, lengths, "sample").item() == pytest.approx(11.5 / 3)
    assert reduce_loss(values, mask, lengths, "token").item() == pytest.approx(3.25)
    close(masked_sample_mean(values, mask, lengths), [1.5, 4.0, 6.0])
    assert REDUCTIONS.names() == ["sample", "token"]


def test_reduce_loss_fully_masked_sample_is_zero_not_nan() -> None:
    values = t(1.0, 3.0, float("nan"), float("inf"))
    mask = t(1, 1, 0, 0)
    assert reduce_loss(values, mask, [2, 2], "sample").item() == pytest.approx(1.0)
    assert reduce_loss(values, mask, [2, 2], "token").item() == pytest.approx(2.0)
    nothing = torch.zeros(4)
    assert reduce_loss(values, nothing, [2, 2], "sample").item() == 0.0
    assert reduce_loss(values, nothing, [2, 2], "token").item() == 0.0


def test_reduce_loss_gradient_weights() -> None:
    values = t(1, 2, 3).requires_grad_()
    reduce_loss(values, t(1, 1, 1), [2, 1], "sample").backward()
    close(values.grad, [0.25, 0.25, 0.5])  # each sample weighs 1/2, split over its tokens


def test_reduce_loss_validates() -> None:
    values, mask = t(1, 2, 3), t(1, 1, 1)
    with pytest.raises(ValueError, match=r"unknown loss reduction 'seq'; known: sample, token"):
        reduce_loss(values, mask, [3], "seq")
    with pytest.raises(ValueError, match="lengths add up to 4 but there are 3 tokens"):
        reduce_loss(values, mask, [2, 2], "sample")
    with pytest.raises(ValueError, match="lengths add up to 2"):
        reduce_loss(values, mask, [2], "token")
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        reduce_loss(values, mask, [4, -1])
    with pytest.raises(ValueError, match=r"loss_mask has shape \(2,\)"):
        reduce_loss(values, t(1, 1), [3])


def test_masked_mean_and_whiten() -> None:
    values = t(2.0, 4.0, 6.0, 100.0)
    mask = t(1, 1, 1, 0)
    assert masked_mean(values, mask).item() == pytest.approx(4.0)
    # mean 4, unbiased variance (4 + 0 + 4) / 2 = 4, std 2; the masked 100 is mapped too.
    close(masked_whiten(values, mask), [-1.0, 0.0, 1.0, 48.0], tol=1e-5)
    close(masked_whiten(values, mask, shift_mean=False), [3.0, 4.0, 5.0, 52.0], tol=1e-5)
    close(masked_whiten(values, torch.zeros(4)), [2.0, 4.0, 6.0, 100.0])


# ----------------------------------------------------------------------------- total


def test_compose_loss_terms_and_metric_names() -> None:
    pg = t(1.0, 3.0, 5.0).requires_grad_()
    entropy = t(0.5, 1.5, 2.0).requires_grad_()
    kl = t(0.1, 0.3, 0.4)
    mask, lengths = t(1, 1, 1), [2, 1]
    _, pg_metrics = policy_loss(t(0.0, 0.0, 0.0), t(0.0, 0.0, 0.0), t(1, 1, 1), eps_clip=0.2)
    loss, metrics = compose_loss(
        pg,
        mask,
        lengths,
        pg_metrics=pg_metrics,
        entropy=entropy,
        entropy_coef=0.01,
        kl=kl,
        kl_loss_coef=0.1,
        use_kl_loss=True,
    )
    # sample means: pg (2, 5) -> 3.5; entropy (1, 2) -> 1.5; kl (0.2, 0.4) -> 0.3.
    assert loss.item() == pytest.approx(3.5 - 0.01 * 1.5 + 0.1 * 0.3)
    assert set(metrics) == {
        "loss",
        "pg_loss",
        "pg_clipfrac",
        "ppo_kl",
        "dual_clipfrac",
        "kl_loss",
        "entropy_loss",
    }
    assert metrics["loss"].item() == pytest.approx(loss.item())
    assert metrics["pg_loss"].item() == pytest.approx(3.5)
    assert metrics["entropy_loss"].item() == pytest.approx(1.5)
    assert metrics["kl_loss"].item() == pytest.approx(0.3)
    assert metrics["ppo_kl"].item() == 0.0 and metrics["pg_clipfrac"].item() == 0.0
    assert all(not v.requires_grad for v in metrics.values())
    loss.backward()
    close(entropy.grad, [-0.01 / 4, -0.01 / 4, -0.01 / 2])

    token_loss, token_metrics = compose_loss(
        pg, mask, lengths, kl=kl, kl_loss_coef=0.1, reduction="token"
    )
    assert token_loss.item() == pytest.approx(3.0)  # KL reported, not in the loss
    assert token_metrics["kl_loss"].item() == pytest.approx(0.8 / 3)
    assert "entropy_loss" not in token_metrics


def test_compose_loss_requires_requested_terms() -> None:
    pg, mask = t(1.0), t(1.0)
    with pytest.raises(ValueError, match="entropy_coef=0.01 needs the per-token entropy"):
        compose_loss(pg, mask, [1], entropy_coef=0.01)
    with pytest.raises(ValueError, match="use_kl_loss=True needs the per-token kl"):
        compose_loss(pg, mask, [1], use_kl_loss=True)
    with pytest.raises(ValueError, match="unknown loss reduction 'mean'"):
        compose_loss(pg, mask, [1], reduction="mean")
