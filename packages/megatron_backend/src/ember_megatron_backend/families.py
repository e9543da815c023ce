"""The model families, each a declarative description (``family_spec``) read by ``hf_layout``.

A description says which checkpoint tensors make each Megatron parameter (``Param`` rules per
layer site: attention and norms, dense MLP, router, one routed expert, shared experts) and how
the family's transformers config maps onto ``ModelConfig`` (``HfConfig``). Facts per family are
from transformers 5.19's modeling and configuration files and the checkpoint names it writes
(its ``conversion_mapping.py`` for the fused experts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ember_megatron_backend.family_spec import COMMON_FIELDS, Family, HfConfig, p, swiglu

if TYPE_CHECKING:
    from ember_megatron_backend.model import ModelConfig

__all__ = ["REGISTRY"]

# --- layer sites shared by several families -------------------------------------------------------

_NORMS_IN = p("input_layernorm.weight", "input_layernorm.weight")
_NORMS_MLP = p("pre_mlp_layernorm.weight", "post_attention_layernorm.weight")
_QKV = tuple(f"self_attn.{x}_proj" for x in "qkv")

GQA_ATTENTION = (
    _NORMS_IN,
    p("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
    p("self_attention.linear_qkv.weight", *(f"{n}.weight" for n in _QKV), layout="qkv"),
    p(
        "self_attention.linear_qkv.bias",
        *(f"{n}.bias" for n in _QKV),
        layout="qkv",
        when="add_qkv_bias",
    ),
    p("self_attention.q_layernorm.weight", "self_attn.q_norm.weight", when="qk_layernorm"),
    p("self_attention.k_layernorm.weight", "self_attn.k_norm.weight", when="qk_layernorm"),
    _NORMS_MLP,
)
"""Grouped-query attention: Qwen, GLM, Mixtral, Llama."""

MLA_ATTENTION = (
    _NORMS_IN,
    p("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
    p("self_attention.linear_q_proj.weight", "self_attn.q_proj.weight", when="!q_lora_rank"),
    p("self_attention.linear_q_down_proj.weight", "self_attn.q_a_proj.weight", when="q_lora_rank"),
    p("self_attention.linear_q_up_proj.weight", "self_attn.q_b_proj.weight", when="q_lora_rank"),
    p("self_attention.linear_kv_down_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),
    p("self_attention.linear_kv_up_proj.weight", "self_attn.kv_b_proj.weight"),
    p("self_attention.q_layernorm.weight", "self_attn.q_a_layernorm.weight", when="q_lora_rank"),
    p("self_attention.kv_layernorm.weight", "self_attn.kv_a_layernorm.weight"),
    _NORMS_MLP,
)
"""DeepSeek's multi-latent attention: queries (optionally) and keys/values through low-rank
projections with RMSNorm, a rotary part shared by all heads."""

DENSE_MLP = swiglu("mlp", "mlp")
ROUTER = (p("mlp.router.weight", "mlp.gate.weight"),)
SIGMOID_ROUTER = (
    *ROUTER,
    p("mlp.router.expert_bias", "mlp.gate.e_score_correction_bias", when="moe_router_expert_bias"),
)
EXPERT = swiglu("mlp.experts.local_experts.{e}", "mlp.experts.{e}")
FUSED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
SHARED_EXPERTS = swiglu(
    "mlp.shared_experts", "mlp.shared_experts", when="moe_shared_expert_intermediate_size"
)


# --- config pieces that are not 1:1 ---------------------------------------------------------------

_GQA_FIELDS = (("num_query_groups", "num_key_value_heads"), ("head_dim", "head_dim"))
_MOE_FIELDS = (
    ("num_experts", "num_experts"),
    ("moe_ffn_hidden_size", "moe_intermediate_size"),
    ("moe_router_topk", "num_experts_per_tok"),
)


_DEEPSEEK_STYLE_FIELDS = (
    ("num_experts", "n_routed_experts"),
    ("moe_ffn_hidden_size", "moe_intermediate_size"),
    ("moe_router_topk", "num_experts_per_tok"),
    ("ffn_hidden_size", "intermediate_size"),
    ("norm_topk_prob", "norm_topk_prob"),
    ("moe_router_topk_scaling_factor", "routed_scaling_factor"),
)
"""What DeepSeek-V3 and GLM-4.5 configs name alike."""


def _dense_list_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {"mlp_only_layers": list(cfg.dense_layers)}


def _dense_list_from_hf(config: Any) -> dict[str, Any]:
    return {"dense_layers": tuple(getattr(config, "mlp_only_layers", None) or ())}


def _first_k_dense(cfg: ModelConfig) -> int:
    k = len(cfg.dense_layers)
    if cfg.dense_layers != tuple(range(k)):
        raise ValueError(
            f"{cfg.family} models have their dense layers first (first_k_dense_replace); "
            f"dense_layers={list(cfg.dense_layers)} is not 0..k-1"
        )
    return k


def _shared_experts(cfg: ModelConfig) -> int:
    n, rem = divmod(cfg.moe_shared_expert_intermediate_size, cfg.moe_ffn_hidden_size)
    if rem:
        raise ValueError(
            f"{cfg.family}: moe_shared_expert_intermediate_size="
            f"{cfg.moe_shared_expert_intermediate_size} must be a multiple of "
            f"moe_ffn_hidden_size={cfg.moe_ffn_hidden_size} (n_shared_experts)"
        )
    return n


def _groups_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "n_group": cfg.moe_router_num_groups or 1,
        "topk_group": cfg.moe_router_group_topk or 1,
    }


def _deepseek_style_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """What DeepSeek-V3 and GLM-4.5 configs share: first-k dense, n shared experts, groups."""
    return {
        "first_k_dense_replace": _first_k_dense(cfg),
        "n_shared_experts": _shared_experts(cfg),
        "num_nextn_predict_layers": 0,
        **_groups_to_hf(cfg),
    }


def _deepseek_style_from_hf(config: Any) -> dict[str, Any]:
    if getattr(config, "moe_layer_freq", 1) != 1:
        raise ValueError(f"moe_layer_freq={config.moe_layer_freq} is not supported, only 1")
    groups = int(getattr(config, "n_group", 1) or 1)
    return {
        "dense_layers": tuple(range(int(config.first_k_dense_replace))),
        "moe_shared_expert_intermediate_size": int(config.n_shared_experts or 0)
        * int(config.moe_intermediate_size),
        "moe_router_num_groups": groups if groups > 1 else 0,
        "moe_router_group_topk": int(config.topk_group) if groups > 1 else 0,
    }


def _deepseek_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        **_deepseek_style_to_hf(cfg),
        "q_lora_rank": cfg.q_lora_rank or None,
        "num_key_value_heads": cfg.num_attention_heads,
        "rope_interleave": True,
    }


def _deepseek_from_hf(config: Any) -> dict[str, Any]:
    if not getattr(config, "rope_interleave", True):
        raise ValueError("deepseek_v3 config has rope_interleave=False; only True is supported")
    return {
        **_deepseek_style_from_hf(config),
        "q_lora_rank": int(config.q_lora_rank or 0),
        "num_query_groups": int(config.num_attention_heads),
    }


def _glm_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        **_deepseek_style_to_hf(cfg),
        "partial_rotary_factor": cfg.rotary_percent,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": cfg.rope_theta,
            "partial_rotary_factor": cfg.rotary_percent,
        },
    }


def _glm_from_hf(config: Any) -> dict[str, Any]:
    rope = getattr(config, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    return {
        **_deepseek_style_from_hf(config),
        "rotary_percent": float(factor),
        "head_dim": int(
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        ),
    }


def _head_dim_is_derived(cfg: ModelConfig) -> None:
    if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        raise ValueError(
            f"{cfg.family} models have head_dim = hidden_size / num_attention_heads = "
            f"{cfg.hidden_size // cfg.num_attention_heads}; the config has {cfg.head_dim}"
        )


def _qwen2_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    _head_dim_is_derived(cfg)
    if bool(cfg.moe_shared_expert_intermediate_size) != cfg.moe_shared_expert_gate:
        raise ValueError("qwen2_moe models have a gated shared expert: both or neither")
    return _dense_list_to_hf(cfg)


def _qwen2_from_hf(config: Any) -> dict[str, Any]:
    shared = int(getattr(config, "shared_expert_intermediate_size", 0) or 0)
    return {
        **_dense_list_from_hf(config),
        "head_dim": config.hidden_size // config.num_attention_heads,
        "moe_shared_expert_gate": shared > 0,
    }


def _mixtral_from_hf(config: Any) -> dict[str, Any]:
    return {"head_dim": int(config.head_dim or config.hidden_size // config.num_attention_heads)}


# --- the families ---------------------------------------------------------------------------------

_SOFTMAX = {"moe_router_score_function": "softmax", "moe_router_expert_bias": False}
_SIGMOID = {"moe_router_score_function": "sigmoid", "moe_router_expert_bias": True}

QWEN3_MOE = Family(
    model_type="qwen3_moe",
    sglang_ties=False,  # sglang srt/models/qwen3_moe.py:1017: its own lm_head, never tied
    attention=GQA_ATTENTION,
    dense_mlp=DENSE_MLP,
    router=ROUTER,
    expert=EXPERT,
    expert_fused=FUSED,
    hf=HfConfig(
        config_class="Qwen3MoeConfig",
        architecture="Qwen3MoeForCausalLM",
        fields=(
            *COMMON_FIELDS,
            *_GQA_FIELDS,
            *_MOE_FIELDS,
            ("ffn_hidden_size", "intermediate_size"),
            ("norm_topk_prob", "norm_topk_prob"),
            ("moe_aux_loss_coeff", "router_aux_loss_coef"),
        ),
        fixed={"decoder_sparse_step": 1, "attention_bias": False, "use_sliding_window": False},
        fixed_model={**_SOFTMAX, "qk_layernorm": True, "add_qkv_bias": False},
        to_hf=_dense_list_to_hf,
        from_hf=_dense_list_from_hf,
    ),
)

QWEN3 = Family(
    model_type="qwen3",
    attention=GQA_ATTENTION,
    dense_mlp=DENSE_MLP,
    hf=HfConfig(
        config_class="Qwen3Config",
        architecture="Qwen3ForCausalLM",
        fields=(*COMMON_FIELDS, *_GQA_FIELDS, ("ffn_hidden_size", "intermediate_size")),
        fixed={"attention_bias": False, "use_sliding_window": False},
        fixed_model={"qk_layernorm": True, "add_qkv_bias": False},
    ),
)

DEEPSEEK_V3 = Family(
    model_type="deepseek_v3",
    attention=MLA_ATTENTION,
    dense_mlp=DENSE_MLP,
    router=SIGMOID_ROUTER,
    expert=EXPERT,
    shared=SHARED_EXPERTS,
    expert_fused=FUSED,
    hf=HfConfig(
        config_class="DeepseekV3Config",
        architecture="DeepseekV3ForCausalLM",
        fields=(
            *COMMON_FIELDS,
            *_DEEPSEEK_STYLE_FIELDS,
            ("kv_lora_rank", "kv_lora_rank"),
            ("head_dim", "qk_nope_head_dim"),
            ("qk_pos_emb_head_dim", "qk_rope_head_dim"),
            ("v_head_dim", "v_head_dim"),
        ),
        fixed={"attention_bias": False},
        fixed_model={**_SIGMOID, "qk_layernorm": False, "add_qkv_bias": False},
        to_hf=_deepseek_to_hf,
        from_hf=_deepseek_from_hf,
    ),
)

GLM4_MOE = Family(
    model_type="glm4_moe",
    sglang_ties=False,  # sglang srt/models/glm4_moe.py:999: its own lm_head, never tied
    attention=GQA_ATTENTION,
    dense_mlp=DENSE_MLP,
    router=SIGMOID_ROUTER,
    expert=EXPERT,
    shared=SHARED_EXPERTS,
    expert_fused=FUSED,
    hf=HfConfig(
        config_class="Glm4MoeConfig",
        architecture="Glm4MoeForCausalLM",
        fields=(
            *COMMON_FIELDS,
            *_DEEPSEEK_STYLE_FIELDS,
            ("num_query_groups", "num_key_value_heads"),
            ("qk_layernorm", "use_qk_norm"),
            ("add_qkv_bias", "attention_bias"),
            ("head_dim", "head_dim"),
        ),
        fixed_model=_SIGMOID,
        to_hf=_glm_to_hf,
        from_hf=_glm_from_hf,
    ),
)

QWEN2_MOE = Family(
    model_type="qwen2_moe",
    sglang_ties=False,  # sglang srt/models/qwen2_moe.py:1238: its own lm_head, never tied
    attention=GQA_ATTENTION,
    dense_mlp=DENSE_MLP,
    router=ROUTER,
    expert=EXPERT,
    shared=(
        *swiglu(
            "mlp.shared_experts", "mlp.shared_expert", when="moe_shared_expert_intermediate_size"
        ),
        p(
            "mlp.shared_experts.gate_weight",
            "mlp.shared_expert_gate.weight",
            when="moe_shared_expert_gate",
        ),
    ),
    expert_fused=FUSED,
    hf=HfConfig(
        config_class="Qwen2MoeConfig",
        architecture="Qwen2MoeForCausalLM",
        fields=(
            *COMMON_FIELDS,
            ("num_query_groups", "num_key_value_heads"),
            *_MOE_FIELDS,
            ("ffn_hidden_size", "intermediate_size"),
            ("norm_topk_prob", "norm_topk_prob"),
            ("moe_aux_loss_coeff", "router_aux_loss_coef"),
            ("moe_shared_expert_intermediate_size", "shared_expert_intermediate_size"),
            ("add_qkv_bias", "qkv_bias"),
        ),
        fixed={"decoder_sparse_step": 1, "use_sliding_window": False},
        fixed_model={**_SOFTMAX, "qk_layernorm": False},
        to_hf=_qwen2_to_hf,
        from_hf=_qwen2_from_hf,
    ),
)

MIXTRAL = Family(
    model_type="mixtral",
    sglang_ties=False,  # sglang srt/models/mixtral.py:355: its own lm_head, never tied
    attention=GQA_ATTENTION,
    dense_mlp=DENSE_MLP,
    router=(p("mlp.router.weight", "block_sparse_moe.gate.weight"),),
    expert=swiglu(
        "mlp.experts.local_experts.{e}",
        "block_sparse_moe.experts.{e}",
        gate="w1",
        up="w3",
        down="w2",
    ),
    expert_fused=FUSED,
    memory_renames=((".block_sparse_moe.", ".mlp."),),
    hf=HfConfig(
        config_class="MixtralConfig",
        architecture="MixtralForCausalLM",
        fields=(
            *COMMON_FIELDS,
            *_GQA_FIELDS,
            ("num_experts", "num_local_experts"),
            ("moe_ffn_hidden_size", "intermediate_size"),
            ("moe_router_topk", "num_experts_per_tok"),
            ("moe_aux_loss_coeff", "router_aux_loss_coef"),
        ),
        fixed={"sliding_window": None, "router_jitter_noise": 0.0},
        fixed_model={
            **_SOFTMAX,
            "qk_layernorm": False,
            "add_qkv_bias": False,
            "norm_topk_prob": True,
            "ffn_hidden_size": 0,
        },
        from_hf=_mixtral_from_hf,
    ),
)

# Llama (SmolLM2 and the Llama 2/3 checkpoints without context-extension scaling): dense SwiGLU,
# grouped-query attention without QK-norm or biases, head_dim from the config (transformers 5.19
# derives a missing one as hidden_size / num_attention_heads). transformers 5 no longer reads
# `pretraining_tp` (4.x only split the same matmuls into slices), so any value is accepted; the
# llama3 / linear / dynamic RoPE scalings are refused by the RoPE reader, naming `rope_type`.
LLAMA = Family(
    model_type="llama",
    attention=GQA_ATTENTION,
    dense_mlp=DENSE_MLP,
    hf=HfConfig(
        config_class="LlamaConfig",
        architecture="LlamaForCausalLM",
        fields=(*COMMON_FIELDS, *_GQA_FIELDS, ("ffn_hidden_size", "intermediate_size")),
        fixed={"attention_bias": False, "mlp_bias": False, "hidden_act": "silu"},
        fixed_model={"qk_layernorm": False, "add_qkv_bias": False},
    ),
)

REGISTRY: dict[str, Family] = {
    f.model_type: f for f in (QWEN3_MOE, QWEN3, DEEPSEEK_V3, GLM4_MOE, QWEN2_MOE, MIXTRAL, LLAMA)
}
"""Every family Ember builds, by transformers ``model_type``, in ``model.FAMILIES``' order."""
