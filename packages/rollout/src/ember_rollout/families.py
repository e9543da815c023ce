"""The MoE families the engines serve: config fields, checkpoint names, tiny random models.

Facts read in transformers 5.19 (`models/<family>/modeling_*.py`, `configuration_*.py`,
`conversion_mapping.py`), per family: router rule; experts field; dense layers; checkpoint names.

- qwen3_moe: softmax over the logits, top-k; `num_experts` (Hub configs; transformers 5.19
  maps it to `num_local_experts` and writes that); `mlp_only_layers` and `decoder_sparse_step`;
  `mlp.gate.weight`, `mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`.
- deepseek_v3: sigmoid scores plus `e_score_correction_bias` choose (the bias only chooses),
  groups scored by their two best experts, the best `topk_group` of `n_group` groups kept, top-k
  among them; `n_routed_experts`; `first_k_dense_replace`; as qwen3_moe plus
  `mlp.gate.e_score_correction_bias` and `mlp.shared_experts.*`.
- glm4_moe: as deepseek_v3 (same router code).
- qwen2_moe: softmax top-k; `num_experts`; `mlp_only_layers` and `decoder_sparse_step`; as
  qwen3_moe plus `mlp.shared_expert.*` and `mlp.shared_expert_gate.weight`.
- mixtral: softmax top-k; `num_local_experts`; no dense layers;
  `block_sparse_moe.gate.weight`, `block_sparse_moe.experts.{e}.w1/w3/w2.weight` (gate, up,
  down).

In memory transformers 5 fuses each layer's experts into `mlp.experts.gate_up_proj` [E, 2I, H]
(gate rows first) and `mlp.experts.down_proj` [E, H, I], and names Mixtral's block `mlp`;
`save_pretrained` writes the checkpoint names above. Every family's MoE block calls its
`experts` module with the selected ids, `experts(hidden [T, H], top_k_index [T, k],
top_k_weights [T, k])`, which is where the engine records routing.

The tiny builders give each family a small random model (hidden 64, 8 experts, top-2, groups and
a dense first layer where the family has them) for tests and for training presets; Ember's
preset names are in `Family.preset`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "EXPERT_COUNT_KEYS",
    "FAMILIES",
    "Family",
    "build_family_model",
    "cast_model",
    "checkpoint_naming",
    "config_num_experts",
    "config_moe_layers",
    "family_config",
    "write_family_checkpoint",
]

EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
"""Config fields holding the routed experts per layer (Qwen, Mixtral, DeepSeek/GLM)."""


@dataclass(frozen=True, slots=True)
class Family:
    """One MoE architecture of transformers and how its checkpoints name the MoE block."""

    model_type: str
    """transformers' `model_type` (config.json)."""
    architecture: str
    """The causal-LM class of transformers (config.json `architectures`)."""
    preset: str
    """Ember's name for the tiny preset of this family."""
    moe_block: str = "mlp"
    """Name of the MoE block in checkpoints (transformers 5 calls it `mlp` in memory)."""
    expert_projections: Mapping[str, str] = field(
        default_factory=lambda: {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    )
    """Checkpoint name of each per-expert projection -> gate, up or down."""
    first_dense: int = 0
    """Leading dense layers of the tiny model."""
    router_scores: str = "softmax"
    """How the router scores the experts it weighs: "softmax" over the logits (the top-k
    renormalised where the router's `norm_topk_prob` says so, always for Mixtral, which has no
    such field) or "sigmoid" of each logit (renormalised under `norm_topk_prob`, then times
    `routed_scaling_factor`). `routing.replay_routing` weighs recorded experts by it."""


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("qwen3_moe", "Qwen3MoeForCausalLM", "tiny-moe"),
        Family(
            "deepseek_v3",
            "DeepseekV3ForCausalLM",
            "tiny-deepseek-v3",
            first_dense=1,
            router_scores="sigmoid",
        ),
        Family(
            "glm4_moe",
            "Glm4MoeForCausalLM",
            "tiny-glm4-moe",
            first_dense=1,
            router_scores="sigmoid",
        ),
        Family("qwen2_moe", "Qwen2MoeForCausalLM", "tiny-qwen2-moe"),
        # transformers 5.19 conversion_mapping.py "mixtral": block_sparse_moe -> mlp, w1 + w3 ->
        # experts.gate_up_proj (gate first), w2 -> experts.down_proj.
        Family(
            "mixtral",
            "MixtralForCausalLM",
            "tiny-mixtral",
            moe_block="block_sparse_moe",
            expert_projections={"w1": "gate", "w3": "up", "w2": "down"},
        ),
    )
}
"""The families the engines are tested with, by `model_type`."""

