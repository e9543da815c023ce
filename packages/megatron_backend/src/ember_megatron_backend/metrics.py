"""Metrics reduced across data-parallel ranks: a rollout's means and maxima, a step's sums."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ember_megatron_backend import comm
from ember_megatron_backend.batches import RolloutBatch

__all__ = [
    "AUDIT",
    "MISMATCH_MAX_ABS_DIFF",
    "REF_MAX_ABS_DIFF",
    "REF_REBUILT_MAX_ABS_DIFF",
    "REF_REPLAYED_MAX_ABS_DIFF",
    "ROLLOUT_KEYS",
    "STEP_MAXIMA",
    "SampleMeans",
    "accumulate",
    "masked_max_abs_diff",
    "reduce_sums",
    "rollout_metrics",
    "routing_means",
]

ROLLOUT_KEYS = (
    "rollout/rewards",
    "rollout/response_length",
    "rollout/log_probs",
    "rollout/ref_log_probs",
    "rollout/rollout_log_probs",
    "rollout/entropy",
    "rollout/advantages",
    "rollout/returns",
    "rollout/values",
    "rollout/train_rollout_logprob_abs_diff",
    "rollout/routing_agreement",
    "rollout/replay_agreement",
    "rollout/shifted_replay_agreement",
)
"""Every rollout metric that is a mean over samples, in the fixed order ranks reduce them in."""

REF_MAX_ABS_DIFF = "rollout/log_probs_ref_max_abs_diff"
"""max |log_prob - ref_log_prob| over the counted response tokens of every rank (a reference
exists): the per-token comparison of actor and reference, which a difference of means can hide."""
MISMATCH_MAX_ABS_DIFF = "rollout/train_rollout_logprob_max_abs_diff"
"""max |trainer old log-prob - engine log-prob| over the counted response tokens of every rank,
logged where the trainer scored the rollout (and the engine reported log-probs)."""
AUDIT = "rollout/audit"
"""1.0 on an audit iteration (`RolloutBatch.audit`); absent otherwise."""
VERSIONS_BEHIND_MAX = "rollout/versions_behind_max"
"""The most updates the trainer's weights are ahead of those that began a sample of the rollout
(its recorded `weight_version`; the oldest span's under partial rollouts), over every rank, as
the trainer reads it when it scores the rollout; 0 for samples without an integer version."""
TRAIN_PADDING = "rollout/train_padding"
"""The share of the positions the rollout's training forwards process that are padding, over
every rank: without Transformer Engine each micro-batch is padded to its longest sample
(`train.micro_batches_by_length` groups like lengths); 0 with its packed streams."""
REF_REPLAYED_MAX_ABS_DIFF = "rollout/ref_replayed_log_probs_max_abs_diff"
"""The same maximum against the reference's check-only forward with the rollout's routing
replayed (`Phase.REPLAY_CHECK`); logged only at the rollouts a plugin asked for it."""
REF_REBUILT_MAX_ABS_DIFF = "rollout/ref_rebuilt_log_probs_max_abs_diff"
"""max |reference - rebuilt reference| log-prob over the counted response tokens of every rank:
the reference the run holds (after a resume, the checkpoint's) against one rebuilt from its
source; logged only at the rollouts a plugin asked for it."""


class SampleMeans:
    """Means over samples of per-sample values, summed and counted across ranks.

    Every rank must use the same keys in the same order (the reduction is one all-reduce of a
    [K, 2] tensor); a key no sample contributed to on any rank is left out of the result.
    """

    def __init__(self, keys: Iterable[str]) -> None:
        self.keys = list(keys)
        self._index = {k: i for i, k in enumerate(self.keys)}
        self._acc = torch.zeros(len(self.keys), 2, dtype=torch.float64)

    def add(self, key: str, values: Tensor | list[float]) -> None:
        """Add per-sample values of `key` (one number per sample)."""
        values = torch.as_tensor(values, dtype=torch.float64).reshape(-1)
        row = self._acc[self._index[key]]
        row[0] += values.sum()
        row[1] += values.numel()

    def reduce(self, group: Any = None) -> dict[str, float]:
        """The means over all ranks of `group` (None: this rank only)."""
        acc = self._acc.clone()
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            comm.all_reduce(acc, group=group)
        return {
            key: float(acc[i, 0] / acc[i, 1]) for i, key in enumerate(self.keys) if acc[i, 1] > 0
        }


STEP_MAXIMA = frozenset({"tis_max", "behaviour_ratio_max", "ppo_kl_abs_max"})
"""Step metrics that are maxima over the step's counted tokens, not weighted means: a
micro-batch's value replaces the running one when larger, and ranks take the maximum. Each is
>= 0, so a pipeline stage that computed nothing (0) does not change it."""


def _is_maximum(key: str) -> bool:
    return key.rsplit("/", 1)[-1] in STEP_MAXIMA


def accumulate(sums: dict[str, Tensor], metrics: dict[str, Tensor], weight: float) -> None:
    """Add one micro-batch's metrics into a step's running values: weighted by the
    micro-batch's share `weight` of the step's denominator, or by maximum (`STEP_MAXIMA`)."""
    for key, metric in metrics.items():
        value = metric.double().cpu()
        sums[key] = (
            torch.maximum(sums[key], value) if _is_maximum(key) else sums[key] + value * weight
        )


def reduce_sums(values: dict[str, Tensor | float], group: Any = None) -> dict[str, float]:
    """Sum each value over the ranks of `group` (the maximum for `STEP_MAXIMA` keys); every
    rank passes the same keys in order."""
    keys = list(values)
    acc = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        maxima = torch.tensor([_is_maximum(k) for k in keys])
        if maxima.any():
            top = torch.where(maxima, acc, torch.zeros_like(acc))
            comm.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        comm.all_reduce(acc, group=group)
        if maxima.any():
            acc = torch.where(maxima, top, acc)
    return {k: float(v) for k, v in zip(keys, acc, strict=True)}


def masked_max_abs_diff(
    a: list[Tensor], b: list[Tensor], masks: list[Tensor], group: Any = None
) -> float | None:
    """max |a - b| over the tokens whose mask is non-zero, on every rank of `group`.

    Every rank of `group` must call it (one MAX all-reduce). A NaN difference counts as +inf,
    so it survives the reduction (gloo's MAX may drop a NaN).

    Args:
        a, b: Per-sample per-token values ([R_i] each), paired by position.
        masks: Per-sample loss masks ([R_i] each).
        group: The process group (None: this rank only).

    Returns:
        The maximum, or None when no rank has a counted token.
    """
    local = torch.full((1,), -math.inf, dtype=torch.float64)
    for x, y, m in zip(a, b, masks, strict=True):
        counted = (x.double() - y.double()).abs()[m > 0]
        if counted.numel():
            local = torch.maximum(local, counted.nan_to_num(nan=math.inf).max())
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        comm.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
    value = float(local[0])
    return None if value == -math.inf else value


def _masked_means(per_token: list[Tensor], masks: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Per-sample means over counted tokens, and which samples have any counted token.

    One concatenation and one segment sum for the whole batch (not a handful of ops per sample):
    a rollout has hundreds of samples of a few tokens each.
    """
    if len(per_token) != len(masks):
        raise ValueError(f"{len(per_token)} per-token tensors for {len(masks)} loss masks")
    lengths = torch.tensor([m.numel() for m in masks])
    if any(t.numel() != n for t, n in zip(per_token, lengths.tolist(), strict=True)):
        raise ValueError("a per-token tensor's length differs from its sample's loss mask")
    mask = torch.cat(masks).double()
    segment = torch.repeat_interleave(torch.arange(len(masks)), lengths)
    sums = torch.zeros(len(masks), dtype=torch.float64)
    # where, not a product: an uncounted token's value (NaN on a tool's output) stays out.
    sums.index_add_(0, segment, torch.where(mask > 0, torch.cat(per_token).double() * mask, 0.0))
    counts = torch.zeros(len(masks), dtype=torch.float64).index_add_(0, segment, mask)
    has = counts > 0
    return sums[has] / counts[has], has


def rollout_metrics(batch: RolloutBatch, group: Any = None) -> dict[str, float]:
    """The rollout/* metrics of DESIGN section 3 as means over the samples of all ranks, and
    `REF_MAX_ABS_DIFF` when a reference exists.

    Token quantities are first averaged over each sample's counted (loss-mask) response tokens;
    samples without a counted token do not enter those means. rollout/routing_agreement is the
    mean over samples of each sample's fraction of agreeing (position, MoE layer) routings;
    rollout/replay_agreement, logged only when routers replay, is the same for the experts the
    forward actually used. `REF_MAX_ABS_DIFF` (and `REF_REPLAYED_MAX_ABS_DIFF`, when the batch
    holds the replayed reference's log-probs) is a maximum over the counted tokens of all ranks,
    as is `REF_REBUILT_MAX_ABS_DIFF` (reference against a rebuilt reference, when the batch holds
    one's log-probs). `MISMATCH_MAX_ABS_DIFF` is the same maximum of |trainer - engine| log-prob.
    When the old log-probs are the engine's (`algorithm.use_rollout_log_probs` outside audit
    iterations), the metrics that compare the trainer's own log-probs with something
    (rollout/log_probs, the mismatch, the maxima) are left out. `AUDIT` is 1.0 on an audit
    iteration.
    """
    means = SampleMeans(ROLLOUT_KEYS)
    masks = batch.loss_masks
    means.add("rollout/rewards", [float(s.reward) for s in batch.samples])
    means.add("rollout/response_length", batch.response_lengths)
    scored = not batch.old_from_engine
    per_token = {
        "rollout/log_probs": batch.log_probs if scored else None,
        "rollout/ref_log_probs": batch.ref_log_probs,
        "rollout/rollout_log_probs": batch.rollout_log_probs,
        "rollout/entropy": batch.entropy,
        "rollout/advantages": batch.advantages,
        "rollout/returns": batch.returns,
        "rollout/values": batch.values,
    }
    if batch.rollout_log_probs is not None and scored:
        per_token["rollout/train_rollout_logprob_abs_diff"] = [
            (a - b).abs() for a, b in zip(batch.log_probs, batch.rollout_log_probs, strict=True)
        ]
    for key, tensors in per_token.items():
        if tensors is not None and tensors:
            means.add(key, _masked_means(tensors, masks)[0])
    if batch.routing is not None:
        agree, compared = batch.routing[:, 0], batch.routing[:, 1]
        has = compared > 0
        means.add("rollout/routing_agreement", agree[has] / compared[has])
        replayed, replay_compared = batch.routing[:, 2], batch.routing[:, 3]
        has = replay_compared > 0
        means.add("rollout/replay_agreement", replayed[has] / replay_compared[has])
    if batch.shifted_routing is not None:
        # Replay of experts no router picks by itself (an audit's probe): 1.0 only by replay.
        replayed, replay_compared = batch.shifted_routing[:, 2], batch.shifted_routing[:, 3]
        has = replay_compared > 0
        means.add("rollout/shifted_replay_agreement", replayed[has] / replay_compared[has])
    metrics = means.reduce(group)
    if batch.audit:
        metrics[AUDIT] = 1.0
    # Each is None or not on every rank alike: one config builds the models, the replayed
    # forward and the audit are asked for by rollout id, and rollout log-probs are all-reduced.
    maxima = {
        REF_MAX_ABS_DIFF: batch.ref_log_probs,
        REF_REPLAYED_MAX_ABS_DIFF: batch.ref_replayed_log_probs,
        MISMATCH_MAX_ABS_DIFF: batch.rollout_log_probs,
    }
    for key, ref in maxima.items():
        if ref is not None and scored:
            largest = masked_max_abs_diff(batch.log_probs, ref, masks, group)
            if largest is not None:
                metrics[key] = largest
    if batch.ref_rebuilt_log_probs is not None:
        largest = masked_max_abs_diff(
            batch.ref_log_probs, batch.ref_rebuilt_log_probs, masks, group
        )
        if largest is not None:
            metrics[REF_REBUILT_MAX_ABS_DIFF] = largest
    return metrics


def routing_means(counts: Tensor, indices: list[int], group: Any = None) -> dict[str, float]:
    """`train/routing_agreement` and `train/replay_agreement` of one training step: means over
    the step's samples on every rank of `group` of each sample's fraction of agreeing
    (position, MoE layer) routings, from `RoutingRecorder.record` counts.

    Collective: every rank of `group` calls it. A fraction no sample of any rank measured
    (`replay_agreement` without replay) is left out.

    Args:
        counts: [B, 4] float64 counts of the rank's rollout batch (see `RolloutBatch.routing`).
        indices: The step's samples on this rank (rows of `counts`).
    """
    means = SampleMeans(["train/routing_agreement", "train/replay_agreement"])
    rows = counts[indices]
    for key, column in (("train/routing_agreement", 0), ("train/replay_agreement", 2)):
        agree, compared = rows[:, column], rows[:, column + 1]
        has = compared > 0
        means.add(key, agree[has] / compared[has])
    return means.reduce(group)
