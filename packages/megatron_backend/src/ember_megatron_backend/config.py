"""The `train` config section: model, parallelism, optimizer, batching, reference and critic."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from ember_core.config import check
from ember_megatron_backend.model import PRESETS, ModelConfig
from ember_megatron_backend.parallel import ParallelConfig

__all__ = ["DTYPES", "BackendConfig", "CriticConfig", "OptimizerConfig", "is_hf_checkpoint"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""Parameter dtypes by config name."""


def _fail(key: str, value: Any, expected: str) -> None:
    check(False, key, value, expected)


def _check_number(key: str, value: Any, *, low: float, low_ok: bool = True) -> None:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value < low or (value == low and not low_ok):
        _fail(key, value, f"a finite number {'>=' if low_ok else '>'} {low}")


def _check_int(key: str, value: Any, *, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        _fail(key, value, f"an integer >= {low}")


def is_hf_checkpoint(path: str | Path) -> bool:
    """Whether `path` is a transformers checkpoint directory (config.json + safetensors)."""
    root = Path(path)
    weights = (root / "model.safetensors").is_file() or (
        root / "model.safetensors.index.json"
    ).is_file()
    return (root / "config.json").is_file() and weights


@dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    """Adam with decoupled weight decay, global-norm gradient clipping and an LR schedule.

    The same settings drive megatron-core's optimizer on GPUs and torch's AdamW on CPU. Weight
    decay skips 1-D parameters (norms) and biases, as megatron-core does.
    """

    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warmup; step s < warmup uses lr * (s + 1) / warmup."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Shape of the decay from lr to min_lr after warmup."""
    lr_decay_steps: int | None = None
    """Step (counted from 0, warmup included) at which the decay reaches min_lr; needed by
    linear and cosine."""
    weight_decay: float = 0.01
    """Decoupled weight decay (AdamW)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Clip gradients to this global L2 norm (across all ranks); 0 disables clipping."""

    def __post_init__(self) -> None:
        _check_number("lr", self.lr, low=0, low_ok=False)
        _check_number("min_lr", self.min_lr, low=0)
        if self.min_lr > self.lr:
            _fail("min_lr", self.min_lr, f"<= lr={self.lr}")
        _check_int("lr_warmup_steps", self.lr_warmup_steps, low=0)
        if self.lr_decay_style not in ("constant", "linear", "cosine"):
            _fail("lr_decay_style", self.lr_decay_style, "constant, linear or cosine")
        if self.lr_decay_style != "constant":
            steps = self.lr_decay_steps
            valid = isinstance(steps, int) and not isinstance(steps, bool)
            if not valid or steps <= self.lr_warmup_steps:
                _fail(
                    "lr_decay_steps",
                    steps,
                    f"an integer > lr_warmup_steps={self.lr_warmup_steps} for "
                    f"lr_decay_style={self.lr_decay_style!r}",
                )
        _check_number("weight_decay", self.weight_decay, low=0)
        for key in ("adam_beta1", "adam_beta2"):
            value = getattr(self, key)
            _check_number(key, value, low=0)
            if value >= 1:
                _fail(key, value, "a number in [0, 1)")
        _check_number("adam_eps", self.adam_eps, low=0, low_ok=False)
        _check_number("clip_grad", self.clip_grad, low=0)


@dataclass(kw_only=True, slots=True)
class CriticConfig:
    """The PPO critic: built only when the advantage estimator uses one."""

    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """The critic's own optimizer settings (critics often use about 10x the actor's lr)."""
    hf_load: str | None = None
    """Transformers checkpoint for the critic's trunk; None uses train.hf_load (or the seed).
    The value layer always starts at zero."""

    def __post_init__(self) -> None:
        if self.hf_load == "":
            _fail("hf_load", "", "a directory or null")


@dataclass(kw_only=True, slots=True)
class BackendConfig:
    """Megatron training: model, parallelism, optimizer, batching, reference and critic."""

    model: str | None = None
    """Model preset (tiny-moe, tiny-dense); None reads the shape from hf_load's config.json,
    or uses tiny-moe when hf_load is unset."""
    model_overrides: dict[str, Any] = field(default_factory=dict)
    """ModelConfig fields that replace the preset's (e.g. {num_layers: 2})."""
    hf_load: str | None = None
    """Transformers checkpoint directory the actor (and the default reference) start from;
    None initialises from `seed`."""
    ref_load: str | None = None
    """Reference weights: a transformers checkpoint or an Ember checkpoint directory; None
    copies the actor's initial weights."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Model-parallel sizes (data parallelism is what the world size leaves)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """The actor's optimizer."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The critic (PPO)."""
    num_steps_per_rollout: int = 1
    """Optimizer steps per rollout; each rank's samples split into this many mini-batches."""
    shuffle_mini_batches: bool = False
    """Deal each rank's samples into the mini-batches in a random order (seeded by `seed` and
    the rollout id), as TRL's GRPOTrainer shuffles its generation batch before splitting it;
    false keeps arrival order, so each optimizer step trains on whole prompt groups."""
    micro_batch_size: int | None = None
    """Samples per micro-batch (gradient accumulation); None with no token budget means one
    micro-batch per mini-batch."""
    max_tokens_per_micro_batch: int | None = None
    """Token budget per micro-batch instead of micro_batch_size."""
    micro_batches_by_length: bool = False
    """Split each mini-batch into micro-batches longest samples first, so that samples of like
    length share one: without Transformer Engine (CPU) a micro-batch is padded to its longest
    sample. The step's samples and its loss are the same (each micro-batch is weighted by its
    share of the step); the sums run in another order, and a MoE's auxiliary losses are taken
    over other groups of tokens."""
    seed: int = 1234
    """Seed of every fresh weight, on CPU and GPU alike (actor, reference and critic trunk; the
    critic's value layer starts at zero). ``parallel.seed`` drives the runtime streams."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype; bfloat16 keeps fp32 master weights in megatron-core's optimizer (GPU)."""
    qat: bool = False
    """Quantization-aware training: the actor's and the reference's forwards multiply with the
    weights the engine serves under `engine.quantization` (quantized, then dequantized; with
    fp8_block the inputs too), gradients passed straight through to the full-precision weights
    (`ember_megatron_backend.qat`). Requires `engine.quantization`."""

    def __post_init__(self) -> None:
        if self.model is not None and self.model not in PRESETS:
            _fail("model", self.model, f"a preset name ({', '.join(sorted(PRESETS))})")
        names = {f.name for f in dataclasses.fields(ModelConfig)}
        for key in self.model_overrides:
            if key not in names:
                raise ValueError(
                    f"model_overrides.{key}: unknown ModelConfig field; known: "
                    f"{', '.join(sorted(names))}"
                )
        for key in ("hf_load", "ref_load"):
            if getattr(self, key) == "":
                _fail(key, "", "a directory or null")
        _check_int("num_steps_per_rollout", self.num_steps_per_rollout, low=1)
        if self.micro_batch_size is not None and self.max_tokens_per_micro_batch is not None:
            raise ValueError(
                f"micro_batch_size={self.micro_batch_size} and "
                f"max_tokens_per_micro_batch={self.max_tokens_per_micro_batch}: set at most "
                "one of them"
            )
        for key in ("micro_batch_size", "max_tokens_per_micro_batch"):
            if getattr(self, key) is not None:
                _check_int(key, getattr(self, key), low=1)
        _check_int("seed", self.seed, low=0)
        if self.dtype not in DTYPES:
            _fail("dtype", self.dtype, f"one of {', '.join(DTYPES)}")
        if self.model is not None or self.hf_load is None:
            self.check_parallel()  # the shape is in code: check it now, not in the ranks

    def check_parallel(self) -> None:
        """Refuse a tensor-parallel size the model's heads (or vocabulary) do not split over.

        With `hf_load` and no preset this reads the checkpoint's config.json; ``ember train``
        calls it before any process starts.

        Raises:
            ValueError: One line naming train.parallel.tensor_parallel and the head counts.
        """
        size = self.parallel.tensor_parallel
        if size > 1:
            self.model_config().check_tensor_parallel(size, key="train.parallel.tensor_parallel")

    def check_sglang_ties(self) -> None:
        """Refuse a model with tied embeddings of a family SGLang never ties
        (`Family.sglang_ties`): the server's output layer would keep its initial values.
        ``ember train`` calls it before any process starts when the engine is SGLang.

        Raises:
            ValueError: One line naming the family, the setting and what to do instead.
        """
        from ember_megatron_backend.families import REGISTRY

        cfg = self.model_config()
        if cfg.tie_word_embeddings and not REGISTRY[cfg.family].sglang_ties:
            raise ValueError(
                f"train: a {cfg.family} model with tie_word_embeddings=true cannot be served by "
                f"engine.kind=sglang: SGLang's {cfg.family} never ties its output layer, and a "
                "tied model has no lm_head to load into it; untie the checkpoint (lm_head.weight "
                "a copy of the embedding, tie_word_embeddings: false) or use engine.kind=hf"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        """The parameter dtype as a torch dtype."""
        return DTYPES[self.dtype]

    def model_config(self) -> ModelConfig:
        """The model shape: preset (or hf_load's config.json) with `model_overrides` applied.

        Raises:
            ValueError: naming `model_overrides` and the field for a bad override value, or
                `train.hf_load` when it is not a directory holding a config.json.
        """
        from ember_core.config import from_dict

        if self.model is not None:
            base = ModelConfig.preset(self.model)
        elif self.hf_load is not None:
            from transformers import AutoConfig

            from ember_megatron_backend.hf_layout import model_config_from_hf

            # A path that is not there would reach transformers' hub lookup (a traceback about
            # repo ids, or a download attempt): name the key instead. Plugins read the shape
            # while the config loads, before `ember train` checks its inputs.
            root = Path(self.hf_load)
            if not root.is_dir():
                raise ValueError(f"train.hf_load={self.hf_load!r}: no such directory")
            if not (root / "config.json").is_file():
                raise ValueError(
                    f"train.hf_load={self.hf_load!r}: no config.json there (the model's shape "
                    "is read from a transformers checkpoint directory)"
                )
            config = AutoConfig.from_pretrained(self.hf_load, local_files_only=True)
            base = model_config_from_hf(config)
        else:
            base = ModelConfig.preset("tiny-moe")
        if not self.model_overrides:
            return base
        values = {f.name: getattr(base, f.name) for f in dataclasses.fields(ModelConfig)}
        try:
            return from_dict(ModelConfig, {**values, **self.model_overrides})
        except ValueError as exc:
            raise ValueError(f"model_overrides: {exc}") from None
