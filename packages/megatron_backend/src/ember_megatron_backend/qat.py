"""Quantization-aware training (`train.qat`): the actor's and the reference's linear layers
multiply with the weights the rollout engine serves under `engine.quantization`.

`fake_quantize_model(model, cfg, spec, scale_dtype)` changes, in place and on this model only,
every target linear layer (`quant.is_target` on its checkpoint names):

- its weight is split into its checkpoint tensors (`hf_layout.hf_rule`: ``linear_qkv`` into
  q/k/v, ``linear_fc1`` into gate/up), each target tensor quantized and dequantized
  (`quant.quantize`, `quant.dequantize`; INT4 scales rounded to `scale_dtype`), the pieces merged
  back, and the layer multiplies with that, gradients passed straight through to the weight
  (`quant.straight_through`). Blocks are taken per checkpoint tensor because the engine
  quantizes those: megatron-core's ``linear_qkv`` interleaves q, k and v rows per query group,
  so a block of the fused tensor would hold other rows than the engine's;
- under fp8_block its input is quantized per token in groups too
  (`quant.fake_quantize_activation`), with straight-through gradients.

megatron-core's local ``ColumnParallelLinear`` / ``RowParallelLinear`` multiply in
``_forward_impl(input=, weight=, bias=, ...)``, which is replaced on the instance; the local
experts' grouped products (``model._grouped_local_experts``) take their operands from
``grouped_operands``, which is replaced through a subclass. Weights split over tensor or
expert-tensor parallelism, and Transformer Engine's modules, are refused.

`engine.quantization` on MoE experts: megatron-core scales an expert's ``linear_fc2`` input by
the token's routing probability, where the engine scales the output; under fp8_block the two
quantize the same activations up to float rounding of that scaling.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ember_core import quant
from ember_core.quant import QuantSpec
from ember_megatron_backend.hf_layout import HfRule, hf_names, hf_rule
from ember_megatron_backend.model import ModelConfig
from ember_megatron_backend.weights import _group, _placements, _unwrap, named_tensors

__all__ = ["ServedWeight", "fake_quantize_model", "served_weight"]

_ATTR = "_ember_qat"
"""The attribute of a patched linear layer holding its `ServedWeight`."""
_INNER = "_ember_qat_inner"
"""The attribute of a patched linear layer holding the product it replaced on the instance
(`rollout.true_on_policy`'s `_exact_forward_impl`, which takes `cached`), or None: the class's
``_forward_impl``."""


@dataclass(frozen=True, slots=True)
class ServedWeight:
    """How one linear layer's weight becomes the one the engine serves, and its input the one
    the engine's kernel multiplies."""

    rule: HfRule
    """The layer's checkpoint tensors."""
    targets: tuple[bool, ...]
    """Per checkpoint tensor (`rule.hf_names`), whether it is quantized."""
    spec: QuantSpec
    scale_dtype: torch.dtype
    """The dtype INT4 scales are rounded to: the one the engine serves in."""

    def weight(self, weight: Tensor) -> Tensor:
        """`weight` [N, K] as the engine serves it, gradients straight through to `weight`."""
        with torch.no_grad():
            pieces = [
                quant.dequantize(quant.quantize(t, self.spec, dtype=self.scale_dtype), t.dtype)
                if target
                else t
                for t, target in zip(self.rule.split(weight.detach()), self.targets, strict=True)
            ]
            served = self.rule.merge(*pieces)
        return quant.straight_through(weight, served)

    def input(self, x: Tensor) -> Tensor:
        """`x` [..., K] as the engine's kernel multiplies it (quantized per token under
        fp8_block, else as given), gradients straight through to `x`."""
        if not self.spec.quantizes_activations:
            return x
        return quant.straight_through(
            x, quant.fake_quantize_activation(x.detach(), self.spec.group_size)
        )


def served_weight(module: Any) -> ServedWeight | None:
    """The `ServedWeight` of a linear layer `fake_quantize_model` changed, else None."""
    return getattr(module, _ATTR, None)


def _forward_impl(self: Any, input: Tensor, weight: Tensor, bias: Any = None, **kwargs: Any):
    served: ServedWeight = getattr(self, _ATTR)
    inner = getattr(self, _INNER)
    input, weight = served.input(input), served.weight(weight)
    if inner is not None:  # `rollout.true_on_policy`'s product, with a weight made for this call
        return inner(input=input, weight=weight, bias=bias, cached=False)
    # megatron-core 0.16.1 tensor_parallel/layers.py: the class's `_forward_impl` picks the
    # frozen-weight path from `weight.requires_grad`, which the straight-through output keeps.
    return type(self)._forward_impl(self, input=input, weight=weight, bias=bias, **kwargs)


def _grouped_operands(self: Any, linear: str, x: Tensor) -> tuple[Tensor, Tensor]:
    """The local experts' grouped operands with their `ServedWeight`s applied."""
    layers = [getattr(e, linear) for e in self.local_experts]
    served = [served_weight(layer) for layer in layers]
    assert all(s is not None for s in served), f"{linear} of some local experts is not patched"
    weights = [s.weight(layer.weight) for s, layer in zip(served, layers, strict=True)]
    # Every expert of a layer shares the activation scheme, and it is per token.
    return served[0].input(x), torch.stack(weights)


_QAT_CLASSES: dict[type, type] = {}


def _qat_experts_class(cls: type) -> type:
    if cls not in _QAT_CLASSES:
        _QAT_CLASSES[cls] = type(
            f"QAT{cls.__name__}", (cls,), {"grouped_operands": _grouped_operands}
        )
    return _QAT_CLASSES[cls]


def fake_quantize_model(
    model: Any, cfg: ModelConfig, spec: QuantSpec, scale_dtype: torch.dtype
) -> int:
    """Make `model`'s target linear layers multiply with the weights (and under fp8_block the
    inputs) the engine serves under `spec`, with straight-through gradients (module docstring).

    Args:
        model: An actor or reference GPTModel chunk (possibly wrapped), built with tensor and
            expert-tensor parallelism 1; expert and pipeline parallelism are fine.
        cfg: Its shape.
        spec: The engine's quantization.
        scale_dtype: The dtype the engine serves in, to which INT4 scales are rounded.

    Returns:
        How many linear layers it changed (on a pipeline stage without targets, 0).

    Raises:
        ValueError: One line naming `train.qat` and what to change, for a model without a
            target layer, a target layer split over tensor or expert-tensor parallel ranks or
            without megatron-core's ``_forward_impl`` (Transformer Engine), or a target
            checkpoint tensor the group size does not divide (`quant.check_shape`). The model
            is left unchanged.
    """
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from ember_megatron_backend.model import _grouped_local_experts

    if not any(quant.is_target(name, spec.targets) for name in hf_names(cfg)):
        hint = "; it has no routed experts" if spec.targets == "experts" else ""
        raise ValueError(
            f"train.qat: no layer of this {cfg.family} model is a target of "
            f"engine.quantization_targets={spec.targets}{hint}: set engine.quantization_targets "
            "to linear, or train.qat=false"
        )
    model = _unwrap(model)
    modules = dict(model.named_modules())
    tensors = dict(named_tensors(model))
    changes: list[tuple[Any, ServedWeight]] = []
    for local_name, place in _placements(model, cfg).items():
        rule = hf_rule(place.global_name, cfg)
        targets = tuple(quant.is_target(name, spec.targets) for name in rule.hf_names)
        if not any(targets):
            continue
        module_name, _, attr = local_name.rpartition(".")
        module = modules[module_name]
        if attr != "weight" or not isinstance(module, ColumnParallelLinear | RowParallelLinear):
            raise ValueError(
                f"train.qat: {module_name} is a {type(module).__name__}, which does not multiply "
                "through megatron-core's _forward_impl (Transformer Engine's modules run their "
                "own kernels); train.qat needs the local layer spec: set train.qat=false or run "
                "without Transformer Engine"
            )
        _, size, _ = _group(place.expert)
        if size > 1 and place.kind != "replicated":
            which = "expert_tensor_parallel" if place.expert else "tensor_parallel"
            raise ValueError(
                f"train.qat: {local_name} is split over {size} {which.replace('_', '-')} ranks, "
                "and the engine quantizes whole checkpoint tensors: set "
                f"train.parallel.{which}=1"
            )
        pieces = rule.split(tensors[local_name].detach())
        for name, piece, target in zip(rule.hf_names, pieces, targets, strict=True):
            if target:
                quant.check_shape(name, piece.shape, spec)
        changes.append((module, ServedWeight(rule, targets, spec, scale_dtype)))
    for module, served in changes:
        setattr(module, _ATTR, served)
        setattr(module, _INNER, module.__dict__.get("_forward_impl"))
        module._forward_impl = types.MethodType(_forward_impl, module)
    grouped = _grouped_local_experts()
    for module in modules.values():
        if isinstance(module, grouped) and served_weight(module.local_experts[0].linear_fc1):
            module.__class__ = _qat_experts_class(type(module))
    return len(changes)
