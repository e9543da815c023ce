"""The embedded engine's quantized model (`engine.quantization`): SGLang's low-precision
kernels emulated on any device.

`quantize_model(model, spec)` replaces, in place, every target projection (`quant.is_target`):

- an `nn.Linear` by a `QuantLinear`, which holds the tensors a quantized checkpoint holds for
  it, under the checkpoint's own names (FP8 `weight` and `weight_scale_inv`; INT4
  `weight_packed`, `weight_scale` and `weight_shape`);
- a MoE layer's fused experts (transformers 5 keeps them as `gate_up_proj` [E, 2I, H] and
  `down_proj` [E, H, I]) by `QuantExperts`, one `QuantLinear` per expert and projection named as
  the family's checkpoints name them (`experts.{e}.gate_proj`, Mixtral `experts.{e}.w1`).

Weight updates therefore load the quantized tensors the trainer sends by their checkpoint names
(`models.load_hf_weights`), and a full-precision tensor sent where a quantized one belongs is
refused (`models._resolve`). A layer multiplies with the weight its tensors hold, dequantized in
the model's dtype (`quant.dequantize`, once after each load, which bumps the buffers' version
counters), and under fp8_block with its input quantized per token in groups
(`quant.fake_quantize_activation`), where SGLang's W8A8 block kernel quantizes it. The numbers
are those of the quantized model; the products are the model dtype's, not FP8 tensor cores'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember_core import exact, quant
from ember_core.quant import QuantSpec
from ember_rollout.models import _checkpoint_name, naming_of

__all__ = ["QuantExperts", "QuantLinear", "quantize_model"]


class QuantLinear(nn.Module):
    """A linear layer whose weight is held quantized (see the module docstring)."""

    def __init__(
        self,
        spec: QuantSpec,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        dtype: torch.dtype | None = None,
    ) -> None:
        """Quantize `weight` [out, in] under `spec` (INT4 scales in `dtype`, default the
        weight's, which is the dtype the layer computes in)."""
        super().__init__()
        self.spec = spec
        self.out_features, self.in_features = weight.shape
        self.dtype = dtype or weight.dtype
        for suffix, tensor in quant.quantize(weight, spec, dtype=self.dtype).items():
            self.register_buffer(suffix, tensor.to(weight.device))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.exact = False
        """Multiply with `exact.linear` (`rollout.true_on_policy`; set by
        `true_on_policy.exact_model`), else `F.linear`."""
        self.register_buffer(
            "_served", torch.empty(weight.shape, dtype=self.dtype, device=weight.device),
            persistent=False,
        )  # fmt: skip
        self._served_from: tuple[int, ...] = ()

    def quantized(self) -> dict[str, torch.Tensor]:
        """The tensors that hold the weight, by checkpoint suffix."""
        return {n: t for n, t in self.named_buffers(recurse=False) if n != "_served"}

    def served(self) -> torch.Tensor:
        """The weight [out, in] the layer multiplies with: its tensors dequantized, again after
        any of them was written. Always the same tensor, written in place (outside inference
        mode, so that its version counter tells `exact.packed_weight` it changed)."""
        tensors = self.quantized()
        versions = tuple(t._version for t in tensors.values())
        if versions != self._served_from:
            with torch.inference_mode(False), torch.no_grad():
                self._served.copy_(quant.dequantize(tensors, self.dtype))
            self._served_from = versions
        return self._served

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """`x` as the layer's product takes it: quantized per token group under fp8_block."""
        if self.spec.quantizes_activations:
            return quant.fake_quantize_activation(x, self.spec.group_size)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.exact:
            return exact.linear(self.inputs(x), self.served(), self.bias)
        return F.linear(self.inputs(x), self.served(), self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"scheme={self.spec.scheme}, group_size={self.spec.group_size}"
        )


class QuantExperts(nn.Module):
    """A MoE layer's routed experts, each projection a `QuantLinear` named as the family's
    checkpoints name it; called like transformers' fused experts module."""

    def __init__(
        self, experts: nn.Module, spec: QuantSpec, projections: dict[str, str], prefix: str
    ) -> None:
        """Quantize `experts` (transformers' fused module: `gate_up_proj` [E, 2I, H], gate rows
        first, `down_proj` [E, H, I], `act_fn`); `projections` maps each checkpoint projection
        name to gate, up or down; `prefix` is the module's checkpoint name, for errors."""
        super().__init__()
        self.act_fn = experts.act_fn
        self.exact = False
        """Compute with `exact.experts` (`rollout.true_on_policy`), else expert by expert."""
        self._fused: list[torch.Tensor] | None = None
        self._fused_from: tuple[int, ...] = ()
        gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
        if gate_up.shape[2] != down.shape[1] or gate_up.shape[1] != 2 * down.shape[2]:
            raise ValueError(
                f"engine.quantization: {prefix} holds gate_up_proj {tuple(gate_up.shape)} and "
                f"down_proj {tuple(down.shape)}; expected [E, 2I, H] and [E, H, I]"
            )
        self.num_experts = gate_up.shape[0]
        names = {role: name for name, role in projections.items()}
        self._roles = (names["gate"], names["up"], names["down"])
        for e in range(self.num_experts):
            gate, up = gate_up[e].chunk(2, dim=0)
            weights = {"gate": gate, "up": up, "down": down[e]}
            expert = nn.Module()
            for role, name in names.items():
                quant.check_shape(f"{prefix}.{e}.{name}.weight", weights[role].shape, spec)
                expert.add_module(name, QuantLinear(spec, weights[role].contiguous()))
            self.add_module(str(e), expert)

    def _experts(self) -> list[tuple[QuantLinear, QuantLinear, QuantLinear]]:
        gate_name, up_name, down_name = self._roles
        return [
            (getattr(e, gate_name), getattr(e, up_name), getattr(e, down_name))
            for e in (getattr(self, str(i)) for i in range(self.num_experts))
        ]

    def fused_gate_up(self) -> list[torch.Tensor]:
        """Per expert, its served gate and up weights as one [2F, H] weight (gate first),
        written in place again after either was dequantized anew (as `QuantLinear.served`)."""
        pairs = [(gate.served(), up.served()) for gate, up, _ in self._experts()]
        versions = tuple(t._version for pair in pairs for t in pair)
        with torch.inference_mode(False), torch.no_grad():
            if self._fused is None:
                self._fused = [torch.cat(pair) for pair in pairs]
            elif versions != self._fused_from:
                for fused, pair in zip(self._fused, pairs, strict=True):
                    fused.copy_(torch.cat(pair))
        self._fused_from = versions
        return self._fused

    def forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        if self.exact:
            experts = self._experts()
            return exact.experts(
                hidden,
                top_k_index,
                top_k_weights,
                self.fused_gate_up(),
                [down.served() for _, _, down in experts],
                inputs=experts[0][0].inputs,
            )
        out = torch.zeros_like(hidden)
        gate_name, up_name, down_name = self._roles
        for e in top_k_index.unique().tolist():
            token, slot = torch.where(top_k_index == e)
            expert = getattr(self, str(e))
            x = hidden[token]
            h = self.act_fn(getattr(expert, gate_name)(x)) * getattr(expert, up_name)(x)
            y = getattr(expert, down_name)(h) * top_k_weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


def _fused_experts(module: nn.Module) -> bool:
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    return (
        isinstance(gate_up, nn.Parameter)
        and isinstance(down, nn.Parameter)
        and (gate_up.dim() == 3)
    )


def quantize_model(model: nn.Module, spec: QuantSpec) -> int:
    """Replace every target projection of `model` by its quantized counterpart (see the module
    docstring); returns how many weights were quantized.

    Raises:
        ValueError: A target weight whose shape `spec` cannot quantize (`quant.check_shape`),
            or a model in which nothing is a target.
    """
    naming = naming_of(model)
    count = 0
    for name, module in list(model.named_modules()):
        parent_name, _, attr = name.rpartition(".")
        if isinstance(module, nn.Linear):
            checkpoint = _checkpoint_name(f"{name}.weight", naming)
            if not quant.is_target(checkpoint, spec.targets):
                continue
            quant.check_shape(checkpoint, module.weight.shape, spec)
            replacement: nn.Module = QuantLinear(spec, module.weight.detach(), module.bias)
            count += 1
        elif _fused_experts(module):
            prefix = _checkpoint_name(name, naming)
            down = next(p for p, role in naming.expert_projections.items() if role == "down")
            if not quant.is_target(f"{prefix}.0.{down}.weight", spec.targets):
                continue
            replacement = QuantExperts(module, spec, dict(naming.expert_projections), prefix)
            count += 3 * replacement.num_experts
        else:
            continue
        setattr(model.get_submodule(parent_name), attr, replacement)
    if count == 0:
        raise ValueError(
            f"engine.quantization={spec.scheme} with engine.quantization_targets={spec.targets}: "
            f"the model ({type(model).__name__}) has no weight to quantize"
            + (
                "; it has no routed experts (use targets linear)"
                if spec.targets == "experts"
                else ""
            )
        )
    return count
