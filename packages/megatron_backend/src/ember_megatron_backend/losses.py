"""One micro-batch's training forward and its losses, from the ember-core formulas."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ember_core.algorithms import (
    approx_kl,
    compose_loss,
    gspo_policy_loss,
    policy_loss,
    reduce_loss,
    tis_out_of_bounds_metric,
    tis_policy_loss,
    tis_weights,
    value_loss,
)
from ember_core.config import AlgorithmConfig
from ember_core.heads import HeadOutput, PolicyHead, ValueHead
from ember_megatron_backend.batches import MicroBatch, RolloutBatch
from ember_megatron_backend.forward import run_model

__all__ = [
    "actor_loss",
    "actor_policy_loss",
    "actor_metric_keys",
    "critic_loss",
    "local_denominator",
    "mismatch_key",
    "policy_forward",
    "policy_head",
    "value_forward",
    "value_head",
]


def policy_forward(model: Any, mb: MicroBatch, temperature: float) -> HeadOutput:
    """Training forward of a policy: response log-probs and entropy, differentiable."""
    return policy_head(run_model(model, mb.packed, mb.layout, window=mb.window), mb, temperature)


def policy_head(rows: Tensor, mb: MicroBatch, temperature: float) -> HeadOutput:
    """Response log-probs and entropy from a policy's output rows [N, V] of the micro-batch's
    response window (what ``run_model`` returns, or the last pipeline stage's)."""
    window = mb.window.batch
    return PolicyHead(temperature).log_probs(
        rows,
        window.tokens.to(rows.device),
        window.total_lengths,
        window.response_lengths,
        with_entropy=True,
    )


def value_forward(model: Any, mb: MicroBatch) -> list[Tensor]:
    """Training forward of the critic: values at the response rows, differentiable."""
    return value_head(run_model(model, mb.packed, mb.layout, window=mb.window), mb)


def value_head(rows: Tensor, mb: MicroBatch) -> list[Tensor]:
    """Values at the response rows from a critic's output rows [N, 1] of the micro-batch's
    response window (what ``run_model`` returns, or the last pipeline stage's)."""
    window = mb.window.batch
    return ValueHead().values(rows, window.total_lengths, window.response_lengths)


def _cat(tensors: list[Tensor], indices: list[int], device: torch.device) -> Tensor:
    return torch.cat([tensors[i] for i in indices]).to(device)


def local_denominator(batch: RolloutBatch, indices: list[int], reduction: str) -> float:
    """What ember-core's reduction divides a micro-batch's sum by: its number of samples
    ("sample"), or of counted tokens ("token")."""
    if reduction == "token":
        return float(sum(float(batch.loss_masks[i].sum()) for i in indices))
    return float(len(indices))


def actor_metric_keys(algorithm: AlgorithmConfig, batch: RolloutBatch) -> list[str]:
    """The metric names `actor_loss` returns for this configuration, in a fixed order."""
    keys = ["loss", "pg_loss", "pg_clipfrac", "ppo_kl", "ppo_kl_abs_max", "entropy_loss"]
    if batch.ref_log_probs is not None:
        keys.append("kl_loss")
    if algorithm.eps_clip_c is not None:
        keys.append("dual_clipfrac")
    if batch.rollout_log_probs is not None:
        keys.append(mismatch_key(batch))
        if algorithm.use_tis:
            keys += ["tis", tis_out_of_bounds_metric(algorithm.tis_mode), "tis_max"]
        else:
            keys += ["behaviour_ratio", "behaviour_ratio_max"]
    return keys


def mismatch_key(batch: RolloutBatch) -> str:
    """The name of the step metric |trainer log-prob - engine log-prob|: with samples from the
    trainer's own weights, `train_rollout_logprob_abs_diff` (the numerical mismatch); with
    samples from older weights (`RolloutBatch.stale`), `stale_rollout_logprob_abs_diff`, which
    holds the weights' staleness too."""
    return "stale_rollout_logprob_abs_diff" if batch.stale else "train_rollout_logprob_abs_diff"


def actor_policy_loss(
    log_probs: Tensor,
    old: Tensor,
    rollout: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    lengths: list[int],
    algorithm: AlgorithmConfig,
    *,
    sequence_ratio: bool,
    old_from_engine: bool,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The actor's policy loss per token, before reduction, as `algorithm` configures it.

    PPO's clipped surrogate against `old`, or GSPO's sequence-level ratio when the estimator
    asks for it (`sequence_ratio`); scaled per token by TIS weights against the engine's
    log-probs when `use_tis`, taken per token or per sample (`tis_level`) and bounded by
    `tis_mode` (``tis_policy_loss``: with the engine's log-probs as the old policy,
    `old_from_engine`, the weight is this forward's pi_theta / pi_rollout and replaces the
    ratio). A named `algorithm.off_policy_correction` has already set those flags; the
    objective is the same at an audit iteration, where the trainer's own scoring is only
    checked and logged (``actor_loss``).

    Args:
        log_probs: This forward's log-probs [T], differentiable.
        old: The old policy's log-probs [T] (the engine's when `old_from_engine`).
        rollout: The engine's log-probs [T], or None when the batch has none.
        advantages: Advantages [T].
        mask: Loss mask [T].
        lengths: The samples' response lengths, adding up to T.
        algorithm: The objective's settings.
        sequence_ratio: The estimator's GSPO sequence-level ratio.
        old_from_engine: `old` is the engine's log-probs (`algorithm.use_rollout_log_probs`).

    Returns:
        `(loss [T], metrics)`: per-token metrics of ``policy_loss`` and, with TIS, of
        ``tis_weights``.
    """
    clip = dict(
        eps_clip=algorithm.eps_clip,
        eps_clip_high=algorithm.eps_clip_high,
        eps_clip_c=algorithm.eps_clip_c,
    )
    tis = dict(
        tis_clip=algorithm.tis_clip,
        tis_clip_low=algorithm.tis_clip_low,
        mode=algorithm.tis_mode,
        level=algorithm.tis_level,
        loss_mask=mask,
        lengths=lengths,
    )
    # `MegatronWorker.train` refused a batch without the engine's log-probs under use_tis.
    if sequence_ratio:
        pg, per_token = gspo_policy_loss(log_probs, old, advantages, mask, lengths, **clip)
        if algorithm.use_tis:
            # Config refuses GSPO with TIS when the old log-probs are the engine's.
            assert rollout is not None and not old_from_engine
            weights, extra = tis_weights(old, rollout, **tis)
            return pg * weights, {**per_token, **extra}
        return pg, per_token
    if algorithm.use_tis:
        # With the engine's log-probs as the old policy (outside audits) the weight's numerator
        # and the ratio's anchor are this forward's own log-probs (see `tis_policy_loss`).
        assert rollout is not None
        anchor = None if old_from_engine else old
        return tis_policy_loss(log_probs, rollout, advantages, old_log_probs=anchor, **tis, **clip)
    return policy_loss(log_probs, old, advantages, **clip)


def actor_loss(
    head: HeadOutput,
    mb: MicroBatch,
    batch: RolloutBatch,
    algorithm: AlgorithmConfig,
    *,
    sequence_ratio: bool,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The actor's loss on one micro-batch, reduced as `algorithm.loss_reduction` says (mean
    over the micro-batch), with detached metrics named as in `actor_metric_keys`.

    Policy loss per token from `actor_policy_loss`; then entropy bonus and KL loss (to the
    reference, reported whenever a reference exists) by ``compose_loss``. With TIS, "tis_max"
    is the largest unbounded ratio over the micro-batch's counted tokens (at the sequence
    level: over its samples with a counted token; a maximum, not a mean: see
    `metrics.STEP_MAXIMA`). With the engine's log-probs and no TIS, "behaviour_ratio" and
    "behaviour_ratio_max" are the mean and largest pi_theta / pi_rollout of this forward.

    The loss's old policy is the engine's log-probs whenever `algorithm.use_rollout_log_probs`
    says so, at an audit too: the trainer's scoring forward of an audit (`batch.log_probs`
    then) is what "ppo_kl" and the train/rollout mismatch compare with, never what the
    gradient follows. "ppo_kl" is lp_old - lp per token with lp_old the batch's old log-probs
    (`batch.log_probs`: the engine's between audits under `use_rollout_log_probs`), so the
    corrections whose ratio is 1 (`tis`, `seq_tis`, `mis`) still report the policy's distance
    from the sampler. "ppo_kl_abs_max" is the largest |lp_old - lp| of one token over the
    micro-batch's counted tokens (a maximum: `metrics.STEP_MAXIMA`), token by token under GSPO
    too: at a rollout's first step it is exactly 0 only if every token's log-prob is, where the
    signed mean "ppo_kl" can cancel.
    """
    log_probs = torch.cat(head.log_probs)
    device = log_probs.device
    idx = mb.indices
    mask = _cat(batch.loss_masks, idx, device)
    counted = mask > 0

    def given(tensors: list[Tensor]) -> Tensor:
        # Uncounted tokens (a tool's output) may carry anything, NaN included: zero them before
        # any arithmetic, since 0 x NaN in the backward pass would still reach the weights.
        values = _cat(tensors, idx, device)
        return torch.where(counted, values, torch.zeros_like(values))

    scored = given(batch.log_probs)
    lengths = [batch.samples[i].response_length for i in idx]
    rollout = None if batch.rollout_log_probs is None else given(batch.rollout_log_probs)
    engine_old = algorithm.use_rollout_log_probs
    # `MegatronWorker.prepare` refused a batch without the engine's log-probs here.
    assert rollout is not None or not engine_old
    old = rollout if engine_old else scored
    pg, per_token = actor_policy_loss(
        log_probs,
        old,
        rollout,
        given(batch.advantages),
        mask,
        lengths,
        algorithm,
        sequence_ratio=sequence_ratio,
        old_from_engine=engine_old,
    )
    ppo_kl = (scored - log_probs.detach()) if engine_old else per_token["ppo_kl"]
    token_gaps = (scored - log_probs.detach()).abs()[counted]  # the old policy's, token by token
    ppo_kl_abs_max = token_gaps.max() if token_gaps.numel() else log_probs.new_zeros(())
    metrics = {"pg_clipfrac": per_token["pg_clipfrac"], "ppo_kl": ppo_kl}
    if algorithm.eps_clip_c is not None:
        metrics["dual_clipfrac"] = per_token["dual_clipfrac"]
    tis_max = behaviour_max = None
    if rollout is not None:
        # The trainer's old log-probs against the engine's; when the old ones are the engine's
        # (use_rollout_log_probs outside audits), this step's own (at step 0 the same weights
        # as the sampler's unless the batch is stale: the mismatch).
        trained = log_probs.detach() if batch.old_from_engine else scored
        metrics[mismatch_key(batch)] = (trained - rollout).abs()
        if algorithm.use_tis:
            out = tis_out_of_bounds_metric(algorithm.tis_mode)
            metrics["tis"], metrics[out] = per_token["tis"], per_token[out]
            counted_ratios = per_token["tis"][counted]
            tis_max = (
                counted_ratios.max() if counted_ratios.numel() else per_token["tis"].new_zeros(())
            )
        else:
            # Without TIS the behaviour ratio pi_theta / pi_rollout weights nothing; it is
            # logged so that every correction reports how far the policy is from the sampler
            # (its clipped fraction is pg_clipfrac when the engine's log-probs are the old ones).
            ratio = torch.exp(log_probs.detach() - rollout)
            metrics["behaviour_ratio"] = ratio
            counted_ratios = ratio[counted]
            behaviour_max = counted_ratios.max() if counted_ratios.numel() else ratio.new_zeros(())
    kl = None
    if batch.ref_log_probs is not None:
        kl = approx_kl(log_probs, given(batch.ref_log_probs), algorithm.kl_loss_type)
    loss, reduced = compose_loss(
        pg,
        mask,
        lengths,
        pg_metrics=metrics,
        entropy=torch.cat(head.entropy) if head.entropy is not None else None,
        entropy_coef=algorithm.entropy_coef,
        kl=kl,
        kl_loss_coef=algorithm.kl_loss_coef,
        use_kl_loss=algorithm.use_kl_loss,
        reduction=algorithm.loss_reduction,
    )
    reduced["ppo_kl_abs_max"] = ppo_kl_abs_max
    if tis_max is not None:
        reduced["tis_max"] = tis_max.detach()
    if behaviour_max is not None:
        reduced["behaviour_ratio_max"] = behaviour_max
    return loss, reduced


def critic_loss(
    values: list[Tensor], mb: MicroBatch, batch: RolloutBatch, algorithm: AlgorithmConfig
) -> tuple[Tensor, dict[str, Tensor]]:
    """The clipped value loss on one micro-batch (mean over it), with "value_loss" and
    "value_clipfrac"."""
    assert batch.values is not None
    current = torch.cat(values).float()
    device = current.device
    idx = mb.indices
    mask = _cat(batch.loss_masks, idx, device)
    lengths = [batch.samples[i].response_length for i in idx]
    per_token, extra = value_loss(
        current,
        _cat(batch.values, idx, device),
        _cat(batch.returns, idx, device),
        value_clip=algorithm.value_clip,
    )
    loss = reduce_loss(per_token, mask, lengths, algorithm.loss_reduction)
    clipfrac = reduce_loss(extra["value_clipfrac"], mask, lengths, algorithm.loss_reduction)
    return loss, {"value_loss": loss.detach(), "value_clipfrac": clipfrac.detach()}
