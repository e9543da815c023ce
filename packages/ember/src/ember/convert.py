"""`ember convert`: transformers <-> Megatron checkpoints, through the backend's weight mapping."""

from __future__ import annotations

from pathlib import Path


def convert(direction: str, src: Path, dst: Path, *, preset: str | None = None) -> Path:
    """Convert a checkpoint and return the written path.

    `hf-to-megatron` reads a transformers checkpoint directory into a Megatron model and saves
    it as an Ember training checkpoint; `megatron-to-hf` reads an Ember training checkpoint and
    writes a transformers directory that `AutoModelForCausalLM.from_pretrained` loads; its
    model shape is `preset` (a preset name, or a transformers directory whose config.json has
    the shape; default tiny-moe).
    """
    from ember_core.config import AlgorithmConfig, SamplingConfig
    from ember_megatron_backend.config import BackendConfig
    from ember_megatron_backend.parallel import destroy_distributed, init_distributed
    from ember_megatron_backend.worker import MegatronWorker

    src, dst = Path(src), Path(dst)
    if not src.exists():
        raise FileNotFoundError(f"{src}: no such checkpoint")
    if direction == "hf-to-megatron":
        if not (src / "config.json").is_file():
            raise ValueError(f"{src}: not a transformers checkpoint (no config.json)")
        config = BackendConfig(hf_load=str(src))
    elif direction == "megatron-to-hf":
        if preset and Path(preset).is_dir():
            config = BackendConfig(hf_load=preset)  # the shape comes from its config.json
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
        return dst
    finally:
        destroy_distributed()
