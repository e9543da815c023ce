"""The model a fake SGLang server launched from: its checkpoint's tensors and config.json, held
to sglang 0.5.23's loader rules for quantized checkpoints (`ember_rollout.sglang_loader_rules`).

Both fakes use it (`sglang_fake.FakeSGLang` in the test's process, `packages/ember/tests/
fake_sglang_server.py` as a process). A server launched from a quantized checkpoint checks its
config.json and tensors at launch, where sglang would fail to start (the fakes refuse to start,
with the rule's message), and every tensor a weight update carries: a shape sglang's loader
asserts fails the update as sglang answers it, and what sglang would take silently (an unknown
name, which it skips; another dtype, which it casts; an INT4 expert not resent in a session,
which it corrupts) fails it too: stricter than sglang, so that a push sglang would load wrong
fails the CPU suite. A full-precision checkpoint keeps the fakes' older, looser rules.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ember_core import quant
from ember_core.quant import QuantSpec
from ember_rollout import sglang_quant
from ember_rollout.sglang_loader_rules import check_push, check_session, check_sglang_quantized


def mismatch(configured: str, checkpoint: str) -> str:
    """sglang 0.5.23 configs/model_config.py:2141-2147: --quantization against the checkpoint's."""
    return (
        f"Quantization method specified in the model config ({checkpoint}) does not match the "
        f"quantization method specified in the `quantization` argument ({configured})."
    )


@dataclass
class ServedModel:
    """A launched model: config.json, (dtype, shape) per checkpoint tensor, and the names a
    weight-update session loaded so far."""

    path: str
    config: dict[str, Any]
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    tp_size: int = 1
    dtype: torch.dtype | None = None
    """What the server computes in (`--dtype`, with sglang's auto rule)."""
    quantization: str | None = None
    """What GET /server_info reports (`--quantization`, null unless given)."""
    sent: set[str] = field(default_factory=set)

    @classmethod
    def launch(
        cls,
        path: str | Path,
        *,
        tp_size: int = 1,
        dtype: str = "auto",
        quantization: str | None = None,
        tensors: Mapping[str, torch.Tensor] | None = None,
    ) -> ServedModel:
        """The model a server started as `--model-path path` loads (`tensors`: its checkpoint's,
        read from `path` if not given).

        Raises:
            ValueError: Where sglang would not start: --quantization against the checkpoint's,
                or a loader rule the quantized checkpoint breaks.
        """
        config = json.loads((Path(path) / "config.json").read_text())
        if tensors is None:
            tensors = load_checkpoint(path)
        model = cls(
            str(path),
            config,
            sglang_quant.table(tensors.items()),
            tp_size,
            sglang_quant.served_dtype_of(config, dtype),
            quantization,
        )
        qc = config.get("quantization_config")
        if quantization is not None and qc is not None and qc.get("quant_method") != quantization:
            raise ValueError(mismatch(quantization, qc.get("quant_method")))
        if qc is not None:
            check_sglang_quantized(model.tensors, config, tp_size=tp_size, dtype=model.dtype)
        return model

    @property
    def quantized(self) -> bool:
        return self.config.get("quantization_config") is not None

    def begin(self) -> None:
        """/begin_weight_update: a session loads from nothing."""
        self.sent.clear()

    def load(self, named: Iterable[tuple[str, tuple[torch.dtype, tuple[int, ...]]]]) -> str | None:
        """Why the tensors of one update (name, (dtype, shape)) may not load, or None (they are
        then counted as sent in the session)."""
        pushed = dict(named)
        if not self.quantized:
            return None
        try:
            check_push(pushed, self.tensors)
            check_sglang_quantized(
                pushed, self.config, tp_size=self.tp_size, dtype=self.dtype, partial=True
            )
        except ValueError as exc:
            return str(exc)
        self.sent.update(pushed)
        return None

    def end(self) -> str | None:
        """/end_weight_update: why the session left the model wrong, or None."""
        sent, self.sent = set(self.sent), set()
        if not self.quantized:
            return None
        try:
            check_session(sent, self.tensors, self.config)
        except ValueError as exc:
            return str(exc)
        return None

    def server_info(self) -> dict[str, Any]:
        """GET /server_info's fields a client reads of the model (sglang 0.5.23 utils/common.py
        `build_server_info`: the resolved server arguments)."""
        return {"quantization": self.quantization, "tp_size": self.tp_size, "model_path": self.path}

    def model_info(self, weight_version: str) -> dict[str, Any]:
        """GET /model_info (sglang 0.5.23 entrypoints/http_server.py:812-850)."""
        return {
            "model_path": self.path,
            "served_model_name": self.path,
            "tokenizer_path": self.path,
            "is_generation": True,
            "weight_version": weight_version,
            "load_format": "auto",
            "model_type": self.config.get("model_type"),
            "architectures": self.config.get("architectures"),
        }


def load_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files at `path`, by name."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        weights.update(load_file(file))
    return weights


# -- a small quantized checkpoint ----------------------------------------------------------

L0 = "model.layers.0"
ATTN = sorted(f"{L0}.self_attn.{p}_proj" for p in "qkvo")
EXPERTS = [f"{L0}.mlp.experts.{e}.{p}_proj" for e in (0, 1) for p in ("gate", "up", "down")]

# A one-layer Qwen3-MoE at the smallest size both schemes serve: 128-wide blocks and groups
# divide every quantized dimension, q/k/v apart (fused shards), and the experts' intermediate.
SHAPES = {
    "model.embed_tokens.weight": (16, 128),
    f"{L0}.input_layernorm.weight": (128,),
    f"{L0}.self_attn.q_proj.weight": (256, 128),
    f"{L0}.self_attn.k_proj.weight": (128, 128),
    f"{L0}.self_attn.v_proj.weight": (128, 128),
    f"{L0}.self_attn.o_proj.weight": (128, 256),
    f"{L0}.self_attn.q_norm.weight": (128,),
    f"{L0}.self_attn.k_norm.weight": (128,),
    f"{L0}.post_attention_layernorm.weight": (128,),
    f"{L0}.mlp.gate.weight": (2, 128),
    **{f"{m}.weight": (128, 128) for m in EXPERTS},
    "model.norm.weight": (128,),
    "lm_head.weight": (16, 128),
}
HF_CONFIG = {
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "dtype": "bfloat16",
    "hidden_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "num_experts": 2,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 1,
    "vocab_size": 16,
    "max_position_embeddings": 64,
    "eos_token_id": 0,
}


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Full-precision weights of the model above."""
    generator = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=generator) for n, s in SHAPES.items()}


def pushed(spec: QuantSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """What a push of the model under `spec` carries (the trainer's `quantize_named`)."""
    return dict(quant.quantize_named(weights(seed).items(), spec, dtype=torch.bfloat16))


def config(spec: QuantSpec) -> dict:
    """config.json of the model above, quantized under `spec`."""
    return {**HF_CONFIG, "quantization_config": sglang_quant.quantization_config(spec, SHAPES)}


def write_checkpoint(path: Path, spec: QuantSpec, seed: int = 0) -> Path:
    """A quantized checkpoint as Ember exports it, of the model above."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config(spec)))
    save_file(pushed(spec, seed), str(path / "model.safetensors"))
    return path
