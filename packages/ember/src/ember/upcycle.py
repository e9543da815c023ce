"""`ember upcycle`: a Mixtral MoE checkpoint from a dense transformers llama by sparse upcycling.

Sparse upcycling (Komatsuzaki et al. 2022, arXiv 2212.05055): every layer's dense SwiGLU MLP
becomes E experts, each a copy of that MLP, behind a new router; attention, norms and
embeddings are copied as they are. Mixtral's router takes the softmax over the E logits, keeps
the top k and renormalises them to sum to 1, so with identical experts the MoE layer computes
exactly the dense MLP (up to float summation order) whatever the router says. Two knobs make
routing matter from the first step:

- ``noise`` (default `DEFAULT_NOISE`): each expert's copy of each of the MLP's three matrices W
  gets independent Gaussian noise of std ``noise * std(W)`` (relative to the matrix's own
  spread, so one value fits every layer and width).
- ``router_std`` (default `DEFAULT_ROUTER_STD`): routers are drawn from N(0, router_std^2),
  the init std of transformers' and megatron-core's configs (``initializer_range``,
  ``init_method_std``), as a router trained from scratch starts.

Measured on SmolLM2-135M-Instruct (imported from its Q4_1 GGUF, fp32, 8 experts, top-2, four
short texts), mean KL per token from the dense model's next-token distribution, and between
two draws of every router, against 1.1e-3 between the dense model in bf16 and in fp32:

    noise   KL(dense, upcycled)   KL(router, other router)   greedy answer to 7 + 5
    0.01    1.1e-3                1.7e-3                     the dense model's
    0.02    4.3e-3                6.6e-3                     the dense model's
    0.03    9.1e-3                1.3e-2                     reworded, still 12
    0.05    2.5e-2                3.7e-2                     drifts off

0.02 is the default: the choice of experts then changes the output several times more than
bf16 rounding does, and the model still answers as the dense one (its loss on those texts was
unchanged). With router std 0.02 the router logits there have std 0.075 (the max softmax
probability of 8 experts averages 0.14): routing starts soft and training shapes it; stds of
0.05-0.2 changed neither those KLs nor how many routing decisions bf16 flips (1-2% per layer)
much.

Tied embeddings. The output written always has its own ``lm_head.weight`` (a copy of the
embedding when the dense model ties them) and ``tie_word_embeddings: false``, because:

- transformers 5.19 (``models/mixtral/modeling_mixtral.py``): ``MixtralForCausalLM`` declares
  ``_tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}``, which
  ``PreTrainedModel.get_expanded_tied_weights_keys`` (``modeling_utils.py``) applies only when
  ``config.tie_word_embeddings`` is true (MixtralConfig's default is false). transformers ties.
- SGLang 0.5.23 (``srt/models/mixtral.py``): ``MixtralForCausalLM.__init__`` builds
  ``self.lm_head = ParallelLMHead(...)`` unconditionally and never reads
  ``tie_word_embeddings``; ``load_weights`` fills it only from a checkpoint tensor named
  ``lm_head.weight``. SGLang does not tie: without that tensor its output layer keeps
  uninitialised memory.

An untied checkpoint reads the same in transformers, SGLang and Ember's Megatron mixtral
family; training then updates the output layer and the embedding separately, as a Mixtral
does. SGLang 0.5.23's Mixtral also derives ``head_dim = hidden_size / num_attention_heads``
and applies plain RoPE (no ``rope_parameters`` scaling), so dense models with another head
width or a scaled RoPE are refused rather than written for one engine to misread.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_EXPERTS = 8
DEFAULT_TOP_K = 2
DEFAULT_NOISE = 0.02
"""Relative std of the experts' noise (the module docstring has the measurements)."""
DEFAULT_ROUTER_STD = 0.02
"""Std of the new routers' weights."""
SUPPORTED = ("llama",)
"""Dense transformers `model_type`s that upcycle to Mixtral."""
_WHY_NOT = {
    "qwen3": "its attention has QK norms, which Mixtral lacks",
    "mixtral": "it is an MoE already",
}
MAX_SHARD_BYTES = 1 << 30
"""Bytes per safetensors file at most (a file holds whole layers; one layer may exceed it)."""

_EXPERT_NAMES = {"gate": "w1", "up": "w3", "down": "w2"}  # Mixtral's checkpoint names
_LAYER_COPIES = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
)


@dataclass(frozen=True, slots=True)
class Upcycled:
    """What `upcycle` wrote."""

    path: Path
    """The Mixtral checkpoint directory."""
    summary: str
    """What was done, in a few lines."""


