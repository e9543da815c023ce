"""The embedded engine under `rollout.true_on_policy`: its model computes with `ember_core.exact`.

`exact_model(model)` turns a transformers causal LM, in place, into one whose every linear
layer, RMSNorm and attention is the batch-invariant kernel the trainer's forward also runs
(`ember_megatron_backend.true_on_policy` applies the same kernels to megatron-core's modules):
a token's hidden states, and so its log-prob, are then the same bits in a decode step of any
batch and in the trainer's forward of the whole sequence. Nothing else changes: parameters,
names, state dict and hooks stay, so weight updates and routing capture work as before.
"""

from __future__ import annotations

import torch
from torch import nn

from ember_core import exact

ATTENTION = "ember_exact"
"""The name `exact_model` registers its attention under in transformers' attention registry."""


class ExactLinear(nn.Linear):
    """An `nn.Linear` computing with `exact.linear` (the class of every linear layer)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return exact.linear(input, self.weight, self.bias)


def exact_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    position_ids: torch.Tensor | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface over `exact.attention` (registered as `ATTENTION`).

    The queries are the last ones along the cache; each row's first token is found from the
    position of its last query (rows are left-padded, as the engine batches them).
    """
    if dropout:
        raise ValueError("rollout.true_on_policy: attention dropout is not supported")
    batch, _, num_q, dim = query.shape
    width = key.shape[2]
    if position_ids is None:
        position_ids = torch.arange(width - num_q, width, device=query.device)
    position_ids = position_ids.expand(batch, -1)  # one row of ids for the whole batch
    last = position_ids[:, -1].to(torch.long)
    starts = width - 1 - last
    expected = torch.arange(width - num_q, width, device=query.device) - starts[:, None]
    real = expected >= 0
    if not torch.equal(position_ids.to(torch.long)[real], expected[real]):
        raise ValueError(
            "rollout.true_on_policy: the attention's queries must be each row's last tokens, "
            "left-padded, with position ids counting its real tokens"
        )
    scale = dim**-0.5 if scaling is None else scaling
    out = exact.attention(query, key, value, key_starts=starts, scale=scale)
    return out.transpose(1, 2).contiguous(), None


_CLASSES: dict[type, type] = {}


def _exact_class(cls: type, methods: dict[str, object]) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Exact{cls.__name__}", (cls,), methods)
    return _CLASSES[cls]


def _norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return exact.rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _router_forward(
    self: nn.Module, hidden_states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp32 logits, fp32 weights, ids) by `exact.route` and `exact.route_weights`."""
    rows = hidden_states.reshape(-1, self.weight.shape[1])
    # A temporary fp32 copy below fp32 (the trainer's is too): packed at each call, not kept.
    logits = exact.linear(rows.float(), self.weight.to(rows.dtype).float(), cached=False)
    score = self.ember_router_scores
    norm = getattr(self, "norm_topk_prob", True)  # Mixtral's router always renormalises
    bias = getattr(self, "e_score_correction_bias", None)
    ids = exact.route(
        logits,
        self.top_k,
        score=score,
        norm_topk_prob=norm,
        expert_bias=None if bias is None else bias.to(rows.dtype),
        num_groups=getattr(self, "num_group", 0) or 0,
        group_topk=getattr(self, "topk_group", 0) or 0,
    )
    scaling = float(getattr(self, "routed_scaling_factor", 1.0) or 1.0)
    weights = exact.route_weights(logits, ids, score=score, norm_topk_prob=norm, scaling=scaling)
    return logits, weights, ids


def _experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    return exact.experts(
        hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj
    )


def _exact_moe(model: nn.Module) -> None:
    """Routers and experts of every MoE layer through `exact.route`/`route_weights`/`experts`."""
    from ember_rollout.families import FAMILIES
    from ember_rollout.models import find_routers

    sites = find_routers(model)
    if not sites:
        return
    config = getattr(model.config, "text_config", None) or model.config
    family = FAMILIES.get(getattr(config, "model_type", ""))
    if family is None:
        raise ValueError(
            f"rollout.true_on_policy: the MoE routers of {', '.join(FAMILIES)} are known; the "
            f"model's model_type is {getattr(config, 'model_type', None)!r}"
        )
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(
            f"rollout.true_on_policy: experts with hidden_act={config.hidden_act!r}; SwiGLU only"
        )
    for site in sites:
        router, experts = site.router, site.experts
        if not hasattr(experts, "gate_up_proj") or not hasattr(experts, "down_proj"):
            raise ValueError(
                f"rollout.true_on_policy: layer {site.layer}'s experts hold no fused "
                "gate_up_proj/down_proj weights"
            )
        router.__class__ = _exact_class(
            type(router),
            {"forward": _router_forward, "ember_router_scores": family.router_scores},
        )
        experts.__class__ = _exact_class(type(experts), {"forward": _experts_forward})


def exact_model(model: nn.Module) -> nn.Module:
    """Make `model`'s linear layers, RMSNorms and attention the batch-invariant kernels.

    Raises:
        ValueError: A layer this mode has no batch-invariant kernel for, named.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, exact_attention)
    _exact_moe(model)
    for name, module in model.named_modules():
        cls = type(module)
        if isinstance(module, nn.Linear):
            if cls is not nn.Linear and cls is not ExactLinear:
                raise ValueError(f"rollout.true_on_policy: {name} is a {cls.__name__}")
            module.__class__ = ExactLinear
        elif cls.__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.__class__ = _exact_class(cls, {"forward": _norm_forward})
        elif isinstance(module, nn.LayerNorm | nn.Conv1d | nn.Conv2d):
            raise ValueError(f"rollout.true_on_policy: {name} is a {cls.__name__}")
    model.set_attn_implementation(ATTENTION)
    return model


def linear_shapes(model: nn.Module) -> set[tuple[int, int]]:
    """The [in, out] shapes of `model`'s linear layers (for `exact.check_linear`)."""
    return {(m.in_features, m.out_features) for m in model.modules() if isinstance(m, nn.Linear)}
