"""The embedded engine under `rollout.true_on_policy`: its model computes with `ember_core.exact`.

`exact_model(model)` turns a transformers causal LM, in place, into one whose every linear
layer, RMSNorm and attention is the batch-invariant kernel the trainer's forward also runs
(`ember_megatron_backend.true_on_policy` applies the same kernels to megatron-core's modules):
a token's hidden states, and so its log-prob, are then the same bits in a decode step of any
batch and in the trainer's forward of the whole sequence. Nothing else changes: parameters,
names, state dict and hooks stay, so weight updates and routing capture work as before. The
engine decodes with a `PositionCache`, which keeps each row's keys at their positions.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer

from ember_core import exact

ATTENTION = "ember_exact"
"""The name `exact_model` registers its attention under in transformers' attention registry."""


class ExactLinear(nn.Linear):
    """An `nn.Linear` computing with `exact.linear` (the class of every linear layer)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return exact.linear(input, self.weight, self.bias)


KEY_STARTS = "ember_key_starts"
"""The forward keyword argument (transformers passes a model's keyword arguments on to its
attention) that tells `exact_attention` where each row's keys start: `PositionCache.at`'s."""

_PROBE = "ember_probe"


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

    The queries are each row's last tokens, left-padded, their positions counting the row's
    real tokens. The keys are where the forward's `KEY_STARTS` says (a `PositionCache`'s: at
    their positions), else laid out as the queries are: each row's last key is its last query.
    """
    if dropout:
        raise ValueError("rollout.true_on_policy: attention dropout is not supported")
    probe = kwargs.get(_PROBE)
    if isinstance(probe, list):
        probe.append(module)
    batch, _, num_q, dim = query.shape
    device = query.device
    starts = kwargs.get(KEY_STARTS)
    if position_ids is None:
        if starts is not None:  # keys at their positions: only the ids say where queries are
            raise ValueError(
                "rollout.true_on_policy: a forward over a PositionCache passes position_ids"
            )
        position_ids = torch.arange(key.shape[2] - num_q, key.shape[2], device=device)
    position_ids = position_ids.to(torch.long).expand(batch, -1)  # one row of ids for all
    last = position_ids[:, -1]
    positions = last[:, None] - torch.arange(num_q - 1, -1, -1, device=device)  # < 0: padding
    real = positions >= 0
    if not torch.equal(position_ids[real], positions[real]):
        raise ValueError(
            "rollout.true_on_policy: the attention's queries must be each row's last tokens, "
            "left-padded, with position ids counting its real tokens"
        )
    if not isinstance(starts, torch.Tensor):
        starts = key.shape[2] - 1 - last
    scale = dim**-0.5 if scaling is None else scaling
    out = exact.attention(query, key, value, key_starts=starts, scale=scale, positions=positions)
    return out.transpose(1, 2).contiguous(), None