def check_options(*, experts: int, top_k: int, noise: float, router_std: float) -> None:
    """Refuse upcycling options that cannot make a Mixtral.

    Raises:
        ValueError: naming the option and its value.
    """
    if experts < 1:
        raise ValueError(f"--experts {experts}: expected at least 1")
    if top_k < 1:
        raise ValueError(f"--top-k {top_k}: expected at least 1")
    if top_k > experts:
        raise ValueError(f"--top-k {top_k} exceeds --experts {experts}")
    if not (math.isfinite(noise) and noise >= 0):
        raise ValueError(f"--noise {noise}: expected a number >= 0")
    if not (math.isfinite(router_std) and router_std > 0):
        raise ValueError(f"--router-std {router_std}: expected a number > 0")


def read_dense_config(src: Path) -> Any:
    """The dense model's transformers config, once its config.json shows a supported one.

    The cheap checks (directory, config.json, model_type, features Mixtral lacks) read the JSON
    before transformers is imported, so bad input fails in about a second.

    Raises:
        FileNotFoundError: `src` does not exist.
        ValueError: not a transformers checkpoint, or a model Mixtral cannot represent.
    """
    if not src.exists():
        raise FileNotFoundError(f"{src}: no such checkpoint directory")
    config_file = src / "config.json"
    if not src.is_dir() or not config_file.is_file():
        raise ValueError(f"{src}: not a transformers checkpoint (no config.json)")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_file}: not JSON ({exc})") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type is None:
        raise ValueError(f"{src}: not a transformers checkpoint (config.json has no model_type)")
    if model_type not in SUPPORTED:
        why = f" ({_WHY_NOT[model_type]})" if model_type in _WHY_NOT else ""
        raise ValueError(
            f"{src}: model_type {model_type!r} cannot be upcycled{why}; "
            f"supported dense types: {', '.join(SUPPORTED)}"
        )
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key):
            raise ValueError(f"{src}: {key}=true, but Mixtral has no biases")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{src}: hidden_act={raw['hidden_act']!r}; Mixtral's MLP is SwiGLU (silu)")
    if not _weight_files(src):
        raise FileNotFoundError(f"{src}: no model.safetensors or model.safetensors.index.json")

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(src, local_files_only=True)
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise ValueError(
            f"{src}: rope_type {rope['rope_type']!r}; the Mixtral engines (SGLang 0.5.23, "
            "Ember's Megatron family) apply only the default RoPE"
        )
    derived = config.hidden_size // config.num_attention_heads
    if config.head_dim != derived:
        raise ValueError(
            f"{src}: head_dim={config.head_dim}, but SGLang 0.5.23's Mixtral derives "
            f"hidden_size / num_attention_heads = {derived}"
        )
    return config


def _weight_files(src: Path) -> list[Path]:
    index = src / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [src / n for n in names]
    single = src / "model.safetensors"
    return [single] if single.is_file() else []


class _Reader:
    """Lazy reader of the dense checkpoint's tensors (single file or sharded)."""

    def __init__(self, src: Path) -> None:
        from safetensors import safe_open

        self._where: dict[str, Any] = {}
        for file in _weight_files(src):
            handle = safe_open(str(file), framework="pt")
            for key in handle.keys():
                if not key.endswith("rotary_emb.inv_freq"):  # a buffer some writers keep
                    self._where[key] = handle

    def names(self) -> set[str]:
        return set(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name].get_slice(name).get_shape())

    def get(self, name: str) -> Any:
        return self._where[name].get_tensor(name)


def _check_tensors(reader: _Reader, config: Any, src: Path) -> None:
    """The dense checkpoint holds exactly a llama of `config`'s shape."""
    h, i = config.hidden_size, config.intermediate_size
    q, kv = (
        config.num_attention_heads * config.head_dim,
        config.num_key_value_heads * config.head_dim,
    )
    per_layer = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
    }
    expected = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    for layer in range(config.num_hidden_layers):
        expected.update({f"model.layers.{layer}.{n}": s for n, s in per_layer.items()})
    if not config.tie_word_embeddings:
        expected["lm_head.weight"] = (config.vocab_size, h)
    found = reader.names() - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    for name, shape in expected.items():
        if name not in found:
            raise ValueError(f"{src}: the checkpoint lacks {name}")
        if reader.shape(name) != shape:
            raise ValueError(
                f"{src}: {name} has shape {list(reader.shape(name))}, the config says {list(shape)}"
            )
    extra = sorted(found - set(expected))
    if extra:
        raise ValueError(f"{src}: tensor {extra[0]} has no place in a Mixtral ({len(extra)} such)")


