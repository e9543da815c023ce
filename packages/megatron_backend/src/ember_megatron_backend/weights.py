"""Weights in and out of a (sharded) Megatron GPTModel in the transformers checkpoint format.

- ``load_hf_checkpoint``: an HF safetensors directory -> this rank's parameters.
- ``iter_hf_weights``: (hf_name, tensor) pairs of this pipeline stage, gathered over TP/ETP/EP,
  for pushing weights to rollout engines.
- ``export_hf_checkpoint``: a directory that ``AutoModelForCausalLM.from_pretrained`` loads
  (config.json + model.safetensors), gathered over every parallel dimension.

Sharding follows megatron-core: column-parallel layers (``linear_qkv``, ``output_layer``, the
vocabulary embedding) split rows across TP; SwiGLU ``linear_fc1`` splits its gate and its up half
separately, so rank r holds [gate_r; up_r]; row-parallel layers (``linear_proj``, ``linear_fc2``)
split columns; norms and routers are replicated. Expert weights use the expert-tensor-parallel
group instead of TP, and EP rank r holds experts [r * E / EP, (r + 1) * E / EP).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ember_core import quant
from ember_core.quant import QuantSpec
from ember_megatron_backend import comm
from ember_megatron_backend.hf_layout import hf_config, hf_names, hf_rule, hf_shapes
from ember_megatron_backend.model import ModelConfig, ValueOutputLayer

__all__ = [
    "CheckpointReader",
    "export_hf_checkpoint",
    "hf_shapes",
    "iter_hf_weights",
    "load_hf_checkpoint",
    "shard",
    "unshard",
]

# Transformer Engine layer specs fuse the pre-attention / pre-MLP norms into the next linear
# and keep grouped experts as weight{e} of one module; these names map onto the local spec's.
_TE_ALIASES = (
    (re.compile(r"self_attention\.linear_qkv\.layer_norm_weight$"), "input_layernorm.weight"),
    (re.compile(r"mlp\.linear_fc1\.layer_norm_weight$"), "pre_mlp_layernorm.weight"),
    (
        re.compile(r"mlp\.experts\.(linear_fc[12])\.weight(\d+)$"),
        r"mlp.experts.local_experts.\2.\1.weight",
    ),
    # Multi-latent attention: the query / key-value norms fused into the up projections.
    (re.compile(r"linear_q_up_proj\.layer_norm_weight$"), "q_layernorm.weight"),
    (re.compile(r"linear_kv_up_proj\.layer_norm_weight$"), "kv_layernorm.weight"),
)
_LAYER_IDX = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT_IDX = re.compile(r"\.local_experts\.(\d+)\.")


# --- sharding --------------------------------------------------------------------------------


def shard(full: Tensor, kind: str, rank: int, size: int) -> Tensor:
    """Rank `rank`'s piece of a full tensor split `size` ways.

    Args:
        full: The unsharded tensor.
        kind: "replicated", "column" (rows split), "row" (columns split) or "glu" (rows split
            within each of the gate and up halves).
        rank: The rank within the splitting group.
        size: The group size.
    """
    if size == 1 or kind == "replicated":
        return full
    if kind == "column":
        return full.chunk(size, dim=0)[rank]
    if kind == "row":
        return full.chunk(size, dim=1)[rank]
    if kind == "glu":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    raise ValueError(f"unknown shard kind {kind!r}")


def unshard(pieces: list[Tensor], kind: str) -> Tensor:
    """Inverse of ``shard``: the full tensor from every rank's piece, in rank order."""
    if len(pieces) == 1 or kind == "replicated":
        return pieces[0]
    if kind == "column":
        return torch.cat(pieces, dim=0)
    if kind == "row":
        return torch.cat(pieces, dim=1)
    if kind == "glu":
        halves = [p.chunk(2, dim=0) for p in pieces]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    raise ValueError(f"unknown shard kind {kind!r}")


@dataclass(frozen=True, slots=True)
class _Placement:
    """Where a local parameter sits in the full model."""

    global_name: str
    kind: str
    expert: bool  # split over the expert-tensor-parallel group, gathered over EP


def _kind(global_name: str, tensor: Tensor, critic: bool) -> str:
    """How `tensor` is split over its tensor-parallel group, from megatron-core's own marks
    (``tensor_model_parallel`` / ``partition_dim``, set on every split parameter)."""
    if critic and global_name == "output_layer.weight":
        return "replicated"
    if not getattr(tensor, "tensor_model_parallel", False):
        return "replicated"
    if getattr(tensor, "partition_dim", 0) == 1:
        return "row"
    # SwiGLU fc1 holds [gate; up]: each half is split on its own.
    return "glu" if global_name.endswith("linear_fc1.weight") else "column"


