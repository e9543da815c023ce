"""Per-token RL losses: KL estimators, clipped policy (PPO, GSPO), value loss, their total.

Importance weights against the engine's log-probs (TIS) live in `corrections`."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from ember_core.algorithms.reductions import (
    REDUCTIONS,
    Lengths,
    masked_sample_mean,
    sample_ids,
)
from ember_core.algorithms.registry import Registry

# All losses here are elementwise: inputs are per-token tensors of one shape (normally the
# flat [T] layout described in `reductions`), outputs have that shape too, and metrics are
# per-token tensors that the caller reduces with the same mask and mode as the loss.


def _check_same_shape(**tensors: Tensor) -> None:
    (first_name, first), *rest = tensors.items()
    for name, tensor in rest:
        if tensor.shape != first.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but {first_name} has {tuple(first.shape)}"
            )


def _check_positive(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


# ----------------------------------------------------------------------------- KL


KL_ESTIMATORS: Registry[Callable[[Tensor], Tensor]] = Registry("KL kind")
"""Per-token KL estimators by name; each maps the log-ratio r = lp - lp_ref to a KL value."""

LOW_VAR_KL_CLAMP = 10.0
"""k3 / low_var_kl values are clamped to [-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP]."""


@KL_ESTIMATORS.register("k1")
def _kl_k1(log_ratio: Tensor) -> Tensor:
    return log_ratio


@KL_ESTIMATORS.register("k2")
def _kl_k2(log_ratio: Tensor) -> Tensor:
    return log_ratio.square() / 2


@KL_ESTIMATORS.register("k3", "low_var_kl")
def _kl_k3(log_ratio: Tensor) -> Tensor:
    # expm1 keeps precision when r is near 0, where the estimator is nearly exactly 0.
    kl = torch.expm1(-log_ratio) + log_ratio
    return kl.clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)


def approx_kl(log_probs: Tensor, ref_log_probs: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(policy || reference) from sampled-token log-probs.

    With r = log_probs - ref_log_probs (Schulman's estimators, http://joschu.net/blog/kl-approx.html):
        "k1": r (unbiased, high variance, can be negative);
        "k2": r^2 / 2;
        "k3" (alias "low_var_kl"): exp(-r) - 1 + r (unbiased, >= 0, low variance).
    "k3" and "low_var_kl" are one estimator: both are clamped to [-10, 10] (the value is
    never negative, so in effect capped at 10, which happens when the policy's log-prob is
    more than about 2.6 nats below the reference's). The clamp stops a few wild tokens
    from dominating the loss; beyond it the gradient is zero.

    Computed in float32 whatever the input dtype.

    Args:
        log_probs: Policy log-probs of the sampled tokens, any shape.
        ref_log_probs: Reference log-probs, same shape.
        kind: A name registered in `KL_ESTIMATORS`.

    Returns:
        float32 tensor shaped like the inputs.

    Raises:
        ValueError: Unknown `kind` (the message lists the known ones) or shape mismatch.
    """
    estimator = KL_ESTIMATORS.get(kind)
    _check_same_shape(log_probs=log_probs, ref_log_probs=ref_log_probs)
    return estimator(log_probs.float() - ref_log_probs.float())


# ----------------------------------------------------------------------------- policy


def _clipped_surrogate(
    log_ratio: Tensor,
    advantages: Tensor,
    eps_clip: float,
    eps_clip_high: float | None,
    eps_clip_c: float | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    _check_positive("eps_clip", eps_clip)
    high = eps_clip if eps_clip_high is None else eps_clip_high
    _check_positive("eps_clip_high", high)
    if eps_clip_c is not None and not (math.isfinite(eps_clip_c) and eps_clip_c > 1):
        raise ValueError(f"eps_clip_c (dual-clip bound) must be > 1, got {eps_clip_c!r}")

    ratio = torch.exp(log_ratio)
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1 - eps_clip, 1 + high) * advantages
    loss = torch.maximum(unclipped, clipped)
    clip_taken = clipped > unclipped
    if eps_clip_c is not None:
        # Dual clip bounds the loss of negative-advantage tokens whose ratio exploded.
        dual = -eps_clip_c * advantages
        dual_taken = (advantages < 0) & (dual < loss)
        loss = torch.where(dual_taken, dual, loss)
    else:
        dual_taken = torch.zeros_like(clip_taken)
    metrics = {
        "pg_clipfrac": clip_taken.to(loss.dtype),
        "ppo_kl": (-log_ratio).detach(),
        "dual_clipfrac": dual_taken.to(loss.dtype),
    }
    return loss, metrics


def policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped policy-gradient loss per token, with asymmetric and dual clipping.

    ratio = exp(lp - lp_old);
    L = max(-ratio * A, -clip(ratio, 1 - eps_clip, 1 + eps_clip_high) * A);
    with dual clip (eps_clip_c = c > 1), tokens with A < 0 get L = min(L, -c * A).

    Args:
        log_probs: Current policy log-probs of the sampled tokens, any shape (e.g. [T]).
        old_log_probs: Log-probs under the policy that generated the batch, same shape.
        advantages: Advantages, same shape.
        eps_clip: Lower clip range (> 0).
        eps_clip_high: Upper clip range (> 0); defaults to `eps_clip`.
        eps_clip_c: Dual-clip bound c (> 1), or None for no dual clip.

    Returns:
        `(loss, metrics)`: loss shaped like the inputs; metrics are per-token tensors of
        the same shape, detached, for the caller to reduce:
        "pg_clipfrac" 1.0 where the clipped term is strictly larger than the unclipped one
        (the clipped branch is taken), "ppo_kl" lp_old - lp, "dual_clipfrac" 1.0 where the
        dual-clip bound replaced the loss (always 0 without dual clip).

    Raises:
        ValueError: Shape mismatch, eps_clip or eps_clip_high <= 0, eps_clip_c <= 1.
    """
    _check_same_shape(log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages)
    return _clipped_surrogate(
        log_probs - old_log_probs, advantages, eps_clip, eps_clip_high, eps_clip_c
    )


def gspo_log_ratio(
    log_probs: Tensor, old_log_probs: Tensor, loss_mask: Tensor, lengths: Lengths
) -> Tensor:
    """GSPO sequence-level log importance ratio, broadcast to the sample's tokens.

    For sample i: s_i = sum_t m_t (lp_t - lp_old_t) / max(sum_t m_t, 1), the length-
    normalised log of pi(y_i) / pi_old(y_i); every token of sample i gets s_i. The value
    stays differentiable in `log_probs`, so a loss clipped on it moves all the sample's
    tokens together (GSPO, arXiv 2507.18071). A fully masked sample gets 0 (ratio 1).

    Args:
        log_probs: Current log-probs, packed [T].
        old_log_probs: Old log-probs, packed [T].
        loss_mask: Per-token mask [T].
        lengths: Per-sample token counts [B], adding up to T.

    Returns:
        Tensor [T].
    """
    _check_same_shape(log_probs=log_probs, old_log_probs=old_log_probs, loss_mask=loss_mask)
    per_sample_B = masked_sample_mean(log_probs - old_log_probs, loss_mask, lengths)
    return per_sample_B[sample_ids(lengths, log_probs.numel(), log_probs.device)]


def gspo_policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    lengths: Lengths,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO loss per token: `policy_loss` clipping applied to `gspo_log_ratio`.

    Same clipping, arguments and metrics as `policy_loss` (GSPO's clip ranges are much
    smaller, around 3e-4 / 4e-4), except that the ratio of every token is the sample's
    sequence-level ratio, and "ppo_kl" is the sample's -s_i on each of its tokens.

    Args:
        log_probs: Current log-probs, packed [T].
        old_log_probs: Old log-probs, packed [T].
        advantages: Advantages [T] (constant within a sample for GSPO).
        loss_mask: Per-token mask [T].
        lengths: Per-sample token counts [B], adding up to T.
        eps_clip: Lower clip range (> 0).
        eps_clip_high: Upper clip range (> 0); defaults to `eps_clip`.
        eps_clip_c: Dual-clip bound c (> 1), or None.

    Returns:
        `(loss [T], metrics)` as in `policy_loss`.
    """
    _check_same_shape(log_probs=log_probs, advantages=advantages)
    log_ratio = gspo_log_ratio(log_probs, old_log_probs, loss_mask, lengths)
    return _clipped_surrogate(log_ratio, advantages, eps_clip, eps_clip_high, eps_clip_c)


