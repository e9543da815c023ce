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


def _norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return exact.rms_norm(hidden_states, self.weight, self.variance_epsilon)


_NORM_CLASSES: dict[type, type] = {}


def _exact_norm_class(cls: type) -> type:
    if cls not in _NORM_CLASSES:
        _NORM_CLASSES[cls] = type(f"Exact{cls.__name__}", (cls,), {"forward": _norm_forward})
    return _NORM_CLASSES[cls]


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
        position_ids = torch.arange(width - num_q, width, device=query.device).expand(batch, -1)
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


def exact_model(model: nn.Module) -> nn.Module:
    """Make `model`'s linear layers, RMSNorms and attention the batch-invariant kernels.

    Raises:
        ValueError: A layer this mode has no batch-invariant kernel for, named.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, exact_attention)
    for name, module in model.named_modules():
        cls = type(module)
        if isinstance(module, nn.Linear):
            if cls is not nn.Linear and cls is not ExactLinear:
                raise ValueError(f"rollout.true_on_policy: {name} is a {cls.__name__}")
            module.__class__ = ExactLinear
        elif cls.__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.__class__ = _exact_norm_class(cls)
        elif isinstance(module, nn.LayerNorm | nn.Conv1d | nn.Conv2d):
            raise ValueError(f"rollout.true_on_policy: {name} is a {cls.__name__}")
    model.set_attn_implementation(ATTENTION)
    return model


def linear_shapes(model: nn.Module) -> set[tuple[int, int]]:
    """The [in, out] shapes of `model`'s linear layers (for `exact.check_linear`)."""
    return {(m.in_features, m.out_features) for m in model.modules() if isinstance(m, nn.Linear)}
