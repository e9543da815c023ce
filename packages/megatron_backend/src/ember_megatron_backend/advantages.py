"""Advantage whitening over the counted tokens of every data-parallel rank."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ember_core.algorithms import masked_whiten
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
    reduce = functools.partial(comm.all_reduce, group=group) if several else None
    flat = masked_whiten(
        torch.cat(advantages).double(), torch.cat(masks).double(), all_reduce=reduce
    ).float()
    return list(flat.split([a.numel() for a in advantages]))