def named_tensors(model: Any) -> Iterator[tuple[str, Tensor]]:
    """The tensors that make a model's weights: its parameters, then its routers' expert
    biases (buffers that the checkpoint holds and the optimizer does not train)."""
    yield from model.named_parameters()
    for name, buffer in model.named_buffers():
        if name.endswith("router.expert_bias"):
            yield name, buffer


def _unwrap(model: Any) -> Any:
    while hasattr(model, "module"):
        model = model.module
    return model


def _is_critic(model: Any) -> bool:
    return isinstance(getattr(model, "output_layer", None), ValueOutputLayer)


def _placements(model: Any, cfg: ModelConfig) -> dict[str, _Placement]:
    """Local parameter name -> placement, for this rank's model chunk."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    layer_offset = get_transformer_layer_offset(model.config)
    ep_rank = ps.get_expert_model_parallel_rank()
    local_experts = cfg.num_experts // ps.get_expert_model_parallel_world_size()
    critic = _is_critic(model)
    out = {}
    for local_name, tensor in named_tensors(model):
        name = local_name
        for pattern, repl in _TE_ALIASES:
            name = pattern.sub(repl, name)
        name = _LAYER_IDX.sub(lambda m: f"decoder.layers.{int(m[1]) + layer_offset}.", name)
        name = _EXPERT_IDX.sub(
            lambda m: f".local_experts.{int(m[1]) + ep_rank * local_experts}.", name
        )
        out[local_name] = _Placement(name, _kind(name, tensor, critic), ".local_experts." in name)
    return out


def _group(expert: bool) -> tuple[int, int, Any]:
    from megatron.core import parallel_state as ps

    if expert:
        return (
            ps.get_expert_tensor_parallel_rank(),
            ps.get_expert_tensor_parallel_world_size(),
            ps.get_expert_tensor_parallel_group(),
        )
    return (
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_tensor_model_parallel_group(),
    )


# --- reading checkpoints ------------------------------------------------------------------------


_FUSED_KEY = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)$")


class CheckpointReader:
    """Lazy reader of a safetensors checkpoint directory (single file or sharded with an index).

    Expert tensors stored fused (transformers 5 in-memory names ``mlp.experts.gate_up_proj``
    [E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I]) are presented per expert, so callers
    always see the per-expert checkpoint layout.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from safetensors import safe_open

        root = Path(path)
        index = root / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (root / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise FileNotFoundError(f"{root} holds neither model.safetensors nor its index")
        self._handles = [safe_open(str(root / f), framework="pt") for f in files]
        self._where: dict[str, tuple[Any, str, int | None, int | None]] = {}
        for handle in self._handles:
            for key in handle.keys():
                fused = _FUSED_KEY.fullmatch(key)
                if fused is None:
                    self._where[key] = (handle, key, None, None)
                    continue
                prefix, which = fused.groups()
                num_experts = handle.get_slice(key).get_shape()[0]
                for e in range(num_experts):
                    if which == "down_proj":
                        self._where[f"{prefix}{e}.down_proj.weight"] = (handle, key, e, None)
                    else:
                        self._where[f"{prefix}{e}.gate_proj.weight"] = (handle, key, e, 0)
                        self._where[f"{prefix}{e}.up_proj.weight"] = (handle, key, e, 1)

    def keys(self) -> list[str]:
        """Checkpoint names, per expert."""
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of `name` without reading it."""
        handle, key, expert, half = self._where[name]
        shape = tuple(handle.get_slice(key).get_shape())
        if expert is None:
            return shape
        rows, cols = shape[1:]
        return (rows // 2, cols) if half is not None else (rows, cols)

    def get(self, name: str) -> Tensor:
        """The tensor `name`."""
        handle, key, expert, half = self._where[name]
        if expert is None:
            return handle.get_tensor(key)
        tensor = handle.get_slice(key)[expert]
        return tensor if half is None else tensor.chunk(2, dim=0)[half].contiguous()


def _mtp_names(path: Path, names: set[str], cfg: ModelConfig) -> set[str]:
    """Tensors of the multi-token-prediction layers a DeepSeek-V3 / GLM-4.5 checkpoint appends
    after its decoder layers (config.json ``num_nextn_predict_layers``); training does not use
    them."""
    config = path / "config.json"
    extra = (
        json.loads(config.read_text()).get("num_nextn_predict_layers", 0) if config.is_file() else 0
    )
    mtp = range(cfg.num_layers, cfg.num_layers + int(extra or 0))
    layer = re.compile(r"model\.layers\.(\d+)\.")
    return {n for n in names if (m := layer.match(n)) and int(m[1]) in mtp}


def _check_checkpoint(
    reader: CheckpointReader, cfg: ModelConfig, tied_ok: bool, path: Path
) -> None:
    expected = hf_shapes(cfg)
    available = set(reader.keys())
    available -= _mtp_names(path, available, cfg)
    for name, shape in expected.items():
        if name not in available:
            raise ValueError(f"checkpoint lacks parameter {name} (expected shape {list(shape)})")
        found = reader.shape(name)
        if tuple(found) != shape:
            raise ValueError(
                f"checkpoint parameter {name} has shape {list(found)}, but the model expects "
                f"{list(shape)}: the checkpoint is of another architecture or size"
            )
    extra = sorted(available - set(expected) - ({"lm_head.weight"} if tied_ok else set()))
    if extra:
        raise ValueError(
            f"checkpoint has parameter {extra[0]} (shape {list(reader.shape(extra[0]))}) that the "
            f"model does not ({len(extra)} such): the checkpoint is of another architecture"
        )


@torch.no_grad()
def load_hf_checkpoint(model: Any, path: str | os.PathLike[str], cfg: ModelConfig) -> None:
    """Copy a transformers checkpoint directory into this rank's shard of `model`.

    The checkpoint must hold exactly the model's tensors (a tied model may also carry an
    ``lm_head.weight``, which is ignored). A critic keeps its value output layer and ignores
    ``lm_head.weight``. Tensors are cast to the parameters' dtype.

    Raises:
        ValueError: naming the first parameter whose name or shape does not match, with both
            shapes.
    """
    model = _unwrap(model)
    critic = _is_critic(model)
    reader = CheckpointReader(path)
    _check_checkpoint(reader, cfg, tied_ok=cfg.tie_word_embeddings or critic, path=Path(path))
    params = dict(named_tensors(model))
    for local_name, place in _placements(model, cfg).items():
        if critic and place.global_name == "output_layer.weight":
            continue
        if cfg.tie_word_embeddings and place.global_name == "output_layer.weight":
            # A tied model's last pipeline stage holds its own copy of the embedding.
            rule = hf_rule("embedding.word_embeddings.weight", cfg)
        else:
            rule = hf_rule(place.global_name, cfg)
        full = rule.merge(*(reader.get(n) for n in rule.hf_names))
        rank, size, _ = _group(place.expert)
        piece = shard(full, place.kind, rank, size)
        param = params[local_name]
        if piece.shape != param.shape:
            raise ValueError(
                f"parameter {local_name} (from {', '.join(rule.hf_names)}) has shape "
                f"{list(param.shape)} in the model but {list(piece.shape)} from the checkpoint"
            )
        param.copy_(piece.to(param.dtype))


# --- gathering and writing ----------------------------------------------------------------------


def _all_gather(tensor: Tensor, size: int, group: Any) -> list[Tensor]:
    if size == 1:
        return [tensor]
    return comm.all_gather(tensor, group)


@torch.no_grad()
def _iter_full_megatron(model: Any, cfg: ModelConfig) -> Iterator[tuple[str, Tensor]]:
    """(global Megatron name, full tensor) of this pipeline stage, gathered over TP/ETP/EP.

    Every rank of a TP/EP group must iterate in step: the gathers are collectives.
    """
    from megatron.core import parallel_state as ps

    ep_size = ps.get_expert_model_parallel_world_size()
    ep_group = ps.get_expert_model_parallel_group()
    local_experts = cfg.num_experts // ep_size
    placements = _placements(model, cfg)
    for local_name, param in named_tensors(model):
        place = placements[local_name]
        if cfg.tie_word_embeddings and place.global_name == "output_layer.weight":
            continue  # the embedding already holds it
        _, size, group = _group(place.expert)
        full = unshard(_all_gather(param.detach(), size, group), place.kind)
        if not place.expert:
            yield place.global_name, full
            continue
        match = _EXPERT_IDX.search(place.global_name)
        local_e = int(match[1]) % local_experts
        for ep_rank, tensor in enumerate(_all_gather(full, ep_size, ep_group)):
            e = ep_rank * local_experts + local_e
            yield _EXPERT_IDX.sub(f".local_experts.{e}.", place.global_name), tensor


def iter_hf_weights(
    model: Any, cfg: ModelConfig, *, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, Tensor]]:
    """(hf_name, tensor) pairs of this rank's pipeline stage, full (gathered over TP/ETP/EP),
    named as the family's checkpoints name them (one tensor per expert, as SGLang reads them).

    Tensors stay on the parameters' device. Every rank of the TP/EP groups must consume the
    iterator in step, since gathering is collective. Under PP each stage yields its own layers
    (with global layer indices) and the first stage the embedding.

    Args:
        model: An actor or reference GPTModel (possibly wrapped); not a critic.
        cfg: Its shape.
        dtype: Cast to this dtype (default: keep the parameters' dtype). Routers' expert biases
            stay in float32, as checkpoints keep them.

    Raises:
        ValueError: for a critic (its value layer has no transformers counterpart).
    """
    model = _unwrap(model)
    if _is_critic(model):
        raise ValueError("a critic has no transformers counterpart to export")
    for name, full in _iter_full_megatron(model, cfg):
        rule = hf_rule(name, cfg)
        tensors = rule.split(full)
        if dtype is not None and not name.endswith("expert_bias"):
            tensors = [t.to(dtype) for t in tensors]
        yield from zip(rule.hf_names, tensors, strict=True)


def export_hf_checkpoint(
    model: Any,
    cfg: ModelConfig,
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    quantization: QuantSpec | None = None,
    quantization_config: Mapping[str, Any] | None = None,
) -> Path | None:
    """Write config.json + model.safetensors that ``AutoModelForCausalLM.from_pretrained`` loads
    (full precision), or that a quantized engine loads (`quantization`).

    Collective over all ranks (TP/ETP/EP gathers, then pipeline stages to global rank 0). Only
    global rank 0 writes; the directory appears atomically (written aside, then renamed).

    Args:
        model: An actor or reference GPTModel (possibly wrapped).
        cfg: Its shape.
        path: Target directory; replaced if it exists.
        dtype: Tensor and config dtype (default: the parameters' dtype).
        quantization: Write the weights as a quantized engine serves them: the tensors of
            `ember_core.quant.quantize_named`, quantized from the parameters as held (as every
            push quantizes them), the others and INT4 scales in `dtype`.
        quantization_config: config.json's `quantization_config` for `quantization` (the
            engine's own format, `ember_rollout.sglang_quant.quantization_config`); required
            with it.

    Returns:
        The directory on global rank 0, None elsewhere.

    Raises:
        ValueError: One of `quantization` and `quantization_config` without the other, or a
            weight the scheme cannot quantize (`quant.check_shape`).
    """
    from megatron.core import parallel_state as ps
    from safetensors.torch import save_file

    if (quantization is None) != (quantization_config is None):
        raise ValueError("export_hf_checkpoint: quantization and quantization_config go together")
    unwrapped = _unwrap(model)
    if dtype is None:
        dtype = next(unwrapped.parameters()).dtype
    pp_size = ps.get_pipeline_model_parallel_world_size()
    writer = not dist.is_initialized() or dist.get_rank() == 0
    # Every rank consumes the iterator (its gathers are collective); only the writer, and each
    # pipeline stage when stages must be sent to it, keeps CPU copies.
    keep = writer or pp_size > 1
    tensors = {}
    # Quantized from the weights as held, as `quantize_named` quantizes every push.
    for name, t in iter_hf_weights(unwrapped, cfg, dtype=dtype if quantization is None else None):
        if not keep:
            continue
        named = [(name, t)]
        if quantization is not None:
            named = quant.quantize_named(named, quantization, dtype=dtype)
        for kept, tensor in named:
            tensors[kept] = tensor.detach().to("cpu").clone()
    if pp_size > 1:
        stages: list[dict[str, Tensor] | None] = [None] * pp_size
        comm.all_gather_object(stages, tensors, group=ps.get_pipeline_model_parallel_group())
        tensors = {k: v for stage in stages for k, v in (stage or {}).items()}
    if not writer:
        return None
    # Against the family's description, not `hf_shapes`: that builds transformers' model, whose
    # imports were 2.7 s of a 6.4 s export on a 2-core AMD EPYC (py-spy); the family tests hold
    # the description to transformers' model.
    names = hf_names(cfg)
    if quantization is not None:
        names = [
            q
            for n in names
            for q in (
                quant.quantized_names(n, quantization)
                if quant.is_target(n, quantization.targets)
                else [n]
            )
        ]
    missing = sorted(set(names) - set(tensors))
    assert not missing, f"export lacks {missing[:3]}"
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        hf_config(cfg, dtype=dtype).save_pretrained(staging)
        if quantization_config is not None:
            # Written into the JSON: transformers' config would interpret the dict.
            file = staging / "config.json"
            data = json.loads(file.read_text())
            data["quantization_config"] = dict(quantization_config)
            file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target
