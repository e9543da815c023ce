"""Parameter names and layouts: megatron-core GPTModel <-> transformers checkpoints, per family.

A family (``families.py``, in ``family_spec``'s terms) is a declarative description: which
checkpoint tensors each Megatron parameter is made of (``Param`` rules, grouped by where they sit
in a layer), and how its transformers config reads and writes a ``ModelConfig`` (``HfConfig``).
This module is the one mechanism that interprets those descriptions; adding a family adds a
description, not code here.

Everything here is pure bookkeeping on *full* (unsharded) tensors named as in a model built with
TP = PP = EP = 1 and the local layer spec ("global Megatron names"); ``weights.py`` adds the
sharding and the I/O. The transformers side is the checkpoint (safetensors) layout that
``from_pretrained`` loads and SGLang reads: one tensor per expert, even though transformers 5
keeps experts fused in memory.

Layouts that are not a plain rename:
- ``qkv``: Megatron's ``linear_qkv`` [G * (Q/G + 2) * D, ...]: per query group g, its Q/G query
  heads, then its key head, then its value head (D = head_dim); transformers keeps q_proj
  [Q * D, ...], k_proj and v_proj [G * D, ...] apart. Weights and biases alike.
- ``glu``: ``linear_fc1`` of a SwiGLU MLP (dense, expert or shared) [2F, H]: gate rows, then up
  rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ember_megatron_backend.families import REGISTRY
from ember_megatron_backend.family_spec import Family, HfConfig, Param, p
from ember_megatron_backend.model import FAMILIES, ModelConfig

__all__ = [
    "Family",
    "HfConfig",
    "HfRule",
    "Param",
    "family_of",
    "hf_config",
    "hf_names",
    "hf_rule",
    "hf_shapes",
    "megatron_names",
    "merge_qkv",
    "model_config_from_hf",
    "split_qkv",
]


TOP = (
    p("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
    p("decoder.final_layernorm.weight", "model.norm.weight"),
)
OUTPUT = p("output_layer.weight", "lm_head.weight")


def family_of(cfg_or_name: ModelConfig | str) -> Family:
    """The description of a family (by ModelConfig or ``model_type``)."""
    name = cfg_or_name if isinstance(cfg_or_name, str) else cfg_or_name.family
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unsupported model_type {name!r}; supported: {', '.join(FAMILIES)}"
        ) from None


# --- rules ------------------------------------------------------------------------------------


def merge_qkv(q: Tensor, k: Tensor, v: Tensor, cfg: ModelConfig) -> Tensor:
    """q_proj, k_proj, v_proj weights or biases -> Megatron ``linear_qkv`` (grouped layout)."""
    g, d = cfg.num_query_groups, cfg.head_dim
    per_group = cfg.num_attention_heads // g
    rest = q.shape[1:]
    q_g = q.reshape(g, per_group * d, *rest)
    k_g = k.reshape(g, d, *rest)
    v_g = v.reshape(g, d, *rest)
    return torch.cat([q_g, k_g, v_g], dim=1).reshape(g * (per_group + 2) * d, *rest)


def split_qkv(qkv: Tensor, cfg: ModelConfig) -> tuple[Tensor, Tensor, Tensor]:
    """Megatron ``linear_qkv`` weight or bias -> q_proj, k_proj, v_proj."""
    g, d = cfg.num_query_groups, cfg.head_dim
    per_group = cfg.num_attention_heads // g
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(g, (per_group + 2) * d, *rest).split([per_group * d, d, d], dim=1)
    return (
        q.reshape(g * per_group * d, *rest).contiguous(),
        k.reshape(g * d, *rest).contiguous(),
        v.reshape(g * d, *rest).contiguous(),
    )


def _halves(fc1: Tensor) -> tuple[Tensor, Tensor]:
    gate, up = fc1.chunk(2, dim=0)
    return gate.contiguous(), up.contiguous()


@dataclass(frozen=True, slots=True)
class HfRule:
    """How one global Megatron parameter is made of checkpoint tensors, and back."""

    hf_names: tuple[str, ...]
    """Checkpoint names, in the order `merge` takes and `split` returns them."""
    merge: Callable[..., Tensor]
    """Checkpoint tensors -> Megatron tensor."""
    split: Callable[[Tensor], Sequence[Tensor]]
    """Megatron tensor -> checkpoint tensors."""


def _rule(param: Param, hf_names: tuple[str, ...], cfg: ModelConfig) -> HfRule:
    if param.layout == "same":
        return HfRule(hf_names, lambda t: t, lambda t: (t,))
    if param.layout == "glu":
        return HfRule(hf_names, lambda g, u: torch.cat([g, u], dim=0), _halves)
    if param.layout == "qkv":
        return HfRule(
            hf_names, lambda q, k, v: merge_qkv(q, k, v, cfg), lambda t: split_qkv(t, cfg)
        )
    raise ValueError(f"unknown layout {param.layout!r}")


def _layer_params(cfg: ModelConfig, layer: int) -> Iterator[tuple[Param, int | None]]:
    """The rules of decoder layer `layer` with the expert index each applies to (None: not an
    expert parameter), in Megatron's order."""
    fam = family_of(cfg)
    for param in fam.attention:
        if param.applies(cfg):
            yield param, None
    if layer not in cfg.moe_layers:
        for param in fam.dense_mlp:
            if param.applies(cfg):
                yield param, None
        return
    for param in fam.router:
        if param.applies(cfg):
            yield param, None
    for e in range(cfg.num_experts):
        for param in fam.expert:
            yield param, e
    for param in fam.shared:
        if param.applies(cfg):
            yield param, None


