"""Per-sample reductions and masked whitening over packed per-token tensors."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ember_core.algorithms.registry import Registry

# Convention for the whole package: per-token quantities of a micro-batch are one flat
# tensor [T] holding the samples' response tokens back to back, sample i owning
# `lengths[i]` consecutive entries; `loss_mask` [T] marks the tokens that count (nonzero =
# counted, zero = ignored; values at ignored tokens never reach a result, even if NaN).

Lengths = Sequence[int] | Tensor


def sample_ids(lengths: Lengths, total: int, device: torch.device | None = None) -> Tensor:
    """Returns which sample each packed token belongs to.

    Args:
        lengths: Per-sample token counts [B]; they must add up to `total`.
        total: Number of packed tokens T.
        device: Device of the result.

    Returns:
        LongTensor [T] with value i on the tokens of sample i.

    Raises:
        ValueError: A length is negative or the lengths do not add up to `total`.
    """
    lengths_B = torch.as_tensor(lengths, dtype=torch.long, device=device).reshape(-1)
    if lengths_B.numel() and int(lengths_B.min()) < 0:
        raise ValueError(f"lengths must be >= 0, got {lengths_B.tolist()}")
    if int(lengths_B.sum()) != total:
        raise ValueError(
            f"lengths add up to {int(lengths_B.sum())} but there are {total} tokens "
            f"(lengths={lengths_B.tolist()})"
        )
    return torch.repeat_interleave(torch.arange(lengths_B.numel(), device=device), lengths_B)


def _check_mask(values: Tensor, loss_mask: Tensor) -> Tensor:
    if loss_mask.shape != values.shape:
        raise ValueError(
            f"loss_mask has shape {tuple(loss_mask.shape)} but values have {tuple(values.shape)}"
        )
    return loss_mask.bool()


def masked_sample_mean(values: Tensor, loss_mask: Tensor, lengths: Lengths) -> Tensor:
    """Per-sample mean of `values` over the counted tokens.

    A sample with no counted token has mean 0 (its sum is divided by max(count, 1)).

    Args:
        values: Per-token values [T].
        loss_mask: Per-token mask [T].
        lengths: Per-sample token counts [B], adding up to T.

    Returns:
        Tensor [B] of per-sample means (differentiable in `values`).
    """
    if values.dim() != 1:
        raise ValueError(f"values must be a flat [T] tensor, got shape {tuple(values.shape)}")
    counted_T = _check_mask(values, loss_mask)
    ids_T = sample_ids(lengths, values.numel(), values.device)
    num_samples = torch.as_tensor(lengths).numel()
    kept_T = torch.where(counted_T, values, torch.zeros_like(values))
    sums_B = values.new_zeros(num_samples).index_add(0, ids_T, kept_T)
    counts_B = values.new_zeros(num_samples).index_add(0, ids_T, counted_T.to(values.dtype))
    return sums_B / counts_B.clamp_min(1)


def masked_mean(values: Tensor, loss_mask: Tensor) -> Tensor:
    """Mean of `values` over the counted tokens; 0 when no token counts.

    Args:
        values: Per-token values, any shape.
        loss_mask: Mask of the same shape.

    Returns:
        A scalar tensor.
    """
    counted = _check_mask(values, loss_mask)
    kept = torch.where(counted, values, torch.zeros_like(values))
    return kept.sum() / counted.sum().clamp_min(1).to(values.dtype)


def _sample_mean_reduction(per_token: Tensor, loss_mask: Tensor, lengths: Lengths) -> Tensor:
    per_sample_B = masked_sample_mean(per_token, loss_mask, lengths)
    return per_sample_B.sum() / max(per_sample_B.numel(), 1)


def _token_mean_reduction(per_token: Tensor, loss_mask: Tensor, lengths: Lengths) -> Tensor:
    sample_ids(lengths, per_token.numel(), per_token.device)  # validates lengths
    return masked_mean(per_token, loss_mask)


REDUCTIONS: Registry[Callable[[Tensor, Tensor, Lengths], Tensor]] = Registry("loss reduction")
"""Loss reductions by name: "sample" (default) and "token"."""
REDUCTIONS.add("sample", _sample_mean_reduction)
REDUCTIONS.add("token", _token_mean_reduction)


def reduce_loss(
    per_token: Tensor, loss_mask: Tensor, lengths: Lengths, mode: str = "sample"
) -> Tensor:
    """Reduces a per-token quantity of a packed micro-batch to a scalar.

    Modes (registered in `REDUCTIONS`):
        "sample": mean over the counted tokens of each sample, then mean over the samples,
            so every sample weighs the same whatever its length (the default).
        "token": mean over all counted tokens of the micro-batch, so long samples weigh
            more.

    A sample whose mask is all zero contributes 0 and, in "sample" mode, still counts in
    the number of samples; a micro-batch with no counted token reduces to 0. No NaN either
    way.

    Args:
        per_token: Per-token values [T].
        loss_mask: Per-token mask [T].
        lengths: Per-sample token counts [B], adding up to T.
        mode: A name registered in `REDUCTIONS`.

    Returns:
        A scalar tensor, differentiable in `per_token`.

    Raises:
        ValueError: Unknown `mode`, mask shape mismatch, or lengths not adding up to T.
    """
    return REDUCTIONS.get(mode)(per_token, loss_mask, lengths)


def masked_whiten(
    values: Tensor,
    mask: Tensor,
    shift_mean: bool = True,
    eps: float = 1e-8,
    all_reduce: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """Normalises `values` to zero mean and unit variance over the masked entries.

    Mean and variance are taken over the entries where `mask` is nonzero; the variance is
    the unbiased one (divided by count - 1, as OpenRLHF and verl do; by 1 when a single
    entry counts). Every entry, masked or not, gets the same affine map
    (x - mean) / sqrt(var + eps); with `shift_mean=False` the mean is added back, so only
    the scale changes. With no entry counted the values come back unchanged.

    Args:
        values: Values to whiten, any shape.
        mask: Mask of the same shape.
        shift_mean: Whether the result is centred (True) or keeps the original mean.
        eps: Added to the variance before the square root.
        all_reduce: Sums a tensor over the ranks that hold the rest of the batch and returns
            the sum (two calls: the count and sum, then the squared deviations); None: this
            batch alone.

    Returns:
        Tensor shaped like `values`.
    """
    counted = _check_mask(values, mask)
    total = all_reduce or (lambda t: t)
    kept = torch.where(counted, values, torch.zeros_like(values))
    sum_and_count = total(torch.stack([kept.sum(), counted.sum().to(values.dtype)]))
    count = sum_and_count[1]
    mean = sum_and_count[0] / count.clamp_min(1)
    centered = values - mean
    sq = total(torch.where(counted, centered.square(), torch.zeros_like(values)).sum())
    var = sq / (count - 1).clamp_min(1)
    whitened = centered * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(count > 0, whitened, values)
