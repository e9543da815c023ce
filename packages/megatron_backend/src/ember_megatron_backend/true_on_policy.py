"""The trainer under `rollout.true_on_policy`: megatron-core's modules compute with
`ember_core.exact`, the batch-invariant kernels the embedded engine also runs.

`exact_megatron(model)` changes, in place and on this model only:

- every tensor-parallel linear layer (QKV, projections, MLP, the output layer) multiplies
  through `exact.linear` (its ``_forward_impl``; layout 1 only: no tensor-parallel reduction);
- every torch ``RMSNorm`` normalises with `exact.rms_norm` (the engine's formula);
- the local attention core (``SDPAttention``, right-padded samples under one causal mask)
  runs `exact.attention`.

Parameters, names and gradients are megatron-core's own: the kernels are torch ops autograd
differentiates, and megatron-core's DDP hooks see the same gradients arrive.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ember_core import exact


def _exact_forward_impl(input: torch.Tensor, weight: torch.Tensor, bias: Any = None, **_: Any):
    return exact.linear(input, weight, bias)


class ExactRMSNorm(nn.RMSNorm):
    """torch's ``RMSNorm`` normalising with `exact.rms_norm`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return exact.rms_norm(x, self.weight, eps)


def exact_megatron(model: nn.Module) -> nn.Module:
    """Make `model`'s linear layers, RMSNorms and attention core the batch-invariant kernels.

    Raises:
        ValueError: A layer or setting this mode has no batch-invariant kernel for, named.
    """
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from ember_megatron_backend.model import _sdpa_attention

    attention = _sdpa_attention()
    for name, module in model.named_modules():
        if isinstance(module, ColumnParallelLinear | RowParallelLinear):
            if module.tp_group is not None and module.tp_group.size() > 1:
                raise ValueError(
                    f"rollout.true_on_policy: {name} is split over {module.tp_group.size()} "
                    "tensor-parallel ranks; the mode needs tensor_model_parallel_size=1"
                )
            module._forward_impl = _exact_forward_impl
        elif type(module) is nn.RMSNorm:
            module.__class__ = ExactRMSNorm
        elif isinstance(module, attention):
            module.exact = True
        elif isinstance(module, nn.LayerNorm) or type(module).__name__.startswith("TE"):
            raise ValueError(
                f"rollout.true_on_policy: {name} is a {type(module).__name__}, which has no "
                "batch-invariant kernel here"
            )
    return model


def linear_shapes(model: nn.Module) -> set[tuple[int, int]]:
    """The [in, out] shapes of `model`'s tensor-parallel linear layers' weights."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return {
        (m.weight.shape[1], m.weight.shape[0])
        for m in model.modules()
        if isinstance(m, ColumnParallelLinear | RowParallelLinear) and m.weight is not None
    }