@dataclass(frozen=True, slots=True)
class _Entry:
    megatron: str
    hf: tuple[str, ...]
    param: Param
    layer: int | None
    expert: int | None


def _entries(cfg: ModelConfig, *, critic: bool = False) -> Iterator[_Entry]:
    """Every tensor of the model: its global Megatron name and checkpoint names."""
    yield _Entry(TOP[0].megatron, TOP[0].hf, TOP[0], None, None)
    for i in range(cfg.num_layers):
        for param, e in _layer_params(cfg, i):
            sub = {} if e is None else {"e": e}
            yield _Entry(
                f"decoder.layers.{i}.{param.megatron.format(**sub)}",
                tuple(f"model.layers.{i}.{n.format(**sub)}" for n in param.hf),
                param,
                i,
                e,
            )
    yield _Entry(TOP[1].megatron, TOP[1].hf, TOP[1], None, None)
    if critic or not cfg.tie_word_embeddings:
        yield _Entry(OUTPUT.megatron, OUTPUT.hf, OUTPUT, None, None)


_CACHE: dict[tuple[Any, ...], dict[str, HfRule]] = {}


def _rules(cfg: ModelConfig) -> dict[str, HfRule]:
    key = tuple(getattr(cfg, f) for f in cfg.__slots__)
    rules = _CACHE.get(key)
    if rules is None:
        rules = {e.megatron: _rule(e.param, e.hf, cfg) for e in _entries(cfg, critic=True)}
        if len(_CACHE) > 16:
            _CACHE.clear()
        _CACHE[key] = rules
    return rules


def hf_rule(name: str, cfg: ModelConfig) -> HfRule:
    """The checkpoint counterpart of a global Megatron parameter name.

    Raises:
        KeyError: if `name` has no checkpoint counterpart (for example a critic's value layer).
    """
    return _rules(cfg)[name]


def megatron_names(cfg: ModelConfig, *, critic: bool = False) -> list[str]:
    """Global Megatron names of the full model's tensors (parameters and the routers' expert
    biases), layer by layer.

    Args:
        cfg: Model shape.
        critic: Name the value output layer instead of the vocabulary one.
    """
    return [e.megatron for e in _entries(cfg, critic=critic)]


