"""Model provider: a megatron-core GPTModel of one of the supported families, actor or critic.

The families (``FAMILIES``; their HF <-> Megatron descriptions live in ``families.py``):
Qwen3-MoE and Qwen3 dense, DeepSeek-V3 (multi-latent attention, sigmoid router with a per-expert
bias, group-limited top-k, shared experts, first layers dense), GLM-4.5 MoE (sigmoid router with
bias, shared experts, partial rotary, attention biases), Qwen2-MoE (a shared expert behind a
sigmoid gate, attention biases), Mixtral (softmax top-2) and Llama dense (grouped-query attention
without QK-norm or biases, tied embeddings as SmolLM2 has them).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ember_megatron_backend.families import REGISTRY
from ember_megatron_backend.parallel import uses_gpu

__all__ = [
    "FAMILIES",
    "PRESETS",
    "ModelConfig",
    "ValueOutputLayer",
    "build_model",
    "layer_spec",
    "packed_causal_mask",
    "transformer_config",
    "uses_te_spec",
]


def _check_int(key: str, value: Any, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"model.{key} must be an int >= {minimum}, got {value!r}")


FAMILIES = tuple(REGISTRY)
"""Model families Ember builds, by transformers ``model_type`` (the descriptions' order)."""


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Shape of a decoder of one of the supported families (see `family`)."""

    family: str = ""
    """The family, as transformers names it (model_type): qwen3_moe, qwen3, deepseek_v3,
    glm4_moe, qwen2_moe, mixtral or llama; empty means qwen3_moe when num_experts > 0, else
    qwen3."""
    num_layers: int
    """Number of decoder layers."""
    hidden_size: int
    """Width of the residual stream."""
    num_attention_heads: int
    """Query heads."""
    num_query_groups: int
    """Key/value heads (GQA groups); divides num_attention_heads. Multi-latent attention has one
    key/value head per query head and ignores it."""
    head_dim: int
    """Width of one attention head (megatron-core's kv_channels); Qwen3 does not tie it to
    hidden_size / num_attention_heads. Under multi-latent attention: the query/key width without
    the rotary part (HF qk_nope_head_dim)."""
    vocab_size: int
    """Vocabulary size, unpadded: logits have exactly this many columns."""
    ffn_hidden_size: int = 0
    """Intermediate width of the dense SwiGLU MLP (dense models and dense layers; HF
    intermediate_size)."""
    num_experts: int = 0
    """Routed experts per MoE layer; 0 builds a dense model."""
    moe_ffn_hidden_size: int = 0
    """Intermediate width of one SwiGLU expert (HF moe_intermediate_size)."""
    moe_router_topk: int = 2
    """Experts each token is routed to."""
    norm_topk_prob: bool = True
    """Renormalise the top-k router probabilities to sum to 1 (Qwen3-MoE checkpoints do)."""
    moe_aux_loss_coeff: float = 0.0
    """Load-balancing auxiliary loss coefficient; 0 disables the loss."""
    moe_router_dtype: str | None = "fp32"
    """Dtype of the router logits and softmax: "fp32", "fp64" or None (the activation dtype)."""
    moe_router_score_function: str = "softmax"
    """Router scores: "softmax" (Qwen, Mixtral) or "sigmoid" (DeepSeek-V3, GLM-4.5)."""
    moe_router_expert_bias: bool = False
    """A per-expert bias added to the sigmoid scores for the choice only (DeepSeek-V3's
    e_score_correction_bias); kept as the checkpoint has it (no load-balancing updates)."""
    moe_router_num_groups: int = 0
    """Expert groups of group-limited routing (HF n_group); 0 routes over all experts."""
    moe_router_group_topk: int = 0
    """Groups each token may use under group-limited routing (HF topk_group)."""
    moe_router_topk_scaling_factor: float = 1.0
    """Factor on the routing weights (HF routed_scaling_factor)."""
    moe_shared_expert_intermediate_size: int = 0
    """Width of the shared expert(s) every token also goes through; 0 for none."""
    moe_shared_expert_gate: bool = False
    """Scale the shared expert's output by a learned sigmoid gate (Qwen2-MoE)."""
    dense_layers: tuple[int, ...] = ()
    """Layers (0-based) with a dense MLP instead of experts (DeepSeek-V3's first layers)."""
    qk_layernorm: bool = True
    """RMSNorm on each query and key head (Qwen3; GLM-4.5 use_qk_norm)."""
    add_qkv_bias: bool = False
    """Biases on the query, key and value projections (Qwen2, GLM-4.5)."""
    rotary_percent: float = 1.0
    """Fraction of each head that RoPE rotates (GLM-4.5's partial_rotary_factor)."""
    q_lora_rank: int = 0
    """Multi-latent attention: rank of the query compression; 0 projects queries directly."""
    kv_lora_rank: int = 0
    """Multi-latent attention: rank of the key/value compression; > 0 selects MLA."""
    qk_pos_emb_head_dim: int = 0
    """Multi-latent attention: width of the rotary part of queries and keys (qk_rope_head_dim)."""
    v_head_dim: int = 0
    """Multi-latent attention: width of one value head."""
    rope_theta: float = 1_000_000.0
    """RoPE base."""
    rope_type: str = "default"
    """RoPE variant: "default", or "yarn" (multi-latent attention only, as DeepSeek-V3/R1 and
    Kimi-K2 ship it); the rope_yarn_* fields apply to YaRN."""
    rope_yarn_factor: float = 1.0
    """YaRN: context extension factor (HF rope_parameters.factor)."""
    rope_yarn_original_max_position_embeddings: int = 4096
    """YaRN: context length of pre-training."""
    rope_yarn_beta_fast: float = 32.0
    """YaRN: rotations above which frequencies are kept (extrapolated)."""
    rope_yarn_beta_slow: float = 1.0
    """YaRN: rotations below which frequencies are interpolated."""
    rope_yarn_mscale: float = 1.0
    """YaRN: scale of log(factor) in the rotary magnitude (numerator)."""
    rope_yarn_mscale_all_dim: float = 0.0
    """YaRN: scale of log(factor) in the rotary magnitude's denominator and the softmax scale."""
    norm_epsilon: float = 1e-6
    """RMSNorm epsilon (all norms, QK-norm included)."""
    max_position_embeddings: int = 32768
    """Longest sequence the model is configured for."""
    tie_word_embeddings: bool = False
    """Share the input embedding with the output layer."""
    init_method_std: float = 0.02
    """Std of the normal initialisation of freshly built weights."""

    def __post_init__(self) -> None:
        positive = (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "head_dim",
            "vocab_size",
            "max_position_embeddings",
        )
        for key in positive:
            _check_int(key, getattr(self, key), minimum=1)
        for key in ("ffn_hidden_size", "num_experts", "moe_ffn_hidden_size", "moe_router_topk"):
            _check_int(key, getattr(self, key), minimum=0)
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"model.num_query_groups={self.num_query_groups} must divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.num_experts:
            if self.moe_ffn_hidden_size < 1:
                raise ValueError(
                    f"model.moe_ffn_hidden_size={self.moe_ffn_hidden_size} must be >= 1 for an "
                    f"MoE model (num_experts={self.num_experts})"
                )
            if not 1 <= self.moe_router_topk <= self.num_experts:
                raise ValueError(
                    f"model.moe_router_topk={self.moe_router_topk} must lie in "
                    f"[1, num_experts={self.num_experts}]"
                )
        elif self.ffn_hidden_size < 1:
            raise ValueError(
                f"model.ffn_hidden_size={self.ffn_hidden_size} must be >= 1 for a dense model "
                "(num_experts=0)"
            )
        for key in ("rope_theta", "norm_epsilon", "init_method_std"):
            value = getattr(self, key)
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"model.{key} must be a number > 0, got {value!r}")
        if not isinstance(self.moe_aux_loss_coeff, int | float) or self.moe_aux_loss_coeff < 0:
            raise ValueError(
                f"model.moe_aux_loss_coeff must be a number >= 0, got {self.moe_aux_loss_coeff!r}"
            )
        if self.moe_router_dtype not in (None, "fp32", "fp64"):
            raise ValueError(
                f"model.moe_router_dtype must be None, 'fp32' or 'fp64', got "
                f"{self.moe_router_dtype!r}"
            )
        self._check_family()

    def _check_family(self) -> None:
        if not self.family:
            self.family = "qwen3_moe" if self.num_experts else "qwen3"
        if self.family not in FAMILIES:
            raise ValueError(
                f"model.family must be one of {', '.join(FAMILIES)}, got {self.family!r}"
            )
        moe = REGISTRY[self.family].moe
        if moe != bool(self.num_experts):
            kind = "an MoE family (num_experts > 0)" if moe else "a dense family (num_experts=0)"
            others = [name for name, fam in REGISTRY.items() if fam.moe != moe]
            raise ValueError(
                f"model.family={self.family!r} with num_experts={self.num_experts}: "
                f"{self.family} is {kind}; the {'dense' if moe else 'MoE'} families are "
                f"{', '.join(others)}"
            )
        for key in (
            "moe_router_num_groups",
            "moe_router_group_topk",
            "moe_shared_expert_intermediate_size",
            "q_lora_rank",
            "kv_lora_rank",
            "qk_pos_emb_head_dim",
            "v_head_dim",
        ):
            _check_int(key, getattr(self, key), minimum=0)
        if self.moe_router_score_function not in ("softmax", "sigmoid"):
            raise ValueError(
                "model.moe_router_score_function must be 'softmax' or 'sigmoid', got "
                f"{self.moe_router_score_function!r}"
            )
        if self.moe_router_expert_bias and self.moe_router_score_function != "sigmoid":
            raise ValueError(
                "model.moe_router_expert_bias needs moe_router_score_function='sigmoid'"
            )
        if self.moe_router_score_function == "sigmoid" and not self.norm_topk_prob:
            # megatron-core always renormalises sigmoid top-k weights (moe_utils).
            raise ValueError("model.norm_topk_prob=False is not supported with a sigmoid router")
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        if groups or group_topk:
            if not (
                groups and group_topk and self.num_experts % groups == 0 and group_topk <= groups
            ):
                raise ValueError(
                    f"model.moe_router_num_groups={groups} must divide num_experts="
                    f"{self.num_experts}, and moe_router_group_topk={group_topk} lie in [1, groups]"
                )
            if self.moe_router_topk != 2 * group_topk:
                # megatron-core scores a group by its top (topk / group_topk) experts, transformers
                # and SGLang by its top 2: they agree only when topk = 2 * group_topk.
                raise ValueError(
                    f"model.moe_router_topk={self.moe_router_topk} must be 2 x "
                    f"moe_router_group_topk={group_topk} under group-limited routing"
                )
        if not isinstance(self.rotary_percent, int | float) or not 0 < self.rotary_percent <= 1:
            raise ValueError(
                f"model.rotary_percent must lie in (0, 1], got {self.rotary_percent!r}"
            )
        if not isinstance(self.moe_router_topk_scaling_factor, int | float) or not (
            self.moe_router_topk_scaling_factor > 0
        ):
            raise ValueError(
                "model.moe_router_topk_scaling_factor must be a number > 0, got "
                f"{self.moe_router_topk_scaling_factor!r}"
            )
        self.dense_layers = tuple(sorted(set(self.dense_layers)))
        if any(not isinstance(i, int) or not 0 <= i < self.num_layers for i in self.dense_layers):
            raise ValueError(
                f"model.dense_layers must be layer indices in [0, {self.num_layers}), got "
                f"{list(self.dense_layers)}"
            )
        if self.dense_layers and self.ffn_hidden_size < 1:
            raise ValueError("model.ffn_hidden_size must be >= 1 when there are dense_layers")
        if self.multi_latent_attention:
            if self.family != "deepseek_v3":
                raise ValueError(
                    "multi-latent attention (kv_lora_rank > 0) is DeepSeek-V3's, not "
                    f"{self.family}'s"
                )
            if not (self.qk_pos_emb_head_dim and self.v_head_dim):
                raise ValueError(
                    "multi-latent attention needs model.qk_pos_emb_head_dim and v_head_dim >= 1"
                )
        elif self.family == "deepseek_v3":
            raise ValueError(
                "model.family='deepseek_v3' needs kv_lora_rank >= 1 (multi-latent attention)"
            )
        if self.rope_type not in ("default", "yarn"):
            raise ValueError(f"model.rope_type must be 'default' or 'yarn', got {self.rope_type!r}")
        if self.rope_type == "yarn" and not self.multi_latent_attention:
            raise ValueError("model.rope_type='yarn' is supported with multi-latent attention only")
        if self.moe_shared_expert_gate and not self.moe_shared_expert_intermediate_size:
            raise ValueError(
                "model.moe_shared_expert_gate needs moe_shared_expert_intermediate_size >= 1"
            )

    @property
    def is_moe(self) -> bool:
        """Whether the MLPs are routed experts."""
        return self.num_experts > 0

    @property
    def multi_latent_attention(self) -> bool:
        """Whether attention is DeepSeek's multi-latent attention."""
        return self.kv_lora_rank > 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Layers (0-based) whose MLP is routed experts."""
        if not self.is_moe:
            return ()
        return tuple(i for i in range(self.num_layers) if i not in self.dense_layers)

    def check_tensor_parallel(self, size: int, *, key: str = "tensor_model_parallel_size") -> None:
        """Refuse a tensor-parallel size that does not split this model evenly.

        Each TP rank holds whole query heads and whole key/value heads (megatron-core 0.16.1
        attention.py divides both counts by the TP size), and an equal share of the vocabulary
        (Megatron would pad it, and padded logit columns would change every softmax).

        Args:
            size: The tensor-parallel size.
            key: The setting's name in the message.

        Raises:
            ValueError: One line naming the setting and the counts it must divide.
        """
        heads, groups = self.num_attention_heads, self.num_query_groups
        if heads % size or groups % size:
            raise ValueError(
                f"{key}={size} must divide num_attention_heads={heads} and "
                f"num_query_groups={groups} (each tensor-parallel rank holds whole heads)"
            )
        if self.vocab_size % size:
            raise ValueError(f"model.vocab_size={self.vocab_size} must be divisible by TP={size}")

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        """One of the named configurations in ``PRESETS``."""
        try:
            return dataclasses.replace(PRESETS[name])
        except KeyError:
            raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}") from None


_TINY = dict(
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=16,
    vocab_size=256,
    max_position_embeddings=512,
)
"""The tiny shape every preset shares: a CPU forward+backward in well under a second."""
_TINY_EXPERTS = dict(num_experts=8, moe_ffn_hidden_size=32, moe_router_topk=2)
_SIGMOID_ROUTER = dict(moe_router_score_function="sigmoid", moe_router_expert_bias=True)


def _tiny(**fields: Any) -> ModelConfig:
    return ModelConfig(**{**_TINY, **fields})


PRESETS: dict[str, ModelConfig] = {
    "tiny-moe": _tiny(ffn_hidden_size=128, **_TINY_EXPERTS),
    # The other families at tiny-moe's size, each with its own features switched on.
    "tiny-deepseek-v3": _tiny(
        family="deepseek_v3",
        num_query_groups=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_pos_emb_head_dim=8,
        v_head_dim=16,
        ffn_hidden_size=128,
        dense_layers=(0,),
        **_TINY_EXPERTS,
        **_SIGMOID_ROUTER,
        moe_router_num_groups=4,
        moe_router_group_topk=1,
        # Routed scaling stays 1 (the released models' 2.5 is covered by the parity tests): at
        # 2.5 the default task collapsed in one of four seeds, at 1.0 in none.
        moe_shared_expert_intermediate_size=32,
        qk_layernorm=False,
        rope_theta=10_000.0,
    ),
    "tiny-glm4-moe": _tiny(
        family="glm4_moe",
        ffn_hidden_size=128,
        dense_layers=(0,),
        **_TINY_EXPERTS,
        **_SIGMOID_ROUTER,
        moe_shared_expert_intermediate_size=32,
        qk_layernorm=False,
        add_qkv_bias=True,
        rotary_percent=0.5,
        rope_theta=10_000.0,
    ),
    "tiny-qwen2-moe": _tiny(
        family="qwen2_moe",
        ffn_hidden_size=128,
        **_TINY_EXPERTS,
        norm_topk_prob=False,
        moe_shared_expert_intermediate_size=64,
        moe_shared_expert_gate=True,
        qk_layernorm=False,
        add_qkv_bias=True,
    ),
    "tiny-mixtral": _tiny(family="mixtral", **_TINY_EXPERTS, qk_layernorm=False),
    "tiny-dense": _tiny(num_layers=2, ffn_hidden_size=128, tie_word_embeddings=True),
    # SmolLM2's features at this size: three query heads per key/value head, tied embeddings,
    # RoPE theta 1e5, RMSNorm eps 1e-5, no QK-norm (head_dim = hidden_size / heads, as SmolLM2).
    "tiny-llama": _tiny(
        family="llama",
        num_layers=2,
        hidden_size=96,
        num_attention_heads=6,
        num_query_groups=2,
        ffn_hidden_size=128,
        tie_word_embeddings=True,
        qk_layernorm=False,
        rope_theta=100_000.0,
        norm_epsilon=1e-5,
    ),
}


def _have_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def uses_te_spec() -> bool:
    """Whether models are built from Transformer Engine modules (GPU with TE installed)."""
    return uses_gpu() and _have_te()


def transformer_config(cfg: ModelConfig, *, dtype: torch.dtype = torch.float32) -> Any:
    """The megatron-core TransformerConfig for `cfg` under the current parallel state.

    Args:
        cfg: Model shape.
        dtype: Parameter and activation dtype (float32 or bfloat16).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import TransformerConfig

    gpu = uses_gpu()
    tp = ps.get_tensor_model_parallel_world_size()
    cfg.check_tensor_parallel(tp)  # before megatron-core's own checks, in one line
    family: dict[str, Any] = {}
    if cfg.is_moe:
        family.update(
            num_moe_experts=cfg.num_experts,
            moe_ffn_hidden_size=cfg.moe_ffn_hidden_size,
            moe_router_topk=cfg.moe_router_topk,
            moe_router_score_function=cfg.moe_router_score_function,
            # Softmax over the k selected logits equals renormalised top-k softmax probs.
            moe_router_pre_softmax=not cfg.norm_topk_prob,
            moe_router_load_balancing_type="aux_loss" if cfg.moe_aux_loss_coeff else "none",
            moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
            moe_router_dtype=cfg.moe_router_dtype,
            moe_grouped_gemm=uses_te_spec(),
            moe_router_enable_expert_bias=cfg.moe_router_expert_bias,
            # The bias is the checkpoint's, as the rollout engine serves it: no load-balancing
            # updates, so trainer and engine keep routing alike.
            moe_router_bias_update_rate=0.0,
            moe_router_num_groups=cfg.moe_router_num_groups or None,
            moe_router_group_topk=cfg.moe_router_group_topk or None,
            moe_router_topk_scaling_factor=(
                cfg.moe_router_topk_scaling_factor
                if cfg.moe_router_topk_scaling_factor != 1.0
                else None
            ),
            moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size or None,
            moe_shared_expert_gate=cfg.moe_shared_expert_gate,
            moe_layer_freq=[0 if i in cfg.dense_layers else 1 for i in range(cfg.num_layers)],
        )
    config_class = TransformerConfig
    if cfg.multi_latent_attention:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        config_class = MLATransformerConfig
        family.update(
            q_lora_rank=cfg.q_lora_rank or None,
            kv_lora_rank=cfg.kv_lora_rank,
            qk_head_dim=cfg.head_dim,
            qk_pos_emb_head_dim=cfg.qk_pos_emb_head_dim,
            v_head_dim=cfg.v_head_dim,
            rotary_base=cfg.rope_theta,
            # Plain RoPE: softmax scale 1 / sqrt(qk_head_dim + qk_pos_emb_head_dim), as
            # transformers computes it; YaRN scales it by mscale(factor, mscale_all_dim)^2.
            rope_type="yarn" if cfg.rope_type == "yarn" else "rope",
            rotary_scaling_factor=cfg.rope_yarn_factor if cfg.rope_type == "yarn" else 1.0,
            original_max_position_embeddings=cfg.rope_yarn_original_max_position_embeddings,
            beta_fast=cfg.rope_yarn_beta_fast,
            beta_slow=cfg.rope_yarn_beta_slow,
            mscale=cfg.rope_yarn_mscale,
            mscale_all_dim=cfg.rope_yarn_mscale_all_dim if cfg.rope_type == "yarn" else 0.0,
        )
    return config_class(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size or cfg.moe_ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_epsilon,
        # MLA's query and key/value compressions are normalised through the same switch.
        qk_layernorm=cfg.qk_layernorm or cfg.multi_latent_attention,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=cfg.add_qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=cfg.init_method_std,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        context_parallel_size=ps.get_context_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
        # Local-spec norms (torch RMSNorm) refuse sequence parallelism; TE's support it. Without
        # it megatron-core's MoE layer refuses to *train* under TP > 1 (eval forward works).
        sequence_parallel=tp > 1 and uses_te_spec(),
        # Pipeline p2p shapes per micro-batch. TransformerConfig rejects it whenever the token
        # dispatcher is allgather (its default, even for dense models), so on CPU it is off
        # here and the pipeline schedule turns it on when it runs (pipeline.py explains why
        # that is sound: only the p2p layer reads it).
        variable_seq_lengths=gpu,
        use_cpu_initialization=not gpu,
        # megatron-core 0.16.1 fusions/fused_softmax.py: with the fusion on, bf16/fp16 scores with
        # 16 < sk <= 4096 take the fused path, which imports the compiled scaled_masked_softmax_cuda
        # (no locked package ships it), and for our causal mask type runs the upper-triangular
        # kernel, which ignores the mask passed in. TE attention never reads the flag.
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        # The alltoall dispatcher creates a CUDA stream in its constructor.
        moe_token_dispatcher_type="alltoall" if gpu else "allgather",
        **family,
    )


def layer_spec(config: Any) -> Any:
    """Decoder block spec of this pipeline stage (dense and MoE layers as `config` places
    them): Transformer Engine modules on GPUs where TE is installed, else local modules with
    torch's SDPA attention and grouped expert matmuls."""
    from megatron.core.models.gpt import gpt_layer_specs

    te = uses_te_spec()
    block = gpt_layer_specs.get_gpt_decoder_block_spec(
        config, use_transformer_engine=te, normalization="RMSNorm"
    )
    if te:
        return block
    for spec in {id(s): s for s in block.layer_specs}.values():
        spec.submodules.self_attention.submodules.core_attention = _sdpa_attention()
        experts = getattr(spec.submodules.mlp.submodules, "experts", None)
        if experts is not None:
            experts.module = _grouped_local_experts()
    return block


def _grouped_local_experts() -> type:
    """megatron-core's ``SequentialMLP`` (one MLP module per local expert, the same parameters
    and names) computing all experts at once with torch's ``grouped_mm``.

    The sequential module runs each expert's two linear layers, activation and probability
    scaling as separate modules, so a layer of E experts costs about 10 E small ops forward and
    more backward; here the experts' weights are stacked (gradients flow back to each expert's
    own parameter) and two grouped matmuls cover every expert. Configurations it does not cover
    (expert tensor parallelism, biases, clamped or non-gated activations, fp8) run megatron-
    core's own loop, and so do widths whose rows are not a multiple of 16 bytes, which the
    kernel refuses.
    """
    global _GROUPED_EXPERTS
    if _GROUPED_EXPERTS is not None:
        return _GROUPED_EXPERTS
    from megatron.core.transformer.moe.experts import SequentialMLP

    class GroupedLocalExperts(SequentialMLP):
        def _grouped(self, x: Tensor) -> bool:
            c = self.config
            # torch's CPU kernel wants 16-byte aligned rows and data.
            aligned = all(
                n * x.element_size() % 16 == 0 for n in (c.hidden_size, c.moe_ffn_hidden_size)
            )
            return (
                x.device.type == "cpu"  # GPUs without TE keep megatron-core's loop
                and aligned
                and x.data_ptr() % 16 == 0
                and self.tp_group.size() == 1
                and not c.add_bias_linear
                and c.gated_linear_unit
                and c.activation_func is F.silu
                and getattr(c, "activation_func_clamp_value", None) is None
                and not getattr(c, "glu_linear_offset", 0.0)
                and not (c.fp8 or c.fp4)
                and not c.use_te_activation_func
                and not c.moe_apply_probs_on_input
            )

        def forward(
            self,
            permuted_local_hidden_states: Tensor,
            tokens_per_expert: Tensor,
            permuted_probs: Tensor,
        ) -> tuple[Tensor, None]:
            if not self._grouped(permuted_local_hidden_states):
                return super().forward(
                    permuted_local_hidden_states, tokens_per_expert, permuted_probs
                )
            x = permuted_local_hidden_states
            offsets = torch.as_tensor(tokens_per_expert).to(x.device).cumsum(0).to(torch.int32)
            dtype = x.dtype
            x, fc1 = self.grouped_operands("linear_fc1", x)  # fc1 [E, 2F, H]
            gate, linear = F.grouped_mm(x, fc1.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
            hidden = (F.silu(gate) * linear * permuted_probs.unsqueeze(-1)).to(dtype)
            hidden, fc2 = self.grouped_operands("linear_fc2", hidden)  # fc2 [E, H, F]
            return F.grouped_mm(hidden, fc2.transpose(1, 2), offs=offsets), None

        def grouped_operands(self, linear: str, x: Tensor) -> tuple[Tensor, Tensor]:
            """The input [T, K] of the local experts' `linear` layers ("linear_fc1" or
            "linear_fc2") and their weights stacked [E, N, K], as the grouped product takes
            them: `x` and the parameters (`qat` gives the fake-quantized ones)."""
            return x, torch.stack([getattr(e, linear).weight for e in self.local_experts])

    _GROUPED_EXPERTS = GroupedLocalExperts
    return GroupedLocalExperts


_GROUPED_EXPERTS: type | None = None


def _sdpa_attention() -> type:
    """megatron-core's local ``DotProductAttention`` with its core computed by torch's
    ``scaled_dot_product_attention``; it also serves multi-latent attention, whose query/key
    and value heads differ in width.

    The local module forms the scores with ``baddbmm``, masks them in place and runs torch's
    softmax over rows of S keys, which for the short rows of RL samples costs more than the
    matmuls; SDPA's fused CPU kernel computes the same attention (same scale, same mask, keys
    and values shared across a query group) in one call, forward and backward. The class is
    built on first use so importing this module does not import megatron-core.
    """
    global _SDPA_ATTENTION
    if _SDPA_ATTENTION is not None:
        return _SDPA_ATTENTION
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SDPAttention(DotProductAttention):
        exact = False
        """Compute with `ember_core.exact.attention` (set by `exact_megatron`)."""

        def __init__(
            self,
            *args: Any,
            k_channels: int | None = None,
            v_channels: int | None = None,
            **kw: Any,
        ) -> None:
            # Multi-latent attention names its query/key and value widths (TE's attention takes
            # them; the local module does not). The core below reads widths from the tensors,
            # and MLA passes its own softmax scale.
            super().__init__(*args, **kw)

        def forward(
            self,
            query: Tensor,
            key: Tensor,
            value: Tensor,
            attention_mask: Tensor | None,
            attn_mask_type: Any = None,
            attention_bias: Tensor | None = None,
            packed_seq_params: Any = None,
        ) -> Tensor:
            if packed_seq_params is not None or attention_bias is not None:
                raise ValueError(
                    "local attention takes neither packed_seq_params nor an attention bias"
                )
            if self.softmax_offset is not None:
                raise ValueError("local SDPA attention supports softmax_type='vanilla' only")
            scale = self.softmax_scale
            if self.config.apply_query_key_layer_scaling:
                scale *= self.layer_number  # the local softmax multiplies the divisor back
            # [s, b, heads, d] -> [b, heads, s, d]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            if self.exact:  # `rollout.true_on_policy` (`true_on_policy.exact_megatron`)
                return self._exact(q, k, v, attention_mask, scale)
            context = F.scaled_dot_product_attention(
                q,
                k,
                v,
                # megatron-core's masks are True where masked, SDPA's where attended.
                attn_mask=None if attention_mask is None else ~attention_mask,
                is_causal=attention_mask is None and self.attn_mask_type.name == "causal",
                dropout_p=self.attention_dropout.p if self.training else 0.0,
                scale=scale,
                enable_gqa=q.shape[1] != k.shape[1],
            )
            # [b, heads, s, d] -> [s, b, heads * d]
            return context.permute(2, 0, 1, 3).reshape(q.shape[2], q.shape[0], -1)

        def _exact(
            self, q: Tensor, k: Tensor, v: Tensor, attention_mask: Tensor | None, scale: float
        ) -> Tensor:
            from ember_core import exact

            width = q.shape[2]
            causal = torch.ones(width, width, dtype=torch.bool, device=q.device).triu(1)
            masks = None if attention_mask is None else attention_mask.reshape(-1, width, width)
            if masks is not None and not torch.equal(masks, causal.expand_as(masks)):
                raise ValueError(
                    "rollout.true_on_policy: attention takes right-padded samples under one "
                    "causal mask"
                )
            starts = torch.zeros(q.shape[0], dtype=torch.long, device=q.device)
            context = exact.attention(q, k, v, key_starts=starts, scale=scale)
            return context.permute(2, 0, 1, 3).reshape(width, q.shape[0], -1)

    _SDPA_ATTENTION = SDPAttention
    return SDPAttention


_SDPA_ATTENTION: type | None = None


class ValueOutputLayer(torch.nn.Module):
    """Critic output layer: hidden [S, B, H] -> value [S, B, 1], replicated across TP ranks.

    It stands in for GPTModel's ``output_layer`` and keeps its call signature.
    """

    def __init__(self, hidden_size: int, *, sequence_parallel: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        # Zero init: a fresh critic predicts 0 everywhere, which GAE treats as "no baseline yet".
        # Every TP rank sees the whole (gathered) sequence, so its gradient is already complete.
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))

    def forward(
        self, input_: Tensor, weight: Tensor | None = None, runtime_gather_output: Any = None
    ) -> tuple[Tensor, None]:
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            input_ = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=False)
        return F.linear(input_, self.weight), None