_DEFAULT_NAMING = Family("", "", "")


def checkpoint_naming(model_type: str | None) -> Family:
    """How checkpoints of `model_type` name the MoE block (per-expert `gate_proj` / `up_proj` /
    `down_proj` under `mlp` unless the family says otherwise, as most transformers MoEs do)."""
    return FAMILIES.get(model_type or "", _DEFAULT_NAMING)


# --------------------------------------------------------------------------------------------
# Config fields
# --------------------------------------------------------------------------------------------


def _as_dict(config: Any) -> Mapping[str, Any]:
    if isinstance(config, Mapping):
        return config.get("text_config", config)
    config = getattr(config, "text_config", None) or config
    return config.to_dict()


def config_num_experts(config: Any) -> int | None:
    """Routed experts per MoE layer from a config (object or config.json dict), or None."""
    values = _as_dict(config)
    for key in EXPERT_COUNT_KEYS:
        value = values.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def config_moe_layers(config: Any) -> tuple[int, ...]:
    """Indices of the layers a config makes MoE (object or config.json dict).

    Rules of transformers 5.19's decoder layers: `first_k_dense_replace` (DeepSeek-V3, GLM-4.5)
    makes the first k dense; `mlp_only_layers` and `decoder_sparse_step` (Qwen2/Qwen3-MoE) make
    the listed layers, and those where (i + 1) is not a multiple of the step, dense; a config
    without experts or top-k has none.
    """
    values = _as_dict(config)
    num_layers = int(values["num_hidden_layers"])
    if not values.get("num_experts_per_tok") or not config_num_experts(values):
        return ()
    first = int(values.get("first_k_dense_replace") or 0)
    only_mlp = set(values.get("mlp_only_layers") or [])
    step = int(values.get("decoder_sparse_step") or 1)
    return tuple(
        i for i in range(num_layers) if i >= first and i not in only_mlp and (i + 1) % step == 0
    )


# --------------------------------------------------------------------------------------------
# Tiny random models
# --------------------------------------------------------------------------------------------


