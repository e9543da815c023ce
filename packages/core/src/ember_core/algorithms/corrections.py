"""Off-policy corrections: importance weights against the engine's log-probs (TIS, masked IS,
per token or per sequence) and the named corrections a run config picks among them."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ember_core.algorithms.losses import _check_same_shape, policy_loss
from ember_core.algorithms.reductions import Lengths, sample_ids
from ember_core.algorithms.registry import Registry

# ----------------------------------------------------------------------------- bounds


TisBound = Callable[[Tensor, float, float], tuple[Tensor, Tensor]]
"""Bounds a per-token IS ratio: `(ratio, low, high) -> (weights, out_of_bounds)`, the second
1.0 where the ratio lay outside [low, high] (and the bound changed the weight)."""

TIS_MODES: Registry[TisBound] = Registry("TIS mode")
"""How `tis_weights` bounds the ratio, by name (`algorithm.tis_mode`)."""

TIS_OUT_OF_BOUNDS_METRIC = {"truncate": "tis_clipfrac", "mask": "tis_maskfrac"}
"""The name under which each built-in mode reports its share of out-of-bounds tokens."""


def tis_out_of_bounds_metric(mode: str) -> str:
    """The metric name of a mode's share of out-of-bounds tokens: the built-in name, else
    "tis_<mode>frac" for a mode a plugin registered."""
    return TIS_OUT_OF_BOUNDS_METRIC.get(mode, f"tis_{mode}frac")


@TIS_MODES.register("truncate")
def _tis_truncate(ratio: Tensor, low: float, high: float) -> tuple[Tensor, Tensor]:
    """Truncated IS (TIS): the ratio clamped to [low, high]."""
    return ratio.clamp(low, high), ((ratio < low) | (ratio > high)).to(ratio.dtype)


@TIS_MODES.register("mask")
def _tis_mask(ratio: Tensor, low: float, high: float) -> tuple[Tensor, Tensor]:
    """Masked IS (MIS): the ratio itself inside [low, high] (bounds included), 0 outside, so a
    token whose ratio left the band adds nothing to the loss; the reduction's denominators do
    not change (the token still counts as one of its sample's tokens)."""
    inside = (ratio >= low) & (ratio <= high)
    return torch.where(inside, ratio, torch.zeros_like(ratio)), (~inside).to(ratio.dtype)


# ----------------------------------------------------------------------------- levels


TisLevel = Callable[[Tensor, Tensor | None, Lengths | None], Tensor]
"""Turns the per-token log-ratios [T] into the log-ratio each token's weight is taken from
[T]: `(log_ratio, loss_mask, lengths) -> log_ratio`."""

TIS_LEVELS: Registry[TisLevel] = Registry("TIS level")
"""Where `tis_weights` takes the ratio, by name (`algorithm.tis_level`)."""

SEQUENCE_LOG_RATIO_BOUND = math.log(1e30)
"""The "sequence" level clamps a sample's summed log-ratio to +-this before exp. A sum over a
long response easily passes 88.7, where exp overflows float32 to inf, and one inf would turn
the step's mean ratio metric (train/tis) into inf; 1e30 is far outside any useful [tis_clip_low,
tis_clip] band, so the clamp never changes which samples a bound keeps or clips, while the
ratio and the per-token sums the reductions take of it (length x 1e30) stay finite in float32.
"""


@TIS_LEVELS.register("token")
def _token_level(log_ratio: Tensor, loss_mask: Tensor | None, lengths: Lengths | None) -> Tensor:
    """Each token's own ratio."""
    return log_ratio


@TIS_LEVELS.register("sequence")
def _sequence_level(log_ratio: Tensor, loss_mask: Tensor | None, lengths: Lengths | None) -> Tensor:
    """The sample's ratio on every one of its tokens: the log-ratio summed over the sample's
    counted tokens (log pi_anchor(y) / pi_rollout(y) of the counted part of the response),
    clamped to +-`SEQUENCE_LOG_RATIO_BOUND`. A sample with no counted token gets 0 (ratio 1)."""
    if loss_mask is None or lengths is None:
        raise ValueError("TIS level 'sequence' needs the loss mask and the per-sample lengths")
    if log_ratio.dim() != 1:
        raise ValueError(
            f"TIS level 'sequence' needs flat [T] log-probs, got shape {tuple(log_ratio.shape)}"
        )
    _check_same_shape(log_ratio=log_ratio, loss_mask=loss_mask)
    ids_T = sample_ids(lengths, log_ratio.numel(), log_ratio.device)
    # where, not a product: an uncounted token's value (NaN on a tool's output) stays out.
    kept_T = torch.where(loss_mask.bool(), log_ratio, torch.zeros_like(log_ratio))
    num_samples = torch.as_tensor(lengths).numel()
    sums_B = log_ratio.new_zeros(num_samples).index_add(0, ids_T, kept_T)
    sums_B = sums_B.clamp(-SEQUENCE_LOG_RATIO_BOUND, SEQUENCE_LOG_RATIO_BOUND)
    return sums_B[ids_T]


# ----------------------------------------------------------------------------- weights


def tis_weights(
    old_log_probs_train: Tensor,
    rollout_log_probs: Tensor,
    *,
    tis_clip: float,
    tis_clip_low: float = 0.0,
    mode: str = "truncate",
    level: str = "token",
    loss_mask: Tensor | None = None,
    lengths: Lengths | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Importance-sampling weights correcting the rollout/trainer mismatch, per token.

    Level "token": ratio = exp(lp_old_train - lp_rollout) per token. Level "sequence":
    ratio_i = exp(sum over sample i's counted tokens of (lp_old_train - lp_rollout)), the
    same on each of the sample's tokens (its summed log-ratio clamped first, see
    `SEQUENCE_LOG_RATIO_BOUND`). Either way detached and computed in at least float32.
    Mode "truncate": weight = clamp(ratio, tis_clip_low, tis_clip); mode "mask":
    weight = ratio where tis_clip_low <= ratio <= tis_clip, else 0. The caller multiplies the
    per-token policy loss by it before reducing. `lp_old_train` is whatever anchors the policy
    ratio (see `tis_policy_loss`).

    Args:
        old_log_probs_train: The trainer's log-probs of the old policy, any shape (flat [T]
            for the sequence level).
        rollout_log_probs: Log-probs reported by the rollout engine, same shape.
        tis_clip: Upper bound of the weight (> tis_clip_low).
        tis_clip_low: Lower bound of the weight (>= 0).
        mode: A name registered in `TIS_MODES` ("truncate" or "mask").
        level: A name registered in `TIS_LEVELS` ("token" or "sequence").
        loss_mask: Per-token mask [T]; needed by the sequence level (which sums counted tokens
            only), unused by the token level.
        lengths: Per-sample token counts [B], adding up to T; needed by the sequence level.

    Returns:
        `(weights, metrics)`: weights shaped like the inputs, without gradient; metrics
        per token: "tis" the unbounded ratio (the sample's, on each of its tokens, at the
        sequence level), and 1.0 where the ratio lay outside the bounds, as "tis_clipfrac"
        (truncate) or "tis_maskfrac" (mask).

    Raises:
        ValueError: Shape mismatch, tis_clip_low < 0, tis_clip <= tis_clip_low, an unknown
            mode or level, or the sequence level without a mask and lengths.
    """
    _check_same_shape(old_log_probs_train=old_log_probs_train, rollout_log_probs=rollout_log_probs)
    bound = TIS_MODES.get(mode)
    to_level = TIS_LEVELS.get(level)
    if not (math.isfinite(tis_clip_low) and tis_clip_low >= 0):
        raise ValueError(f"tis_clip_low must be a finite number >= 0, got {tis_clip_low!r}")
    if not (math.isfinite(tis_clip) and tis_clip > tis_clip_low):
        raise ValueError(f"tis_clip must be > tis_clip_low={tis_clip_low}, got {tis_clip!r}")
    dtype = torch.promote_types(old_log_probs_train.dtype, torch.float32)
    log_ratio = old_log_probs_train.detach().to(dtype) - rollout_log_probs.detach().to(dtype)
    raw = torch.exp(to_level(log_ratio, loss_mask, lengths))
    weights, outside = bound(raw, tis_clip_low, tis_clip)
    return weights, {"tis": raw, tis_out_of_bounds_metric(mode): outside}


def tis_policy_loss(
    log_probs: Tensor,
    rollout_log_probs: Tensor,
    advantages: Tensor,
    *,
    old_log_probs: Tensor | None,
    tis_clip: float,
    tis_clip_low: float = 0.0,
    mode: str = "truncate",
    level: str = "token",
    loss_mask: Tensor | None = None,
    lengths: Lengths | None = None,
    eps_clip: float,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped loss per token, weighted by `tis_weights` against the engine's log-probs.

    The anchor a of the ratio is the trainer's old log-probs when given; when they are not
    (None: the engine's log-probs are the old policy, `algorithm.use_rollout_log_probs`), it
    is this forward's own log-probs, detached. Then
    L = policy_loss(lp, a, A) * weight(exp(a - lp_rollout)).
    With the trainer's old log-probs this is slime's TIS (`--use-tis`), and decoupled PPO
    with the scoring forward as the proximal policy. With a = sg(lp) the
    ratio exp(lp - a) is 1 in value and its gradient is the score function, so the clip never
    acts, L = -weight * A in value, and the gradient is -weight * A * grad lp: the truncated
    (or masked) importance-sampled policy gradient of pi_theta / pi_rollout, verl's bypass
    mode with its REINFORCE loss and token-level IS (or sequence-level, with
    `level="sequence"`). The bound on the weight, not eps_clip, is then the trust region.
    Multiplying the engine-anchored PPO ratio by a second pi_theta / pi_rollout would count
    the correction twice.

    Args:
        log_probs: Current policy log-probs, differentiable, any shape (e.g. [T]).
        rollout_log_probs: The engine's log-probs of the same tokens, same shape.
        advantages: Advantages, same shape.
        old_log_probs: The trainer's old log-probs (same shape), or None as above.
        tis_clip, tis_clip_low, mode, level, loss_mask, lengths: As in `tis_weights`.
        eps_clip, eps_clip_high, eps_clip_c: As in `policy_loss`.

    Returns:
        `(loss, metrics)`: loss shaped like the inputs; per-token metrics of `policy_loss`
        and of `tis_weights`.
    """
    anchor = log_probs.detach() if old_log_probs is None else old_log_probs
    loss, metrics = policy_loss(
        log_probs,
        anchor,
        advantages,
        eps_clip=eps_clip,
        eps_clip_high=eps_clip_high,
        eps_clip_c=eps_clip_c,
    )
    weights, tis = tis_weights(
        anchor,
        rollout_log_probs,
        tis_clip=tis_clip,
        tis_clip_low=tis_clip_low,
        mode=mode,
        level=level,
        loss_mask=loss_mask,
        lengths=lengths,
    )
    return loss * weights, {**metrics, **tis}


# ----------------------------------------------------------------------------- named


@dataclass(frozen=True, slots=True, kw_only=True)
class OffPolicyCorrection:
    """One named off-policy correction (`algorithm.off_policy_correction`): the `algorithm`
    flags it stands for, and a line saying what the loss then is."""

    use_rollout_log_probs: bool
    """True: the engine's log-probs are the old policy; false: the trainer's scoring forward."""
    use_tis: bool
    """Whether the policy loss is weighted against the engine's log-probs (`tis_weights`)."""
    tis_mode: str = "truncate"
    """How the weight is bounded: a name in `TIS_MODES`."""
    tis_level: str = "token"
    """Where the weight's ratio is taken: a name in `TIS_LEVELS`."""
    summary: str
    """What the loss is, in words, for the line a run prints at start; `{band}` stands for
    the weight's bounds [tis_clip_low, tis_clip]."""

    def flags(self) -> dict[str, Any]:
        """The `algorithm` keys this correction sets, with their values."""
        return {
            "use_rollout_log_probs": self.use_rollout_log_probs,
            "use_tis": self.use_tis,
            "tis_mode": self.tis_mode,
            "tis_level": self.tis_level,
        }


OFF_POLICY_CORRECTIONS: Registry[OffPolicyCorrection] = Registry("off-policy correction")
"""Named off-policy corrections (`algorithm.off_policy_correction`); formulas in
docs/learning-stability.md."""

OFF_POLICY_CORRECTIONS.add(
    "behaviour_clip",
    OffPolicyCorrection(
        use_rollout_log_probs=True,
        use_tis=False,
        summary="the PPO clip anchored at the engine's log-probs (the behaviour policy), no "
        "importance weight",
    ),
)
OFF_POLICY_CORRECTIONS.add(
    "decoupled",
    OffPolicyCorrection(
        use_rollout_log_probs=False,
        use_tis=True,
        summary="decoupled PPO: the clip anchored at the trainer's scoring forward (the "
        "proximal policy), each token weighted by pi_prox / pi_rollout truncated to {band}",
    ),
)
_NO_CLIP = "the ratio anchored at the training forward itself (never clipped), "
OFF_POLICY_CORRECTIONS.add(
    "tis",
    OffPolicyCorrection(
        use_rollout_log_probs=True,
        use_tis=True,
        summary=f"token TIS: {_NO_CLIP}each token weighted by pi_theta / pi_rollout "
        "truncated to {band}",
    ),
)
OFF_POLICY_CORRECTIONS.add(
    "seq_tis",
    OffPolicyCorrection(
        use_rollout_log_probs=True,
        use_tis=True,
        tis_level="sequence",
        summary=f"sequence TIS: {_NO_CLIP}each sample weighted by pi_theta(y) / pi_rollout(y) "
        "truncated to {band}",
    ),
)
OFF_POLICY_CORRECTIONS.add(
    "mis",
    OffPolicyCorrection(
        use_rollout_log_probs=True,
        use_tis=True,
        tis_mode="mask",
        summary=f"masked IS: {_NO_CLIP}each token weighted by pi_theta / pi_rollout inside "
        "{band}, masked outside",
    ),
)
