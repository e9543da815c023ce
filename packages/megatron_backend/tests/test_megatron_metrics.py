"""Rollout metrics of hand-built batches: the per-token actor/reference maximum and the means."""

from __future__ import annotations

import math

import torch

from ember_core.types import Sample
from ember_megatron_backend.batches import RolloutBatch
from ember_megatron_backend.metrics import REF_MAX_ABS_DIFF, masked_max_abs_diff, rollout_metrics


def batch_of(log_probs, ref_log_probs, masks) -> RolloutBatch:
    samples = [
        Sample(
            tokens=[1] * (len(lp) + 2), response_length=len(lp), index=k, group_index=k, reward=0
        )
        for k, lp in enumerate(log_probs)
    ]
    tensor = lambda rows: [torch.tensor(r, dtype=torch.float32) for r in rows]  # noqa: E731
    zeros = [torch.zeros(len(lp)) for lp in log_probs]
    return RolloutBatch(
        rollout_id=0,
        samples=samples,
        steps=[[list(range(len(samples)))]],
        loss_masks=tensor(masks),
        log_probs=tensor(log_probs),
        entropy=zeros,
        advantages=zeros,
        returns=zeros,
        ref_log_probs=None if ref_log_probs is None else tensor(ref_log_probs),
    )


def test_a_difference_that_cancels_in_the_means_shows_in_the_maximum():
    # +d on one token, -d on another of the same sample: every mean stays equal. d and the
    # values are binary fractions, so the float32 sums are exact.
    d = 2.0**-10
    actor = [[-1.5, -2.25, -0.75], [-3.0, -0.5]]
    ref = [[-1.5 + d, -2.25 - d, -0.75], [-3.0, -0.5 + 4.0]]  # the masked token differs by 4
    masks = [[1, 1, 1], [1, 0]]
    metrics = rollout_metrics(batch_of(actor, ref, masks))
    assert metrics["rollout/log_probs"] == metrics["rollout/ref_log_probs"]
    assert metrics[REF_MAX_ABS_DIFF] == d


def test_identical_log_probs_give_exactly_zero_and_no_reference_gives_no_metric():
    actor = [[-1.2, -0.3], [-2.7]]
    assert rollout_metrics(batch_of(actor, actor, [[1, 1], [1]]))[REF_MAX_ABS_DIFF] == 0.0
    assert REF_MAX_ABS_DIFF not in rollout_metrics(batch_of(actor, None, [[1, 1], [1]]))


def test_the_maximum_covers_counted_tokens_only_and_keeps_nan():
    a = [torch.tensor([0.0, 0.0]), torch.tensor([1.0])]
    assert (
        masked_max_abs_diff(a, [torch.tensor([0.5, 9.0]), torch.tensor([1.0])], _masks(1, 0, 1))
        == 0.5
    )
    assert masked_max_abs_diff(a, a, _masks(0, 0, 0)) is None
    nan = [torch.tensor([math.nan, 0.0]), torch.tensor([1.0])]
    assert masked_max_abs_diff(nan, a, _masks(1, 1, 1)) == math.inf


def _masks(*flags: int) -> list[torch.Tensor]:
    return [
        torch.tensor(flags[:2], dtype=torch.float32),
        torch.tensor(flags[2:], dtype=torch.float32),
    ]