# ----------------------------------------------------------------------------- value


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, *, value_clip: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss per token.

    Vc = V_old + clamp(V - V_old, -value_clip, value_clip);
    L = 0.5 * max((Vc - R)^2, (V - R)^2). The factor 0.5 makes the gradient of the
    unclipped branch V - R, as in OpenRLHF, verl and slime.

    Args:
        values: Current critic values, any shape (e.g. [T]).
        old_values: Values from the critic that scored the batch, same shape.
        returns: Regression targets, same shape.
        value_clip: Clip range for V - V_old (> 0).

    Returns:
        `(loss, metrics)`: loss shaped like the inputs; "value_clipfrac" per token, 1.0
        where the clipped term is strictly larger than the unclipped one.

    Raises:
        ValueError: Shape mismatch or value_clip <= 0.
    """
    _check_same_shape(values=values, old_values=old_values, returns=returns)
    _check_positive("value_clip", value_clip)
    clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)
    unclipped_sq = (values - returns).square()
    clipped_sq = (clipped_values - returns).square()
    loss = 0.5 * torch.maximum(unclipped_sq, clipped_sq)
    return loss, {"value_clipfrac": (clipped_sq > unclipped_sq).to(loss.dtype)}


# ----------------------------------------------------------------------------- total


def compose_loss(
    pg_loss: Tensor,
    loss_mask: Tensor,
    lengths: Lengths,
    *,
    pg_metrics: Mapping[str, Tensor] | None = None,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    kl: Tensor | None = None,
    kl_loss_coef: float = 0.0,
    use_kl_loss: bool = False,
    reduction: str = "sample",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Reduces per-token terms and combines them into the actor's scalar loss.

    loss = pg_loss - entropy_coef * entropy_loss + kl_loss_coef * kl_loss (the last term
    only when `use_kl_loss`), each term reduced with `reduce_loss(..., mode=reduction)`.

    Args:
        pg_loss: Per-token policy loss [T] (already multiplied by TIS weights, if any: see
            `corrections`).
        loss_mask: Per-token mask [T].
        lengths: Per-sample token counts [B], adding up to T.
        pg_metrics: Per-token metrics from `policy_loss` / `tis_weights`; each is reduced
            like the loss and returned under its own name.
        entropy: Per-token entropy [T] of the current policy; needed if entropy_coef != 0.
        entropy_coef: Weight of the entropy bonus.
        kl: Per-token KL to the reference [T] (see `approx_kl`); needed if `use_kl_loss`.
            When given it is reported as "kl_loss" even if it is not in the loss.
        kl_loss_coef: Weight of the KL loss.
        use_kl_loss: Whether the KL term enters the loss.
        reduction: A name registered in `REDUCTIONS` ("sample" or "token").

    Returns:
        `(loss, metrics)`: the scalar loss to backpropagate, and detached scalar metrics
        "loss", "pg_loss", every `pg_metrics` key (normally "pg_clipfrac", "ppo_kl"),
        "entropy_loss" (mean entropy, when `entropy` is given) and "kl_loss" (when `kl` is
        given). Names carry no "train/" prefix.

    Raises:
        ValueError: A term is requested but its per-token tensor is missing, or a
            reduction argument is invalid.
    """
    reduce = REDUCTIONS.get(reduction)
    if entropy is None and entropy_coef != 0:
        raise ValueError(f"entropy_coef={entropy_coef} needs the per-token entropy")
    if kl is None and use_kl_loss:
        raise ValueError("use_kl_loss=True needs the per-token kl")

    pg = reduce(pg_loss, loss_mask, lengths)
    total = pg
    metrics: dict[str, Tensor] = {"pg_loss": pg.detach()}
    for name, per_token in (pg_metrics or {}).items():
        metrics[name] = reduce(per_token.detach(), loss_mask, lengths)
    if entropy is not None:
        entropy_loss = reduce(entropy, loss_mask, lengths)
        metrics["entropy_loss"] = entropy_loss.detach()
        if entropy_coef != 0:
            total = total - entropy_coef * entropy_loss
    if kl is not None:
        kl_loss = reduce(kl, loss_mask, lengths)
        metrics["kl_loss"] = kl_loss.detach()
        if use_kl_loss:
            total = total + kl_loss_coef * kl_loss
    return total, {"loss": total.detach(), **metrics}
