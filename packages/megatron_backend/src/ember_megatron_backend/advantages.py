"""Advantage whitening over the counted tokens of every data-parallel rank."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ember_megatron_backend import comm

__all__ = ["whiten_across"]


def whiten_across(advantages: list[Tensor], masks: list[Tensor], group: Any = None) -> list[Tensor]:
    """ember-core's ``whiten_advantages`` (``masked_whiten``: mean and unbiased variance over the
    counted tokens, eps 1e-8) over the counted tokens of every rank of `group`.

    Computed in float64 whatever the number of ranks, so that one rank and several agree to
    float64 rounding of the reductions rather than float32's. Collective: every rank of `group`
    calls it (two all-reduces).

    Args:
        advantages: This rank's per-sample advantages [R_i].
        masks: Their loss masks [R_i].
        group: The data-parallel group.
    """
    if not advantages:
        return []
    several = group is not None and dist.is_initialized() and dist.get_world_size(group) > 1
    flat, mask = torch.cat(advantages).double(), torch.cat(masks).double()
    stats = torch.stack([(flat * mask).sum(), mask.sum()])
    if several:
        comm.all_reduce(stats, group=group)
    if stats[1] == 0:
        return advantages
    mean = stats[0] / stats[1]
    square = ((flat - mean).square() * mask).sum()
    if several:
        comm.all_reduce(square, group=group)
    var = square / (stats[1] - 1).clamp_min(1)
    whitened = ((flat - mean) * torch.rsqrt(var + 1e-8)).float()
    return list(whitened.split([a.numel() for a in advantages]))
