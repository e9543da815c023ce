"""Parameter names and layouts: megatron-core GPTModel <-> transformers Qwen3-MoE / Qwen3.

Everything here is pure tensor bookkeeping on *full* (unsharded) tensors named as in a model
built with TP = PP = EP = 1 and the local layer spec ("global Megatron names"); ``weights.py``
adds the sharding and the I/O. The transformers side is the checkpoint (safetensors) layout that
``from_pretrained`` loads and SGLang reads: one tensor per expert
(``mlp.experts.{e}.gate_proj.weight`` ...), even though transformers 5 keeps experts fused in
memory (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]).

Layouts that are not a plain rename:
- ``linear_qkv`` [G * (Q/G + 2) * D, H]: per query group g, its Q/G query heads, then its key
  head, then its value head (D = head_dim). transformers keeps q_proj [Q * D, H], k_proj and
  v_proj [G * D, H] apart.
- ``linear_fc1`` (dense MLP and each expert) [2F, H]: gate rows, then up rows.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ember_megatron_backend.model import ModelConfig

__all__ = [
    "HfRule",
    "fuse_experts",
    "hf_config",
    "hf_rule",
    "megatron_names",
    "merge_qkv",
    "model_config_from_hf",
    "split_qkv",
]


def merge_qkv(q: Tensor, k: Tensor, v: Tensor, cfg: ModelConfig) -> Tensor:
    """q_proj, k_proj, v_proj weights -> Megatron ``linear_qkv`` weight (grouped layout)."""
    g, d = cfg.num_query_groups, cfg.head_dim
    per_group = cfg.num_attention_heads // g
    hidden = q.shape[-1]
    q_g = q.reshape(g, per_group * d, hidden)
    k_g = k.reshape(g, d, hidden)
    v_g = v.reshape(g, d, hidden)
    return torch.cat([q_g, k_g, v_g], dim=1).reshape(g * (per_group + 2) * d, hidden)


def split_qkv(qkv: Tensor, cfg: ModelConfig) -> tuple[Tensor, Tensor, Tensor]:
    """Megatron ``linear_qkv`` weight -> q_proj, k_proj, v_proj weights."""
    g, d = cfg.num_query_groups, cfg.head_dim
    per_group = cfg.num_attention_heads // g
    hidden = qkv.shape[-1]
    q, k, v = qkv.reshape(g, (per_group + 2) * d, hidden).split([per_group * d, d, d], dim=1)
    return (
        q.reshape(g * per_group * d, hidden).contiguous(),
        k.reshape(g * d, hidden).contiguous(),
        v.reshape(g * d, hidden).contiguous(),
    )


def _cat0(*parts: Tensor) -> Tensor:
    return torch.cat(parts, dim=0)


def _halves(fc1: Tensor) -> tuple[Tensor, Tensor]:
    gate, up = fc1.chunk(2, dim=0)
    return gate.contiguous(), up.contiguous()


def _same(t: Tensor) -> Tensor:
    return t


def _one(t: Tensor) -> tuple[Tensor]:
    return (t,)


@dataclass(frozen=True, slots=True)
class HfRule:
    """How one global Megatron parameter is made of checkpoint tensors, and back."""

    hf_names: tuple[str, ...]
    """Checkpoint names, in the order `merge` takes and `split` returns them."""
    merge: Callable[..., Tensor]
    """Checkpoint tensors -> Megatron tensor."""
    split: Callable[[Tensor], Sequence[Tensor]]
    """Megatron tensor -> checkpoint tensors."""


_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight")
_LAYER_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_TOP_RENAMES = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def hf_rule(name: str, cfg: ModelConfig) -> HfRule:
    """The checkpoint counterpart of a global Megatron parameter name.

    Raises:
        KeyError: if `name` has no checkpoint counterpart (for example a critic's value layer).
    """
    if name in _TOP_RENAMES:
        return HfRule((_TOP_RENAMES[name],), _same, _one)
    match = _LAYER.fullmatch(name)
    if match is None:
        raise KeyError(name)
    layer, rest = match.groups()
    prefix = f"model.layers.{layer}."
    if rest in _LAYER_RENAMES:
        return HfRule((prefix + _LAYER_RENAMES[rest],), _same, _one)
    if rest == "self_attention.linear_qkv.weight":
        names = tuple(prefix + f"self_attn.{p}_proj.weight" for p in "qkv")
        return HfRule(names, lambda q, k, v: merge_qkv(q, k, v, cfg), lambda t: split_qkv(t, cfg))
    if rest == "mlp.linear_fc1.weight":
        names = (prefix + "mlp.gate_proj.weight", prefix + "mlp.up_proj.weight")
        return HfRule(names, _cat0, _halves)
    expert = _EXPERT.fullmatch(rest)
    if expert is not None:
        e, which = expert.groups()
        base = f"{prefix}mlp.experts.{e}."
        if which == "linear_fc1":
            return HfRule((base + "gate_proj.weight", base + "up_proj.weight"), _cat0, _halves)
        return HfRule((base + "down_proj.weight",), _same, _one)
    raise KeyError(name)


def megatron_names(cfg: ModelConfig, *, critic: bool = False) -> list[str]:
    """Global Megatron parameter names of the full model, in GPTModel's order.

    Args:
        cfg: Model shape.
        critic: Name the value output layer instead of the vocabulary one.
    """
    names = ["embedding.word_embeddings.weight"]
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        names += [
            p + "input_layernorm.weight",
            p + "self_attention.linear_proj.weight",
            p + "self_attention.linear_qkv.weight",
            p + "self_attention.q_layernorm.weight",
            p + "self_attention.k_layernorm.weight",
            p + "pre_mlp_layernorm.weight",
        ]
        if cfg.is_moe:
            names.append(p + "mlp.router.weight")
            for e in range(cfg.num_experts):
                q = f"{p}mlp.experts.local_experts.{e}."
                names += [q + "linear_fc1.weight", q + "linear_fc2.weight"]
        else:
            names += [p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
    names.append("decoder.final_layernorm.weight")
    if critic or not cfg.tie_word_embeddings:
        names.append("output_layer.weight")
    return names


_FUSED = re.compile(
    r"(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight"
)


def fuse_experts(items: Sequence[tuple[str, Tensor]], cfg: ModelConfig) -> list[tuple[str, Tensor]]:
    """Checkpoint-layout tensors -> transformers 5 in-memory layout (fused 3-D expert tensors).

    Per-expert ``gate_proj``/``up_proj``/``down_proj`` of a layer become
    ``mlp.experts.gate_up_proj`` [E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I]; all other
    tensors pass through. Every expert of a layer must be present in `items`.
    """
    out: list[tuple[str, Tensor]] = []
    groups: dict[str, dict[str, dict[int, Tensor]]] = {}
    for name, tensor in items:
        match = _FUSED.fullmatch(name)
        if match is None:
            out.append((name, tensor))
            continue
        prefix, e, which = match.groups()
        groups.setdefault(prefix, {}).setdefault(which, {})[int(e)] = tensor
    for prefix, parts in groups.items():
        experts = range(cfg.num_experts)
        missing = [
            f"{prefix}{e}.{w}.weight"
            for w in ("gate_proj", "up_proj", "down_proj")
            for e in experts
            if e not in parts.get(w, {})
        ]
        if missing:
            raise ValueError(f"cannot fuse experts: {missing[0]} is missing")
        gate_up = [torch.cat([parts["gate_proj"][e], parts["up_proj"][e]], dim=0) for e in experts]
        out.append((prefix + "gate_up_proj", torch.stack(gate_up)))
        out.append((prefix + "down_proj", torch.stack([parts["down_proj"][e] for e in experts])))
    return out


def hf_config(cfg: ModelConfig, *, dtype: torch.dtype = torch.float32) -> Any:
    """The transformers config (Qwen3MoeConfig or Qwen3Config) of a ModelConfig."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.norm_epsilon,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_word_embeddings,
        attention_bias=False,
        initializer_range=cfg.init_method_std,
    )
    if not cfg.is_moe:
        config = Qwen3Config(intermediate_size=cfg.ffn_hidden_size, **common)
        config.architectures = ["Qwen3ForCausalLM"]
    else:
        config = Qwen3MoeConfig(
            intermediate_size=cfg.ffn_hidden_size or cfg.moe_ffn_hidden_size,
            moe_intermediate_size=cfg.moe_ffn_hidden_size,
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.moe_router_topk,
            norm_topk_prob=cfg.norm_topk_prob,
            router_aux_loss_coef=cfg.moe_aux_loss_coeff,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            **common,
        )
        config.architectures = ["Qwen3MoeForCausalLM"]
    config.dtype = dtype
    return config