def build_model(
    cfg: ModelConfig,
    *,
    critic: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int | None = None,
    adjust_config: Callable[[Any], None] | None = None,
) -> Any:
    """Build this rank's GPTModel chunk (its pipeline stage) on this rank's device.

    Args:
        cfg: Model shape.
        critic: Replace the vocabulary output layer with a value output layer of size 1.
        dtype: Parameter dtype.
        seed: Seed of every initial weight: the CPU generator (CPU initialisation, MoE routers)
            and, for the build only, megatron-core's model-parallel RNG tracker (GPU
            initialisation), with its per-TP/EP-rank offsets; the tracker's streams seeded from
            ``ParallelConfig.seed`` come back afterwards. None leaves all generators as they are.
        adjust_config: Called with the ``TransformerConfig`` before the model is built, to
            change it in place (the plugins' ``model_config`` hook goes through here).

    Returns:
        A megatron-core ``GPTModel``; its forward returns logits [B, S, V] (values [B, S, 1] for
        a critic) on the last pipeline stage.
    """
    from ember_megatron_backend.parallel import device

    config = transformer_config(cfg, dtype=dtype)
    if adjust_config is not None:
        adjust_config(config)
    init_rng = _init_rng(seed) if seed is not None else contextlib.nullcontext()
    if uses_gpu():
        on_device = contextlib.nullcontext()
    else:
        from ember_megatron_backend.cpu import cuda_device_is_cpu

        on_device = cuda_device_is_cpu()  # routers' expert-bias buffers
    with init_rng, on_device:
        model = _gpt_model(config, cfg, critic=critic)
    if critic and model.post_process:
        model.output_layer = ValueOutputLayer(
            cfg.hidden_size, sequence_parallel=config.sequence_parallel, dtype=dtype
        )
    return model.to(device())


