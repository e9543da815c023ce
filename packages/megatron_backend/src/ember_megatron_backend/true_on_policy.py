"""The trainer under `rollout.true_on_policy`: megatron-core's modules compute with
`ember_core.exact`, the batch-invariant kernels the embedded engine also runs.

`exact_megatron(model)` changes, in place and on this model only:

- every tensor-parallel linear layer (QKV, projections, MLP, the output layer) multiplies
  through `exact.linear` (its ``_forward_impl``; layout 1 only: no tensor-parallel reduction);
- every torch ``RMSNorm`` normalises with `exact.rms_norm` (the engine's formula);
- the local attention core (``SDPAttention``, right-padded samples under one causal mask)
  runs `exact.attention`;
- MoE layers route (`TopKRouter`'s gating and routing, `RouterReplay` included), run their
  experts and Qwen2-MoE's shared-expert gate through `exact.route`, `route_weights`, `experts`
  and `linear`.

Parameters, names and gradients are megatron-core's own: the kernels are torch ops autograd
differentiates, and megatron-core's DDP hooks see the same gradients arrive. The packed copies
of the weights (`exact.packed_weight`) are dropped by the worker whenever the weights may have
changed (`MegatronWorker._weights_changed`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ember_core import exact
from ember_megatron_backend.qat import served_weight


def _exact_forward_impl(
    input: torch.Tensor, weight: torch.Tensor, bias: Any = None, cached: bool = True, **_: Any
):
    # The packings are dropped after each optimizer step (`MegatronWorker._weights_changed`):
    # its updates need not bump the weights' version counters. `cached` False: a weight made
    # anew for this product (`train.qat`'s served weight), not worth keeping a packing of.
    return exact.linear(input, weight, bias, cached=cached)


class ExactRMSNorm(nn.RMSNorm):
    """torch's ``RMSNorm`` normalising with `exact.rms_norm`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return exact.rms_norm(x, self.weight, eps)


_EXACT_CLASSES: dict[type, type] = {}


def _exact_class(cls: type, methods: dict[str, Any]) -> type:
    if cls not in _EXACT_CLASSES:
        _EXACT_CLASSES[cls] = type(f"Exact{cls.__name__}", (cls,), methods)
    return _EXACT_CLASSES[cls]


def _router_gating(self: Any, input: torch.Tensor) -> torch.Tensor:
    """fp32 router logits [tokens, E] from the weight as the engine holds it (rounded to the
    activations' dtype), through `exact.linear`."""
    rows = input.reshape(-1, input.shape[-1])
    return exact.linear(rows.float(), self.weight.to(rows.dtype).float(), cached=False)


def _router_rule(self: Any) -> dict[str, Any]:
    config = self.config
    return {
        "score": self.score_function,
        "norm_topk_prob": self.score_function == "sigmoid" or not config.moe_router_pre_softmax,
        "scaling": config.moe_router_topk_scaling_factor or 1.0,
    }


def _router_choice(self: Any, logits: torch.Tensor) -> torch.Tensor:
    """The experts [tokens, k] `exact.route` picks from fp32 `logits` [tokens, E]."""
    config = self.config
    # The engine holds the bias as a buffer of the model's dtype.
    bias = None if self.expert_bias is None else self.expert_bias.to(config.params_dtype)
    rule = _router_rule(self)
    return exact.route(
        logits,
        self.topk,
        score=rule["score"],
        norm_topk_prob=rule["norm_topk_prob"],
        expert_bias=bias,
        num_groups=config.moe_router_num_groups or 0,
        group_topk=config.moe_router_group_topk or 0,
    )


def _router_routing(
    self: Any, logits: torch.Tensor, padding_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`exact.route` and `exact.route_weights` for the experts chosen, or replayed where
    megatron-core's `RouterReplay` replays (its record action records `exact.route`'s
    choice): probs [tokens, E] (zero off the chosen experts) and the routing map."""
    config = self.config
    logits = logits.view(-1, config.num_moe_experts)
    if self.router_replay is not None:
        groups = (config.moe_router_num_groups, config.moe_router_group_topk)
        _, ids = self.router_replay.get_replay_topk(
            logits, self.topk, *groups, lambda *_: (None, _router_choice(self, logits))
        )
    else:
        ids = _router_choice(self, logits)
    weights = exact.route_weights(logits, ids, **_router_rule(self))
    probs = torch.zeros_like(logits).scatter(1, ids, weights)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, ids, True)
    return probs, routing_map


def _router_natural(self: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The routing map [tokens, E] of this router's own choice, without replay
    (`routing.natural_routing`): `exact.route`'s, the choice the mode routes with."""
    logits = self.gating(hidden).view(-1, self.config.num_moe_experts)
    ids = _router_choice(self, logits)
    return torch.zeros_like(logits, dtype=torch.bool).scatter(1, ids, True)


