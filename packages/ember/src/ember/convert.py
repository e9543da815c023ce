"""`ember convert`: transformers <-> Megatron checkpoints, through the backend's weight mapping."""

from __future__ import annotations

import dataclasses
from pathlib import Path


def convert(direction: str, src: Path, dst: Path, *, preset: str | None = None) -> Path:
    """Convert a checkpoint and return the written path.

    `hf-to-megatron` reads a transformers checkpoint directory into a Megatron model and saves
    it as an Ember training checkpoint; `megatron-to-hf` reads an Ember training checkpoint and
    writes a transformers directory that `AutoModelForCausalLM.from_pretrained` loads. Its
    source may also be a run directory (its newest complete checkpoint) or one of a run's
    checkpoints (`checkpoints/rollout_NNNNNN`); its model shape is `preset` (a preset name, or
    a transformers directory whose config.json has the shape), by default the run's initial
    model (`hf_init`; a quantized one gives its shape only) when the source belongs to a run,
    else tiny-moe. It always writes full precision. The tokenizer of a shape
    directory is saved along, with its special token ids in config.json and a
    generation_config.json (`save_tokenizer_for_model`), so the output loads with
    `AutoTokenizer` too and `generate()` stops at EOS.
    """
    from ember_core.config import AlgorithmConfig, SamplingConfig
    from ember_megatron_backend.config import BackendConfig
    from ember_megatron_backend.parallel import destroy_distributed, init_distributed
    from ember_megatron_backend.worker import MegatronWorker
    from ember_rollout.sglang_quant import checkpoint_quantization

    src, dst = Path(src), Path(dst)
    if not src.exists():
        raise FileNotFoundError(f"{src}: no such checkpoint")
    if direction == "hf-to-megatron":
        if not (src / "config.json").is_file():
            raise ValueError(f"{src}: not a transformers checkpoint (no config.json)")
        config = BackendConfig(hf_load=str(src))
    elif direction == "megatron-to-hf":
        src, run_dir = training_checkpoint(src)
        if (
            preset is None
            and run_dir is not None
            and (run_dir / "hf_init" / "config.json").is_file()
        ):
            preset = str(run_dir / "hf_init")
        if preset and Path(preset).is_dir():
            config = BackendConfig(hf_load=preset)  # the shape comes from its config.json
            if checkpoint_quantization(preset) is not None:
                # A quantized export (a run under engine.quantization on SGLang): its shape
                # only, its tensors are the engine's and the trainer's are loaded next anyway.
                shape = config.model_config()
                names = (f.name for f in dataclasses.fields(shape))
                config = BackendConfig(model_overrides={n: getattr(shape, n) for n in names})
        else:
            config = BackendConfig(model=preset) if preset else BackendConfig()
    else:
        raise ValueError(f"direction={direction!r}: expected hf-to-megatron or megatron-to-hf")
    init_distributed(config.parallel)
    try:
        worker = MegatronWorker(
            config, AlgorithmConfig(), SamplingConfig(), with_ref=False, with_critic=False
        )
        if direction == "hf-to-megatron":
            return worker.save_checkpoint(dst)
        worker.load_checkpoint(src)
        worker.export_hf(dst)
        if preset and Path(preset).is_dir():
            _copy_tokenizer(Path(preset), dst)
        return dst
    finally:
        destroy_distributed()


def training_checkpoint(src: Path) -> tuple[Path, Path | None]:
    """The Ember training checkpoint that `src` names, and the run directory it belongs to.

    `src` is a training checkpoint itself, a run's checkpoint (`rollout_NNNNNN`, whose
    training state lives in `train/`), or a run directory (its newest complete checkpoint).
    """
    from ember.checkpoints import latest_checkpoint

    if (src / "checkpoints").is_dir():
        newest = latest_checkpoint(src)
        if newest is None:
            raise ValueError(f"{src}: run directory without a complete checkpoint")
        return newest / "train", src
    if (src / "train").is_dir():
        return src / "train", src.parent.parent
    return src, None


def _copy_tokenizer(src: Path, dst: Path) -> None:
    from ember_rollout.tokenizer import save_tokenizer_for_model

    if (src / "tokenizer_config.json").is_file() or (src / "tokenizer.json").is_file():
        save_tokenizer_for_model(src, dst)
