"""Config sections of the rollout package: engine, prompt data, rewards and group sampling."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from ember_core.config import check, from_dict

if TYPE_CHECKING:
    from ember_core.quant import QuantSpec

__all__ = [
    "DataConfig",
    "EngineConfig",
    "GroupSamplingConfig",
    "HFEngineConfig",
    "RewardConfig",
    "RolloutSections",
    "SGLangEngineConfig",
    "TinyModelConfig",
    "ToyTaskConfig",
    "from_dict",
]


# --------------------------------------------------------------------------------------------
# Engines
# --------------------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class TinyModelConfig:
    """Shape of the Qwen3-MoE model built in code when the hf engine has no model path."""

    vocab_size: int | None = None
    """Vocabulary size; None uses the toy tokenizer's."""
    hidden_size: int = 64
    """Model width."""
    num_layers: int = 4
    """Decoder layers."""
    num_attention_heads: int = 4
    """Query heads."""
    num_key_value_heads: int = 2
    """Key/value heads (grouped-query attention)."""
    head_dim: int = 16
    """Width of one attention head."""
    num_experts: int = 8
    """Routed experts per MoE layer."""
    num_experts_per_tok: int = 2
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int = 64
    """Hidden width of one expert."""
    intermediate_size: int = 128
    """Hidden width of the MLP of dense (non-MoE) layers."""
    dense_layers: list[int] = field(default_factory=list)
    """Layer indices that use a dense MLP instead of experts (their routed experts are zeros)."""
    max_position_embeddings: int = 512
    """Context length."""
    rope_theta: float = 10000.0
    """RoPE base."""
    tie_word_embeddings: bool = False
    """Share the input embedding with the output layer."""
    init_seed: int = 0
    """Seed of the random initialisation, so every process builds the same weights."""

    def __post_init__(self) -> None:
        check(
            self.vocab_size is None or self.vocab_size >= 2, "vocab_size", self.vocab_size, ">= 2"
        )
        for key in (
            "hidden_size",
            "num_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "num_experts",
            "moe_intermediate_size",
            "intermediate_size",
            "max_position_embeddings",
        ):
            value = getattr(self, key)
            check(value >= 1, key, value, ">= 1")
        check(
            self.num_attention_heads % self.num_key_value_heads == 0,
            "num_attention_heads",
            self.num_attention_heads,
            f"a multiple of num_key_value_heads={self.num_key_value_heads}",
        )
        check(
            1 <= self.num_experts_per_tok <= self.num_experts,
            "num_experts_per_tok",
            self.num_experts_per_tok,
            f"1 <= k <= num_experts={self.num_experts}",
        )
        check(
            all(0 <= i < self.num_layers for i in self.dense_layers),
            "dense_layers",
            self.dense_layers,
            f"layer indices in [0, {self.num_layers})",
        )
        check(self.rope_theta > 0, "rope_theta", self.rope_theta, "> 0")