def _moe_forward(
    self: Any,
    hidden_states: torch.Tensor,
    intermediate_tensors: Any = None,
    padding_mask: Any = None,
) -> tuple[torch.Tensor, None]:
    """The MoE layer through `exact.experts`: route, then every routed expert of every token
    summed in ascending expert order, then the shared experts added."""
    shared = self.shared_experts_compute(hidden_states)
    probs, routing_map = self.route(hidden_states, padding_mask)
    rows = hidden_states.reshape(-1, hidden_states.shape[-1])
    ids = routing_map.nonzero()[:, 1].view(rows.shape[0], -1)  # ascending per token
    local = self.experts.local_experts
    served = [served_weight(e.linear_fc1) for e in local]
    if served[0] is None:
        out = exact.experts(
            rows,
            ids,
            probs.gather(1, ids),
            [e.linear_fc1.weight for e in local],
            [e.linear_fc2.weight for e in local],
        )
    else:  # `train.qat`: the weights and inputs the engine's quantized experts multiply
        fc2 = [served_weight(e.linear_fc2) for e in local]
        out = exact.experts(
            rows,
            ids,
            probs.gather(1, ids),
            [s.weight(e.linear_fc1.weight) for s, e in zip(served, local, strict=True)],
            [s.weight(e.linear_fc2.weight) for s, e in zip(fc2, local, strict=True)],
            cached=False,
            inputs=served[0].input,
        )
    out = out.view_as(hidden_states)
    return (out if shared is None else out + shared), None


def _shared_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """Shared experts, their sigmoid gate (Qwen2-MoE) through `exact.linear`."""
    from megatron.core.transformer.mlp import MLP

    output, _ = MLP.forward(self, hidden_states)
    if self.use_shared_expert_gate:
        gate = exact.linear(hidden_states, self.gate_weight)
        output = output * torch.sigmoid(gate)
    return output


def _check_moe(name: str, layer: Any) -> None:
    """Refuse, naming the megatron-core setting and its value, what the exact MoE path does
    not run as megatron-core would."""
    config = layer.config
    settings = {
        "moe_aux_loss_coeff": (config.moe_aux_loss_coeff, layer.router.is_aux_loss_enabled()),
        "moe_z_loss_coeff": (config.moe_z_loss_coeff, bool(config.moe_z_loss_coeff)),
        "moe_expert_capacity_factor": (
            config.moe_expert_capacity_factor,
            config.moe_expert_capacity_factor is not None,
        ),
        "moe_input_jitter_eps": (config.moe_input_jitter_eps, bool(config.moe_input_jitter_eps)),
        "moe_router_load_balancing_type": (
            layer.router.routing_type,
            layer.router.routing_type not in ("aux_loss", "none"),
        ),
        "moe_router_force_load_balancing": (
            config.moe_router_force_load_balancing,
            bool(config.moe_router_force_load_balancing),
        ),
        "moe_router_dtype": (
            config.moe_router_dtype,
            config.moe_router_dtype not in (None, "fp32"),
        ),
        "moe_shared_expert_overlap": (
            config.moe_shared_expert_overlap,
            bool(config.moe_shared_expert_overlap),
        ),
        "add_bias_linear": (config.add_bias_linear, bool(config.add_bias_linear)),
        "recompute_modules": (
            config.recompute_modules,
            bool(
                config.recompute_granularity == "selective"
                and "moe" in (config.recompute_modules or ())
            ),
        ),
        "activation_func": (
            getattr(config.activation_func, "__name__", config.activation_func),
            config.activation_func is not torch.nn.functional.silu or not config.gated_linear_unit,
        ),
    }
    for key, (value, refused) in settings.items():
        if refused:
            raise ValueError(
                f"rollout.true_on_policy: {name} runs with megatron-core's {key}={value!r}, which "
                "the mode's MoE path does not compute (docs/true-on-policy.md)"
            )
    local = getattr(layer.experts, "local_experts", None)
    if local is None or len(local) != config.num_moe_experts:
        raise ValueError(
            f"rollout.true_on_policy: {name} holds {len(local or ())} of "
            f"{config.num_moe_experts} experts as separate modules; the mode needs every expert "
            "on this rank (train.parallel.expert_parallel=1) in its own module"
        )


def exact_megatron(model: nn.Module) -> nn.Module:
    """Make `model`'s linear layers, RMSNorms and attention core the batch-invariant kernels.

    Raises:
        ValueError: A layer or setting this mode has no batch-invariant kernel for, named.
    """
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    from ember_megatron_backend.model import _sdpa_attention

    attention = _sdpa_attention()
    for name, module in model.named_modules():
        if isinstance(module, MoELayer):
            _check_moe(name, module)
            module.__class__ = _exact_class(type(module), {"forward": _moe_forward})
        elif isinstance(module, SharedExpertMLP):
            module.__class__ = _exact_class(type(module), {"forward": _shared_forward})
        elif isinstance(module, TopKRouter):
            module.__class__ = _exact_class(
                type(module),
                {
                    "gating": _router_gating,
                    "routing": _router_routing,
                    "natural_routing": _router_natural,
                },
            )
        elif isinstance(module, ColumnParallelLinear | RowParallelLinear):
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