def mixtral_config(dense: Any, *, experts: int, top_k: int) -> Any:
    """The MixtralConfig of the upcycled model: the dense model's shape, `experts` experts of
    the dense intermediate size per layer, `top_k` of them per token, an untied output layer."""
    from transformers import MixtralConfig

    config = MixtralConfig(
        vocab_size=dense.vocab_size,
        hidden_size=dense.hidden_size,
        intermediate_size=dense.intermediate_size,
        num_hidden_layers=dense.num_hidden_layers,
        num_attention_heads=dense.num_attention_heads,
        num_key_value_heads=dense.num_key_value_heads,
        head_dim=dense.head_dim,
        hidden_act="silu",
        max_position_embeddings=dense.max_position_embeddings,
        initializer_range=dense.initializer_range,
        rms_norm_eps=dense.rms_norm_eps,
        attention_dropout=dense.attention_dropout,
        rope_parameters=dict(dense.rope_parameters),
        bos_token_id=dense.bos_token_id,
        eos_token_id=dense.eos_token_id,
        pad_token_id=dense.pad_token_id,
        tie_word_embeddings=False,
        sliding_window=None,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        output_router_logits=False,
        # Ember's trainer adds megatron-core's load-balancing loss whenever this is > 0
        # (MegatronWorker.train); an RL run turns it on deliberately, not through the import.
        router_aux_loss_coef=0.0,
        router_jitter_noise=0.0,
    )
    config.architectures = ["MixtralForCausalLM"]
    config.dtype = dense.dtype
    return config


def _layer_tensors(
    reader: _Reader, layer: int, *, experts: int, noise: float, router_std: float, seed: int
) -> Iterator[tuple[str, Any]]:
    """The Mixtral tensors of one decoder layer, drawn from a generator of its own (`seed`), so
    a layer's weights do not depend on how the layers are split into files."""
    import torch

    src, dst = f"model.layers.{layer}.", f"model.layers.{layer}.block_sparse_moe."
    for name in _LAYER_COPIES:
        yield src + name, reader.get(src + name)
    g = torch.Generator().manual_seed(seed)
    dense = {kind: reader.get(f"{src}mlp.{kind}_proj.weight") for kind in _EXPERT_NAMES}
    router = torch.randn(experts, dense["gate"].shape[1], generator=g, dtype=torch.float32)
    yield dst + "gate.weight", (router * router_std).to(dense["gate"].dtype)
    spread = {kind: float(w.float().std()) for kind, w in dense.items()}
    for e in range(experts):
        for kind, weight in dense.items():
            name = f"{dst}experts.{e}.{_EXPERT_NAMES[kind]}.weight"
            if noise == 0:
                yield name, weight.clone()
                continue
            z = torch.randn(weight.shape, generator=g, dtype=torch.float32)
            yield name, (weight.float() + (noise * spread[kind]) * z).to(weight.dtype)


def _nbytes(reader: _Reader, names: list[str], dtype_bytes: int) -> int:
    return sum(math.prod(reader.shape(n)) for n in names) * dtype_bytes


