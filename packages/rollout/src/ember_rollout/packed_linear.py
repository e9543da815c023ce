"""Linear layers whose fp32 CPU weights are packed once for oneDNN, for the embedded engine.

`F.linear` on CPU hands each call to a GEMM that first repacks the weight into its blocked
layout. In training the product is large and the repack is a small part of it; in decoding the
product is [rows, in] @ [in, out] for a few dozen rows, so every step reads and rewrites every
weight of the model once more than it multiplies with it. oneDNN can pack a weight once
(`mkldnn._reorder_linear_weight`, as torch's inductor does for frozen CPU graphs) and multiply
with the packed copy at any row count (`mkldnn._linear_pointwise`).

A packed copy goes stale when the weight changes: in place (torch bumps the tensor's version
counter on every in-place write, `copy_` of a weight load included) or by a new storage
(`param.data = t`, or a new Parameter in the layer, which keep or restart the counter). Each
layer keeps what it packed from, the storage (by weak reference: a live one cannot share its
address with another), the place and layout in it and the version counter, and packs again on
its first forward after any of them changed. The products are oneDNN's instead of MKL's, equal
to rounding (about 1e-6 relative), not to the bit.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

logger = logging.getLogger(__name__)

PACK_MIN_ELEMENTS = 1 << 17
"""Weights smaller than this (384 x 384 is above, 256 x 256 below) are left to `F.linear`.
oneDNN's call costs about 15 us more than MKL's, which the repack it saves outweighs only from
about 256 x 256 up (measured on a 2-core AMD EPYC at 8 and 64 rows: 0.3x at 64 x 64, 0.9-1.1x
at 256 x 256, 1.6-1.8x at 384 x 384, 1.4-2.7x at 576 x 576)."""


def packing_available() -> bool:
    """Whether this torch build can pack linear weights for oneDNN."""
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


class PackedLinear(nn.Linear):
    """An `nn.Linear` that multiplies with a oneDNN-packed copy of its fp32 CPU weight.

    Made from a model's own layers by `pack_linears` (the class is swapped; parameters, hooks
    and state dict stay as they were). It falls back to `F.linear` wherever the packed copy
    does not apply: a weight that needs its gradient while autograd records, or one that is no
    longer fp32 on CPU.
    """

    batch_hint: int
    _packed: torch.Tensor | None
    _packed_from: tuple[StorageWeakRef, tuple] | None
    """The storage the packed copy was made from, and `_layout` of the weight then."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (
            (weight.requires_grad and torch.is_grad_enabled())
            or weight.dtype != torch.float32
            or weight.device.type != "cpu"
            or input.dtype != torch.float32
        ):
            return F.linear(input, weight, self.bias)
        if self._packed is None or not self._packed_from_weight(weight):
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(
                    weight.detach(), self.batch_hint
                )
            self._packed_from = (StorageWeakRef(weight.untyped_storage()), _layout(weight))
        return torch.ops.mkldnn._linear_pointwise(input, self._packed, self.bias, "none", [], "")

    def _packed_from_weight(self, weight: torch.Tensor) -> bool:
        """Whether the packed copy was made from `weight` as it is now: the same storage (still
        alive, so no other storage has its address), laid out alike, not written since."""
        if self._packed_from is None:
            return False
        storage, layout = self._packed_from
        return (
            not storage.expired()
            and storage.cdata == weight.untyped_storage()._cdata
            and layout == _layout(weight)
        )


def _layout(weight: torch.Tensor) -> tuple:
    """Where `weight` lies in its storage, its shape and strides, and its version counter."""
    return (weight.data_ptr(), tuple(weight.shape), weight.stride(), weight._version)


def pack_linears(model: nn.Module, *, batch_hint: int, min_elements: int | None = None) -> int:
    """Turn every plain fp32 CPU `nn.Linear` of `model` into a `PackedLinear`, in place.

    Layers of other types (subclasses included), dtypes or devices, and those with fewer than
    `min_elements` weights, are left alone. Each packed layer holds a second copy of its weight
    in oneDNN's layout, made on its first forward.

    Args:
        model: The model to change.
        batch_hint: The row count the packing is laid out for (the decode batch); any other
            row count works too.
        min_elements: The smallest weight packed; None: `PACK_MIN_ELEMENTS`.

    Returns:
        How many layers were swapped (0 when this torch build cannot pack).
    """
    if not packing_available():
        logger.info("this torch build has no oneDNN linear packing; linear layers run as is")
        return 0
    smallest = PACK_MIN_ELEMENTS if min_elements is None else min_elements
    swapped = 0
    for module in model.modules():
        if (
            type(module) is nn.Linear
            and module.weight.dtype == torch.float32
            and module.weight.device.type == "cpu"
            and module.weight.numel() >= smallest
        ):
            module.__class__ = PackedLinear
            module.batch_hint = batch_hint
            module._packed = None
            module._packed_from = None
            swapped += 1
    return swapped