class PositionCache(Cache):
    """The engine's KV cache under `rollout.true_on_policy`: row b's key and value of position
    p at index p of every layer, whatever its padding.

    `exact.attention` reads a query's keys as one slice of positions [0, span); from a cache of
    left-padded rows (transformers' `DynamicCache`) each row's slice starts elsewhere, and every
    decode step would gather the whole cache anew. Here the slices of all rows are one view, and
    a decode step writes just its new entries. Set the new tokens' positions with `at` before
    each forward and pass its keyword arguments to the forward.
    """

    def __init__(self, num_layers: int):
        super().__init__(layers=[_PositionLayer(self) for _ in range(num_layers)])
        self.positions: torch.Tensor | None = None

    def at(self, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        """The next forward's new tokens are at `positions` [B, Q] (negative: padding, not
        stored); returns the keyword arguments that forward passes its attention."""
        self.positions = positions.to(torch.long)
        return {KEY_STARTS: positions.new_zeros(positions.shape[0], dtype=torch.long)}


class _PositionLayer(DynamicLayer):
    """One layer of a `PositionCache`: keys and values [B, Hkv, capacity, D], grown in whole
    key blocks (`exact.KEY_BLOCK`) and zero where nothing was written (masked, but finite)."""

    is_croppable = False

    def __init__(self, owner: PositionCache):
        super().__init__()
        self.owner = owner
        self.width = 0
        """Entries a left-padded cache would hold (transformers' masks and the engine read it)."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_zeros(*key_states.shape[:2], 0, key_states.shape[3])
        self.values = value_states.new_zeros(*value_states.shape[:2], 0, value_states.shape[3])
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        positions = self.owner.positions
        if positions is None or positions.shape != key_states.shape[::2]:
            raise ValueError(
                "rollout.true_on_policy: PositionCache.at must give the positions [batch, "
                f"new tokens] {tuple(key_states.shape[::2])} before each forward"
            )
        needed = (int(positions.max()) // exact.KEY_BLOCK + 1) * exact.KEY_BLOCK
        if needed > self.keys.shape[2]:
            self._grow(max(needed, 2 * self.keys.shape[2]))
        if positions.shape[1] == 1:  # a decode step: every row one token
            rows, at, new = torch.arange(len(positions)), positions[:, 0], slice(0, 1)
            self.keys[rows, :, at] = key_states[:, :, 0]
            self.values[rows, :, at] = value_states[:, :, 0]
        else:
            rows, new = (positions >= 0).nonzero(as_tuple=True)
            at = positions[rows, new]
            self.keys[rows, :, at] = key_states[rows, :, new]
            self.values[rows, :, at] = value_states[rows, :, new]
        self.width += key_states.shape[2]
        if self is self.owner.layers[-1]:  # the forward's last layer: `at` again before the next
            self.owner.positions = None
        return self.keys[:, :, :needed], self.values[:, :, :needed]

    def _grow(self, capacity: int) -> None:
        capacity = -(-capacity // exact.KEY_BLOCK) * exact.KEY_BLOCK
        more = capacity - self.keys.shape[2]
        self.keys = torch.cat(
            [self.keys, self.keys.new_zeros(*self.keys.shape[:2], more, self.keys.shape[3])], 2
        )
        self.values = torch.cat(
            [
                self.values,
                self.values.new_zeros(*self.values.shape[:2], more, self.values.shape[3]),
            ],
            2,
        )

    def get_seq_length(self) -> int:
        return self.width

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.keys, self.values = self.keys[indices], self.values[indices]

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a PositionCache is not cropped")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("a PositionCache is not repeated")


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
    from ember_rollout.quantized import QuantExperts

    for site in sites:
        router, experts = site.router, site.experts
        quantized = isinstance(experts, QuantExperts)  # `engine.quantization`: its own kernel
        if not quantized and not (
            hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj")
        ):
            raise ValueError(
                f"rollout.true_on_policy: layer {site.layer}'s experts hold no fused "
                "gate_up_proj/down_proj weights"
            )
        router.__class__ = _exact_class(
            type(router),
            {"forward": _router_forward, "ember_router_scores": family.router_scores},
        )
        if quantized:
            experts.exact = True
        else:
            experts.__class__ = _exact_class(type(experts), {"forward": _experts_forward})


def exact_model(model: nn.Module) -> nn.Module:
    """Make `model`'s linear layers, RMSNorms and attention the batch-invariant kernels.

    Raises:
        ValueError: A layer this mode has no batch-invariant kernel for, named.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, exact_attention)
    from ember_rollout.quantized import QuantLinear

    _exact_moe(model)
    for name, module in model.named_modules():
        cls = type(module)
        if isinstance(module, QuantLinear):  # `engine.quantization`
            module.exact = True
        elif isinstance(module, nn.Linear):
            if cls is not nn.Linear and cls is not ExactLinear:
                raise ValueError(f"rollout.true_on_policy: {name} is a {cls.__name__}")
            module.__class__ = ExactLinear
        elif cls.__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.__class__ = _exact_class(cls, {"forward": _norm_forward})
        elif isinstance(module, nn.LayerNorm | nn.Conv1d | nn.Conv2d):
            raise ValueError(f"rollout.true_on_policy: {name} is a {cls.__name__}")
    model.set_attn_implementation(ATTENTION)
    _check_keywords_reach_attention(model)
    return model


def _check_keywords_reach_attention(model: nn.Module) -> None:
    """`PositionCache` tells the attention where its keys are through the forward's keyword
    arguments: check on one token that they reach every layer's attention.

    Raises:
        ValueError: A model that does not pass them on, named.
    """
    seen: list[nn.Module] = []
    config = getattr(model.config, "text_config", None) or model.config
    device = next(model.parameters()).device
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), **{_PROBE: seen})
    if len(seen) != config.num_hidden_layers:
        raise ValueError(
            f"rollout.true_on_policy: {type(model).__name__} passes a forward's keyword "
            f"arguments to the attention of {len(seen)} of its {config.num_hidden_layers} "
            "layers; the engine tells the attention where its keys are through them"
        )


def linear_shapes(model: nn.Module) -> set[tuple[int, int]]:
    """The [in, out] shapes of `model`'s linear layers, quantized ones included (for
    `exact.check_linear`)."""
    from ember_rollout.quantized import QuantLinear

    return {
        (m.in_features, m.out_features)
        for m in model.modules()
        if isinstance(m, nn.Linear | QuantLinear)
    }