def model_config_from_hf(config: Any, **overrides: Any) -> ModelConfig:
    """A ModelConfig from a transformers Qwen3-MoE or Qwen3 config (``AutoConfig``).

    Raises:
        ValueError: for another architecture, or Qwen3-MoE features the backend does not build
            (dense layers between MoE layers, sliding windows, attention biases).
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in ("qwen3_moe", "qwen3"):
        raise ValueError(f"unsupported model_type {model_type!r}; expected 'qwen3_moe' or 'qwen3'")
    if getattr(config, "attention_bias", False):
        raise ValueError("attention_bias=True is not supported (Qwen3 has no attention bias)")
    if getattr(config, "use_sliding_window", False):
        raise ValueError("use_sliding_window=True is not supported")
    rope = getattr(config, "rope_parameters", None) or {}
    rope_theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type {rope.get('rope_type')!r} is not supported, only 'default'")
    fields: dict[str, Any] = dict(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_key_value_heads,
        head_dim=getattr(config, "head_dim", None)
        or config.hidden_size // config.num_attention_heads,
        vocab_size=config.vocab_size,
        ffn_hidden_size=config.intermediate_size,
        rope_theta=float(rope_theta),
        norm_epsilon=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        init_method_std=getattr(config, "initializer_range", 0.02),
    )
    if model_type == "qwen3_moe":
        sparse_step = getattr(config, "decoder_sparse_step", 1)
        if getattr(config, "mlp_only_layers", None) or sparse_step != 1:
            raise ValueError(
                "Qwen3-MoE configs with dense layers (mlp_only_layers, decoder_sparse_step != 1) "
                "are not supported"
            )
        fields.update(
            num_experts=config.num_experts,
            moe_ffn_hidden_size=config.moe_intermediate_size,
            moe_router_topk=config.num_experts_per_tok,
            norm_topk_prob=bool(config.norm_topk_prob),
            # The load-balancing loss coefficient, as megatron-core names it (mbridge maps it the
            # same way); model_overrides.moe_aux_loss_coeff=0 trains without the loss.
            moe_aux_loss_coeff=float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0),
        )
    fields.update(overrides)
    return ModelConfig(**fields)