def _write_weights(
    reader: _Reader,
    dense: Any,
    out: Path,
    *,
    experts: int,
    noise: float,
    router_std: float,
    seed: int,
) -> int:
    """Write the Mixtral tensors to `out` (one or more safetensors files, whole layers per
    file); returns the number of parameters written."""
    import torch
    from safetensors.torch import save_file

    item = reader.get("model.norm.weight").element_size()
    layers = dense.num_hidden_layers
    # Per-layer seeds drawn up front: layer l's weights depend on (seed, l) only.
    seeds = torch.randint(2**62, (layers,), generator=torch.Generator().manual_seed(seed))
    sizes = []
    for layer in range(layers):
        copies = [f"model.layers.{layer}.{n}" for n in _LAYER_COPIES]
        mlp = [f"model.layers.{layer}.mlp.{k}_proj.weight" for k in _EXPERT_NAMES]
        sizes.append(
            _nbytes(reader, copies, item)
            + experts * _nbytes(reader, mlp, item)
            + experts * dense.hidden_size * item
        )
    edge = _nbytes(reader, ["model.embed_tokens.weight"], item)
    groups: list[list[int]] = [[]]
    used = edge
    for layer, size in enumerate(sizes):
        if groups[-1] and used + size > MAX_SHARD_BYTES:
            groups.append([])
            used = 0
        groups[-1].append(layer)
        used += size
    files = len(groups)
    weight_map: dict[str, str] = {}
    total_bytes = count = 0
    for index, group in enumerate(groups):
        tensors: dict[str, Any] = {}
        if index == 0:
            tensors["model.embed_tokens.weight"] = reader.get("model.embed_tokens.weight")
        for layer in group:
            tensors.update(
                _layer_tensors(
                    reader,
                    layer,
                    experts=experts,
                    noise=noise,
                    router_std=router_std,
                    seed=int(seeds[layer]),
                )
            )
        if index == files - 1:
            tensors["model.norm.weight"] = reader.get("model.norm.weight")
            head = "model.embed_tokens.weight" if dense.tie_word_embeddings else "lm_head.weight"
            tensors["lm_head.weight"] = reader.get(head).clone()
        name = (
            "model.safetensors"
            if files == 1
            else f"model-{index + 1:05d}-of-{files:05d}.safetensors"
        )
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        for key, tensor in tensors.items():
            weight_map[key] = name
            total_bytes += tensor.numel() * tensor.element_size()
            count += tensor.numel()
    if files > 1:
        index_json = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2) + "\n")
    return count


def _copy_tokenizer(src: Path, out: Path) -> bool:
    """Tokenizer and generation_config.json from `src`, with the token ids in config.json
    (`save_tokenizer_for_model`); False when `src` has no tokenizer."""
    if (src / "tokenizer_config.json").is_file() or (src / "tokenizer.json").is_file():
        from ember_rollout.tokenizer import save_tokenizer_for_model

        save_tokenizer_for_model(src, out)
        return True
    if (src / "generation_config.json").is_file():
        shutil.copyfile(src / "generation_config.json", out / "generation_config.json")
    return False


def _check_destination(dst: Path) -> None:
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"{dst}: exists and is not an empty directory; choose a new path")


def upcycle(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    experts: int = DEFAULT_EXPERTS,
    top_k: int = DEFAULT_TOP_K,
    noise: float = DEFAULT_NOISE,
    seed: int = 0,
    router_std: float = DEFAULT_ROUTER_STD,
) -> Upcycled:
    """Write a Mixtral checkpoint upcycled from the dense transformers checkpoint `src`.

    Every layer's MLP becomes `experts` noisy copies of itself behind a new router (see the
    module docstring); everything else is copied exactly, the output layer untied. The same
    arguments give the same files, bit for bit. The directory is written under a temporary
    name next to `dst` and renamed when complete.

    Args:
        src: Dense transformers checkpoint directory (`model_type` in `SUPPORTED`).
        dst: Output directory: new, or empty.
        experts: Experts per layer.
        top_k: Experts per token.
        noise: Relative std of each expert's weight noise; 0 makes exact copies.
        seed: Seed of the noise and the routers.
        router_std: Std of the routers' Gaussian init.

    Raises:
        ValueError: bad options, `dst` not empty, or `src` not a supported dense checkpoint
            (all checked before any weight is read).
        FileNotFoundError: `src` or its weights do not exist.
    """
    check_options(experts=experts, top_k=top_k, noise=noise, router_std=router_std)
    src, dst = Path(src), Path(dst)
    _check_destination(dst)
    dense = read_dense_config(src)
    reader = _Reader(src)
    _check_tensors(reader, dense, src)
    config = mixtral_config(dense, experts=experts, top_k=top_k)

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would outlive the rename
        count = _write_weights(
            reader, dense, tmp, experts=experts, noise=noise, router_std=router_std, seed=seed
        )
        config.save_pretrained(tmp)
        tokenizer = _copy_tokenizer(src, tmp)
        _check_destination(dst)
        if dst.exists():
            dst.rmdir()
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    active = count - layers * (experts - top_k) * 3 * h * i
    summary = (
        f"upcycled {dense.model_type} {src} ({layers} layers) to Mixtral: {experts} experts "
        f"(top-{top_k}) per layer, each the dense MLP plus noise {noise:g} x its std, routers "
        f"N(0, {router_std:g}^2), seed {seed}\n"
        f"{count / 1e6:.1f} M parameters ({active / 1e6:.1f} M active per token); lm_head "
        + ("untied: a copy of the embedding; " if dense.tie_word_embeddings else "copied; ")
        + ("tokenizer copied" if tokenizer else "no tokenizer in the source: none copied")
    )
    return Upcycled(dst, summary)