def family_config(
    model_type: str,
    *,
    vocab_size: int = 17,
    num_layers: int = 3,
    hidden_size: int = 64,
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    first_dense: int | None = None,
    max_position_embeddings: int = 512,
    eos_token_id: int | None = 0,
    pad_token_id: int | None = 0,
):
    """A small transformers config of family `model_type` (defaults fit the toy tokenizer).

    Attention has 4 query and 2 key/value heads of width 16 (DeepSeek-V3: MLA with low-rank
    q and kv); experts are 32 wide, dense MLPs 96. DeepSeek-V3 and GLM-4.5 route group-limited
    (4 groups, the best 2 kept) and have a shared expert, Qwen2-MoE a gated shared expert.

    Args:
        model_type: A key of `FAMILIES`.
        first_dense: Leading dense layers; None takes the family's (`Family.first_dense`).

    Raises:
        ValueError: An unknown family, or a shape the family cannot take (named).
    """
    if model_type not in FAMILIES:
        raise ValueError(f"model_type={model_type!r} is not one of {', '.join(FAMILIES)}")
    family = FAMILIES[model_type]
    first = family.first_dense if first_dense is None else first_dense
    if not 0 <= first < num_layers:
        raise ValueError(f"first_dense={first}: expected 0 <= first_dense < {num_layers} layers")
    if not 1 <= num_experts_per_tok <= num_experts:
        raise ValueError(
            f"num_experts_per_tok={num_experts_per_tok}: expected 1 .. num_experts={num_experts}"
        )
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts_per_tok": num_experts_per_tok,
        "max_position_embeddings": max_position_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "bos_token_id": None,
    }
    import transformers

    if model_type == "qwen3_moe":
        from ember_rollout.config import TinyModelConfig
        from ember_rollout.models import tiny_model_config

        tiny = TinyModelConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            moe_intermediate_size=32,
            intermediate_size=96,
            dense_layers=list(range(first)),
            max_position_embeddings=max_position_embeddings,
        )
        return tiny_model_config(
            tiny, vocab_size=vocab_size, eos_token_id=eos_token_id, pad_token_id=pad_token_id
        )
    if model_type in ("deepseek_v3", "glm4_moe"):
        groups = 4 if num_experts % 4 == 0 and num_experts // 4 >= 2 else 1
        routed = {
            "n_routed_experts": num_experts,
            "n_group": groups,
            "topk_group": max(1, groups // 2),
            "n_shared_experts": 1,
            "first_k_dense_replace": first,
            "moe_intermediate_size": 32,
            "intermediate_size": 96,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "num_nextn_predict_layers": 0,
        }
        if groups > 1 and num_experts_per_tok > routed["topk_group"] * num_experts // groups:
            raise ValueError(
                f"num_experts_per_tok={num_experts_per_tok} exceeds the experts of the "
                f"{routed['topk_group']} groups kept"
            )
        if model_type == "deepseek_v3":
            # MLA expands its latent to every query head: as many kv heads as query heads.
            common["num_key_value_heads"] = common["num_attention_heads"]
            return transformers.DeepseekV3Config(
                **common,
                **routed,
                q_lora_rank=32,
                kv_lora_rank=16,
                qk_nope_head_dim=16,
                qk_rope_head_dim=8,
                v_head_dim=16,
                rope_interleave=True,
            )
        # GLM-4.5: qkv bias and QK norm, RoPE on half of each head.
        common["rope_parameters"] = {**common["rope_parameters"], "partial_rotary_factor": 0.5}
        return transformers.Glm4MoeConfig(
            **common,
            **routed,
            head_dim=16,
            attention_bias=True,
            use_qk_norm=True,
        )
    if model_type == "qwen2_moe":
        return transformers.Qwen2MoeConfig(
            **common,
            num_experts=num_experts,
            moe_intermediate_size=32,
            intermediate_size=96,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
            mlp_only_layers=list(range(first)),
            decoder_sparse_step=1,
        )
    if first:
        raise ValueError(f"first_dense={first}: {model_type} has no dense layers")
    return transformers.MixtralConfig(
        **common, num_local_experts=num_experts, intermediate_size=32, head_dim=16
    )


def cast_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast `model` to `dtype`, keeping in fp32 what transformers' `from_pretrained` keeps there
    (`_keep_in_fp32_modules_strict`, e.g. DeepSeek's `e_score_correction_bias`)."""
    model.to(dtype)
    strict = getattr(model, "_keep_in_fp32_modules_strict", None) or ()
    if dtype in (torch.float16, torch.bfloat16) and strict:
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if any(key in name for key in strict):
                tensor.data = tensor.data.float()
    return model


@torch.no_grad()
def build_family_model(
    model_type: str,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    **shape: Any,
) -> nn.Module:
    """A random causal LM of family `model_type` (`family_config(model_type, **shape)`).

    The same seed gives the same weights. Routers with an expert bias (DeepSeek-V3, GLM-4.5)
    get a random one of std 0.02, about the spread of their sigmoid scores at this init, so both
    the bias and the group limit change which experts are chosen (measured on the default shape:
    the choice differs from the top-k of the raw logits at 50-75% of positions, and from the
    top-k without the group limit at 25-40%).
    Weights are drawn in fp32, then cast (see `cast_model`).
    """
    import transformers

    config = family_config(model_type, **shape)
    config._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, FAMILIES[model_type].architecture)(config)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.02)
    return cast_model(model, dtype).eval()


def write_family_checkpoint(
    path: str | Path,
    model_type: str,
    *,
    seed: int = 0,
    tokenizer: Any = None,
    dtype: torch.dtype = torch.float32,
    **shape: Any,
) -> Path:
    """Save `build_family_model(model_type, seed=seed, **shape)` and a tokenizer (default the toy
    one) as an HF model directory, as the trainer exports one."""
    from ember_rollout.tokenizer import toy_tokenizer

    tokenizer = tokenizer if tokenizer is not None else toy_tokenizer()
    shape.setdefault("vocab_size", len(tokenizer))
    shape.setdefault("eos_token_id", tokenizer.eos_token_id)
    shape.setdefault("pad_token_id", tokenizer.pad_token_id)
    model = build_family_model(model_type, seed=seed, dtype=dtype, **shape)
    path = Path(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