def hf_names(cfg: ModelConfig) -> list[str]:
    """Checkpoint names of every tensor of the model, from its family's description."""
    return [n for e in _entries(cfg) for n in e.hf]


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of every tensor a transformers checkpoint of `cfg` holds.

    The shapes are transformers' own: its model is built on the meta device (no memory), and
    experts it keeps fused in memory are split per expert as the checkpoint stores them.

    Raises:
        AssertionError: when the family's description and transformers' model disagree on the
            tensors there are (a defect of the description).
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(cfg))
    state = {n: tuple(t.shape) for n, t in model.state_dict().items() if "inv_freq" not in n}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    fam = family_of(cfg)
    out: dict[str, tuple[int, ...]] = {}
    used = set()
    for entry in _entries(cfg):
        for name in entry.hf:
            if fam.in_memory(name) in state:
                out[name] = state[fam.in_memory(name)]
                used.add(fam.in_memory(name))
            elif entry.expert is not None and fam.expert_fused is not None:
                fused = [f"model.layers.{entry.layer}.{n}" for n in fam.expert_fused]
                used.update(fused)
                gate_up, down = state[fused[0]], state[fused[1]]  # [E, 2I, H], [E, H, I]
                glu = entry.param.layout == "glu"
                out[name] = (gate_up[1] // 2, gate_up[2]) if glu else down[1:]
            else:
                raise AssertionError(f"{fam.model_type}: transformers has no tensor {name}")
    missing = sorted(set(state) - used)
    if missing:
        raise AssertionError(f"{fam.model_type}: the description lacks {missing[:3]}")
    return out


# --- configs ------------------------------------------------------------------------------------


def hf_config(cfg: ModelConfig, *, dtype: torch.dtype = torch.float32) -> Any:
    """The transformers config of a ModelConfig (its family's config class)."""
    import transformers

    fam = family_of(cfg)
    spec = fam.hf
    for key, value in spec.fixed_model.items():
        if getattr(cfg, key) != value:
            raise ValueError(
                f"{fam.model_type} models have {key}={value!r}; the config has "
                f"{getattr(cfg, key)!r}"
            )
    values: dict[str, Any] = {hf: getattr(cfg, mine) for mine, hf in spec.fields}
    values.update(spec.fixed)
    values.update(rope_parameters=_rope_to_hf(cfg), hidden_act="silu")
    # The token ids belong to the tokenizer, which writes them next to the weights
    # (`save_tokenizer_for_model`); some config classes default them (DeepSeek-V3's EOS is 1,
    # Mixtral's 2), and an engine reading such a default stops at whatever token has that id.
    values.update(dict.fromkeys(("bos_token_id", "eos_token_id", "pad_token_id")))
    if spec.to_hf is not None:
        values.update(spec.to_hf(cfg))
    config = getattr(transformers, spec.config_class)(**values)
    config.architectures = [spec.architecture]
    config.dtype = dtype
    return config


_YARN = (
    ("rope_yarn_factor", "factor"),
    ("rope_yarn_original_max_position_embeddings", "original_max_position_embeddings"),
    ("rope_yarn_beta_fast", "beta_fast"),
    ("rope_yarn_beta_slow", "beta_slow"),
    ("rope_yarn_mscale", "mscale"),
    ("rope_yarn_mscale_all_dim", "mscale_all_dim"),
)


def _rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
    if cfg.rope_type == "yarn":
        rope.update({hf: getattr(cfg, mine) for mine, hf in _YARN})
    return rope


def _rope_from_hf(config: Any) -> dict[str, Any]:
    """RoPE fields from a transformers 5 config (``rope_parameters``)."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    kind = rope.get("rope_type", "default")
    fields: dict[str, Any] = {
        "rope_theta": float(rope.get("rope_theta", getattr(config, "rope_theta", 10_000.0))),
        "rope_type": kind,
    }
    if kind == "yarn" and getattr(config, "model_type", None) == "deepseek_v3":
        if rope.get("factor") is None or rope.get("attention_factor") is not None:
            raise ValueError(
                "rope_parameters: YaRN needs 'factor' and no 'attention_factor' (it follows "
                "from mscale and mscale_all_dim)"
            )
        defaults = ModelConfig.__dataclass_fields__
        for mine, hf in _YARN:
            value = rope.get(hf)
            fields[mine] = (
                defaults[mine].default if value is None else type(defaults[mine].default)(value)
            )
        if not rope.get("truncate", True):
            raise ValueError("rope_parameters.truncate=False is not supported")
    elif kind != "default":
        raise ValueError(
            f"rope_type {kind!r} is not supported for {getattr(config, 'model_type', None)}: only "
            "'default' (and 'yarn' for deepseek_v3)"
        )
    return fields


def model_config_from_hf(config: Any, **overrides: Any) -> ModelConfig:
    """A ModelConfig from a transformers config (``AutoConfig``) of a supported family.

    Raises:
        ValueError: for another architecture, or features of a family the backend does not
            build; the message names the config attribute.
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(FAMILIES)}")
    spec = family_of(model_type).hf
    for key, value in spec.fixed.items():
        found = getattr(config, key, value)
        if found != value and not (value in (None, False, 0) and not found):
            raise ValueError(
                f"{model_type} config has {key}={found!r}; only {key}={value!r} is supported"
            )
    fields: dict[str, Any] = {mine: getattr(config, hf) for mine, hf in spec.fields}
    fields.update(
        _rope_from_hf(config),
        family=model_type,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        init_method_std=getattr(config, "initializer_range", 0.02),
    )
    fields.update(spec.fixed_model)
    if spec.from_hf is not None:
        fields.update(spec.from_hf(config))
    fields.update(overrides)
    return ModelConfig(**fields)