@dataclass(kw_only=True, slots=True)
class HFEngineConfig:
    """The embedded engine: a transformers causal LM generating in-process."""

    model_path: str | None = None
    """Local HF model directory; None builds the tiny Qwen3-MoE of `tiny` in code."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Dtype the model computes in; log-probs are always taken from fp32 logits."""
    device: str = "cpu"
    """torch device: cpu, cuda, cuda:N, or auto (cuda when available)."""
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    """transformers attention kernel; under `rollout.true_on_policy`, the mode's own
    (`ember_core.exact.attention`) instead."""
    max_batch_size: int = 64
    """Most sequences decoded together; larger request lists are split into chunks."""
    num_threads: int | None = None
    """torch intra-op threads of this process, set when the model loads; None keeps the default."""
    compact_every: int = 8
    """Every this many decode steps, drop finished rows from the batch and KV cache; 0: never."""
    pack_linears: bool = True
    """fp32 on CPU: multiply with linear weights packed once for oneDNN (packed again after each
    weight load) instead of repacked by every call, for weights of 2^17 elements or more (about
    384 x 384; smaller ones gain nothing); one more copy of those weights in memory. Other
    dtypes, devices and smaller layers run as is (`ember_rollout.packed_linear`). Not read under
    `rollout.true_on_policy`, whose kernels pack fp32 CPU weights of 256 inputs or more
    themselves (`ember_core.exact.linear`)."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    """Shape of the built-in model (used when model_path is None)."""

    def __post_init__(self) -> None:
        check(self.max_batch_size >= 1, "max_batch_size", self.max_batch_size, ">= 1")
        check(
            self.num_threads is None or self.num_threads >= 1,
            "num_threads",
            self.num_threads,
            ">= 1 or null",
        )
        check(self.compact_every >= 0, "compact_every", self.compact_every, ">= 0 (0 = never)")
        check(
            self.device == "auto" or self.device.split(":")[0] in ("cpu", "cuda", "mps"),
            "device",
            self.device,
            "cpu, cuda, cuda:N, mps or auto",
        )


DP_SIZE_FLAGS = ("--dp-size", "--data-parallel-size")
"""SGLang's data-parallel replica flag and its alias (sglang 0.5.23
arg_groups/fields/parallel.py)."""


def gpu_placement_flags(args: list[str], num_servers: int) -> list[str]:
    """The GPU-placement flags in launched servers' arguments that Ember sets itself, explained.

    sglang 0.5.23 (entrypoints/engine.py) puts TP rank r of a server on GPU
    `--base-gpu-id + r * --gpu-id-step` (defaults 0 and 1); Ember gives every launched server its
    own `--base-gpu-id`, so a second one would fight it. `--dp-size` above 1 is refused too: a
    server of several data-parallel replicas takes no weight update.
    """
    found = []
    for i, arg in enumerate(args):
        flag, _, value = arg.partition("=")
        if flag == "--base-gpu-id":
            found.append("--base-gpu-id (set sglang.base_gpu_id)")
        elif flag == "--gpu-id-step" and num_servers > 1:
            found.append("--gpu-id-step with num_servers > 1 (each server takes tp_size GPUs)")
        elif flag in DP_SIZE_FLAGS:
            value = value if "=" in arg else (args[i + 1] if i + 1 < len(args) else "")
            if value.strip() != "1":
                # sglang 0.5.23 managers/tokenizer_control_mixin.py 451, 509, 569, 607: the
                # weight-group, distributed and tensor updates assert dp_size == 1.
                found.append(
                    f"{flag} {value} (weight updates need one replica per server; set "
                    "sglang.num_servers or ray.num_engines instead)"
                )
    return found


@dataclass(kw_only=True, slots=True)
class SGLangEngineConfig:
    """SGLang servers, launched here or attached to by URL."""

    urls: list[str] = field(default_factory=list)
    """Attach to these running servers (http://host:port); empty launches `num_servers` servers."""
    model_path: str | None = None
    """Model the launched servers load; also read (config.json) for the routed-experts shape.
    Under `ember train` the trainer's initial export (`<run dir>/hf_init`) replaces it, so the
    servers start from the weights the trainer loaded (where `train.hf_load`, or on resume
    `hf_init`, is a checkpoint the export would match, they launch from it while the trainer
    starts and load the export before rollout 0: docs/architecture.md)."""
    num_servers: int = 1
    """Servers to launch (ignored when attaching)."""
    host: str = "127.0.0.1"
    """Address launched servers bind to; loopback unless the trainer runs on another machine."""
    base_port: int = 0
    """First port of launched servers (consecutive); 0 picks free ports."""
    tp_size: int = 1
    """Tensor-parallel size of each server (of attached ones too: tensor updates need it)."""
    base_gpu_id: int = 0
    """First GPU of launched servers: server i gets `--base-gpu-id base_gpu_id + i * tp_size`
    (servers on GPUs; a CPU server has none to place)."""
    mem_fraction_static: float | None = None
    """SGLang's --mem-fraction-static (the share of GPU memory, or on CPU of the machine's, for
    weights and KV cache); None: SGLang's default."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """Where launched servers run: cuda, or cpu (the real SGLang server on a machine without a
    GPU: sglang's CPU engine with Ember's stand-ins for its CUDA-only kernels, see
    `ember_rollout.sglang_cpu`); auto picks cuda when this process sees a GPU. For attached
    servers (`urls`) it says where they run (auto: on GPUs). The trainer's weight group with
    the servers is NCCL only when both are on GPUs, gloo otherwise."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Launched servers' --dtype. auto is SGLang's own rule, which serves a float32 checkpoint
    in float16; float32 keeps an fp32 trainer's policy exactly."""
    server_args: list[str] = field(default_factory=list)
    """Extra command-line arguments for launched servers (plugins can add more); not the GPU ids,
    nor `--dp-size` above 1 (SGLang takes weight updates only with one replica per server)."""
    python: str | None = None
    """Python interpreter that runs `-m sglang.launch_server`; None uses this one."""
    launch_timeout_s: float = 900.0
    """Seconds to wait for servers to report healthy."""
    health_poll_s: float = 2.0
    """Seconds between health polls while waiting."""
    request_timeout_s: float = 600.0
    """Seconds one HTTP request may take once sent (time queued behind max_concurrency is free)."""
    max_retries: int = 3
    """Retries of a request after a connection error or an HTTP 5xx answer."""
    retry_backoff_s: float = 0.5
    """First retry delay; doubles with every retry."""
    retry_backoff_max_s: float = 8.0
    """Longest retry delay."""
    max_concurrency: int = 256
    """Requests in flight per server."""
    log_dir: str | None = None
    """Directory of launched servers' logs (one file per server); None: `<run dir>/sglang` under
    `ember train`, else a new temporary directory. A server that fails to start is reported
    with its log's last error line and the file's path."""

    def __post_init__(self) -> None:
        for url in self.urls:
            check(url.startswith(("http://", "https://")), "urls", url, "http://host:port URLs")
        check(self.num_servers >= 1, "num_servers", self.num_servers, ">= 1")
        check(0 <= self.base_port < 65536, "base_port", self.base_port, "0 (free) or a port")
        check(self.tp_size >= 1, "tp_size", self.tp_size, ">= 1")
        check(self.base_gpu_id >= 0, "base_gpu_id", self.base_gpu_id, ">= 0")
        misplaced = gpu_placement_flags(self.server_args, self.num_servers)
        check(not misplaced, "server_args", self.server_args, "no " + "; no ".join(misplaced))
        check(
            self.mem_fraction_static is None or 0 < self.mem_fraction_static < 1,
            "mem_fraction_static",
            self.mem_fraction_static,
            "0 < x < 1 or null",
        )
        for key in ("launch_timeout_s", "health_poll_s", "request_timeout_s"):
            value = getattr(self, key)
            check(math.isfinite(value) and value > 0, key, value, "a number > 0")
        check(self.max_retries >= 0, "max_retries", self.max_retries, ">= 0")
        check(self.retry_backoff_s >= 0, "retry_backoff_s", self.retry_backoff_s, ">= 0")
        check(
            self.retry_backoff_max_s >= self.retry_backoff_s,
            "retry_backoff_max_s",
            self.retry_backoff_max_s,
            f">= retry_backoff_s={self.retry_backoff_s}",
        )
        check(self.max_concurrency >= 1, "max_concurrency", self.max_concurrency, ">= 1")


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """Which inference engine generates rollouts, and its settings."""

    kind: str = "hf"
    """Registered engine kind: hf (embedded transformers) or sglang."""
    hf: HFEngineConfig = field(default_factory=HFEngineConfig)
    """Settings of the hf engine."""
    sglang: SGLangEngineConfig = field(default_factory=SGLangEngineConfig)
    """Settings of the sglang engine."""
    quantization: str | None = None
    """Serve quantized rollout weights, quantized from the trainer's at every push
    (`ember_core.quant`, docs/low-precision.md): fp8_block (FP8 e4m3 weights in square blocks
    of `quantization_group_size`, one scale per block, activations quantized per token in
    groups of that size: SGLang's W8A8 block FP8), int4_w4a16 (symmetric INT4 weights, one
    scale per `quantization_group_size` inputs of a row, compressed-tensors' pack-quantized
    layout), or null (the trainer's weights as they are). The embedded engine emulates both on
    CPU; log-probs are the quantized engine's own (pair with TIS/MIS, or `train.qat`)."""
    quantization_group_size: int = 128
    """FP8 block edge (blocks of N x N) or INT4 group along a row's inputs; it must divide every
    quantized dimension (FP8: rows and inputs, INT4: inputs)."""
    quantization_targets: Literal["linear", "experts"] = "linear"
    """Which weights are quantized: every linear projection of the decoder layers, or only the
    routed experts'; embeddings, the output layer, norms and routers never are."""

    def __post_init__(self) -> None:
        from ember_core.quant import SCHEMES, TARGETS
        from ember_rollout.engine import engine_registry

        engines = engine_registry()
        if self.kind not in engines:
            raise ValueError(f"kind={self.kind!r}: expected one of {', '.join(engines.names())}")
        check(
            self.quantization is None or self.quantization in SCHEMES,
            "quantization",
            self.quantization,
            f"one of {', '.join(SCHEMES)}, or null",
        )
        check(
            self.quantization_targets in TARGETS,
            "quantization_targets",
            self.quantization_targets,
            f"one of {', '.join(TARGETS)}",
        )
        check(
            isinstance(self.quantization_group_size, int)
            and self.quantization_group_size >= 8
            and self.quantization_group_size % 8 == 0,
            "quantization_group_size",
            self.quantization_group_size,
            "a positive multiple of 8 (INT4 packs eight values to an int32)",
        )

    def quant_spec(self) -> QuantSpec | None:
        """The scheme the engine serves, or None for full precision."""
        from ember_core.quant import QuantSpec

        if self.quantization is None:
            return None
        return QuantSpec(self.quantization, self.quantization_group_size, self.quantization_targets)


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class ToyTaskConfig:
    """The toy task: transform a short digit string; reward = fraction of correct digits."""

    task: Literal["copy", "reverse", "sort", "shift"] = "copy"
    """copy, reverse or sort the digits ("sort 314 =" -> "134"), or shift each by the digit
    after the colon, mod 10 ("314 : 2 =" -> "536")."""
    num_prompts: int = 4096
    """Distinct prompts generated."""
    min_digits: int = 2
    """Shortest digit string."""
    max_digits: int = 4
    """Longest digit string."""
    seed: int = 0
    """Seed of the generated prompts."""

    def __post_init__(self) -> None:
        check(self.num_prompts >= 1, "num_prompts", self.num_prompts, ">= 1")
        check(self.min_digits >= 1, "min_digits", self.min_digits, ">= 1")
        check(
            self.max_digits >= self.min_digits,
            "max_digits",
            self.max_digits,
            f">= min_digits={self.min_digits}",
        )


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Where prompts come from and how they become token ids."""

    prompt_data: str | None = None
    """The prompts, by the path's kind: a JSONL file (one prompt per line), a `.parquet` file,
    a directory of `.parquet` shards (`train-00000-of-00002.parquet` ...) or a glob of files
    (`data/train-*.parquet`), each read in the order of the file names, or a directory written
    by HF datasets' `save_to_disk` (one row per prompt; all but JSONL need the rollout
    package's `data` extra, which the dev group installs). None generates the toy task."""
    input_key: str = "prompt"
    """Key of the prompt: a string, or a list of chat messages ({role, content})."""
    label_key: str | None = "label"
    """Key of the ground truth handed to the reward function; None: no label."""
    metadata_key: str | None = None
    """Key of a per-prompt dict copied into Sample.metadata; None: none."""
    tokenizer_path: str | None = None
    """HF tokenizer directory; None: train.hf_load's tokenizer when that directory has one,
    else the toy tokenizer (either is saved next to the initial export the engines load)."""
    apply_chat_template: bool = True
    """Format prompts with the tokenizer's chat template when it has one."""
    max_prompt_len: int | None = None
    """Most prompt tokens; None: the engine's context length minus rollout.max_response_len."""
    overlong_prompt: Literal["error", "truncate", "drop"] = "error"
    """A prompt over max_prompt_len: raise, keep its last max_prompt_len tokens, or skip it."""
    shuffle: bool = True
    """Shuffle the prompt order every epoch."""
    seed: int = 0
    """Seed of the shuffle."""
    toy: ToyTaskConfig = field(default_factory=ToyTaskConfig)
    """The generated task (used when prompt_data is None)."""

    def __post_init__(self) -> None:
        check(bool(self.input_key), "input_key", self.input_key, "a non-empty key")
        check(
            self.max_prompt_len is None or self.max_prompt_len >= 1,
            "max_prompt_len",
            self.max_prompt_len,
            ">= 1 or null",
        )


# --------------------------------------------------------------------------------------------
# Rewards and group sampling
# --------------------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    """How samples are scored."""

    reward_fn: str = "toy"
    """Registered reward (toy, math, math_boxed) or `package.module:function` for user code."""
    max_concurrency: int = 64
    """Reward calls in flight at once (async reward functions)."""
    math_timeout_s: float = 5.0
    """Seconds the math reward may spend on one answer (math-verify in a child process, which
    is killed when it overruns); an answer that times out scores 0 and is counted in
    rollout/reward_timeouts."""

    def __post_init__(self) -> None:
        check(bool(self.reward_fn), "reward_fn", self.reward_fn, "a registered name")
        check(self.max_concurrency >= 1, "max_concurrency", self.max_concurrency, ">= 1")
        check(
            math.isfinite(self.math_timeout_s) and self.math_timeout_s > 0,
            "math_timeout_s",
            self.math_timeout_s,
            "a finite number of seconds > 0",
        )


@dataclass(kw_only=True, slots=True)
class GroupSamplingConfig:
    """Dynamic filtering of prompt groups, with over-sampling to keep the batch full."""

    dynamic_filter: bool = False
    """Drop groups whose rewards are all equal (zero advantage under GRPO) and sample more."""
    over_sampling_batch_size: int | None = None
    """Prompts generated per round while filtering; None: rollout.rollout_batch_size."""
    max_rounds: int = 8
    """Generation rounds before giving up on filling the batch with kept groups."""
    on_shortfall: Literal["backfill", "partial", "error"] = "backfill"
    """Too few kept groups after max_rounds: refill with dropped groups, return fewer, or raise."""

    def __post_init__(self) -> None:
        check(
            self.over_sampling_batch_size is None or self.over_sampling_batch_size >= 1,
            "over_sampling_batch_size",
            self.over_sampling_batch_size,
            ">= 1 or null",
        )
        check(self.max_rounds >= 1, "max_rounds", self.max_rounds, ">= 1")


@dataclass(kw_only=True, slots=True)
class RolloutSections:
    """Every section this package owns, as they appear at the top level of a run config."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    """Inference engine."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt data."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward function."""
    group_sampling: GroupSamplingConfig = field(default_factory=GroupSamplingConfig)
    """Dynamic filter and over-sampling."""