@contextlib.contextmanager
def _init_rng(seed: int) -> Iterator[None]:
    """Seed every generator weight initialisation draws from with `seed`, for one build.

    megatron-core 0.16.1 tensor_parallel/layers.py ``_initialize_affine_weight_gpu``: with
    ``use_cpu_initialization=False`` (GPUs) linear, embedding and expert weights are drawn inside
    ``get_cuda_rng_tracker().fork()`` (the model-parallel or expert-parallel stream), which
    ``model_parallel_cuda_manual_seed`` seeded from ``ParallelConfig.seed``; only the MoE router
    (transformer/moe/router.py, CPU ``torch.empty``) and CPU initialisation draw from the CPU
    generator. So the tracker is reseeded from `seed` by that same function (same per-TP/EP-rank
    offsets), and its streams, and the GPU's default generator, are restored afterwards so that
    ``ParallelConfig.seed`` keeps driving the runtime streams (dropout).
    """
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    saved = tracker.get_states()
    cuda_state = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    try:
        yield
    finally:
        tracker.set_states(saved)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state)


def _gpt_model(config: Any, cfg: ModelConfig, *, critic: bool) -> Any:
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(config),
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=cfg.tie_word_embeddings and not critic,
        position_embedding_type="rope",
        rotary_base=cfg.rope_theta,
        rotary_percent=cfg.rotary_percent,
    )


def packed_causal_mask(cu_seqlens: Tensor, length: int | None = None) -> Tensor:
    """Block-diagonal causal attention mask for a packed "thd" stream, True where masked.

    megatron-core's local ``DotProductAttention`` refuses ``PackedSeqParams``, so on CPU the
    samples of a packed stream are kept apart by this [1, 1, T, T] mask instead (memory T^2
    bytes: fine for development shapes, not for long GPU batches, which use TE attention).

    Args:
        cu_seqlens: [N + 1] offsets of the packed sequences (a padding segment included).
        length: Stream length T; defaults to ``cu_seqlens[-1]``.
    """
    bounds = cu_seqlens.to(torch.long).cpu()
    total = int(bounds[-1]) if length is None else length
    if total < int(bounds[-1]):
        raise ValueError(f"stream length {total} is shorter than cu_seqlens[-1]={int(bounds[-1])}")
    seq_id = torch.bucketize(torch.arange(total), bounds[1:], right=True)  # [T]
    same = seq_id[:, None] == seq_id[None, :]
    causal = torch.ones(total, total, dtype=torch.bool).tril()
    return ~(same & causal)[None, None]
