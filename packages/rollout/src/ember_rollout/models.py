"""Models of the hf engine: the built-in tiny Qwen3-MoE, loading, MoE layers, HF-named weights."""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ember_rollout.config import TinyModelConfig
from ember_rollout.engine import ModelInfo
from ember_rollout.families import Family, checkpoint_naming, config_num_experts

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def tiny_model_config(
    tiny: TinyModelConfig,
    *,
    vocab_size: int,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
):
    """The transformers `Qwen3MoeConfig` for `tiny` (its vocab_size, if set, wins)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=tiny.vocab_size or vocab_size,
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        moe_intermediate_size=tiny.moe_intermediate_size,
        num_hidden_layers=tiny.num_layers,
        num_attention_heads=tiny.num_attention_heads,
        num_key_value_heads=tiny.num_key_value_heads,
        head_dim=tiny.head_dim,
        num_experts=tiny.num_experts,
        num_experts_per_tok=tiny.num_experts_per_tok,
        norm_topk_prob=True,
        mlp_only_layers=list(tiny.dense_layers),
        decoder_sparse_step=1,
        max_position_embeddings=tiny.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": tiny.rope_theta},
        tie_word_embeddings=tiny.tie_word_embeddings,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
    )


def build_tiny_model(
    tiny: TinyModelConfig,
    *,
    vocab_size: int,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
) -> nn.Module:
    """A randomly initialised Qwen3-MoE causal LM; the same `tiny.init_seed` gives the same weights.

    Weights are initialised in fp32 and then cast, so a bf16 and an fp32 engine start from the
    same values (up to rounding).
    """
    from transformers import Qwen3MoeForCausalLM

    config = tiny_model_config(
        tiny, vocab_size=vocab_size, eos_token_id=eos_token_id, pad_token_id=pad_token_id
    )
    config._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(tiny.init_seed)
        model = Qwen3MoeForCausalLM(config)
    return model.to(dtype).eval()


def load_model(
    path: str | Path, *, dtype: torch.dtype, attn_implementation: str = "sdpa"
) -> nn.Module:
    """Load a causal LM from a local HF directory (no hub access)."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"model_path={str(path)!r}: no config.json there (a local HF model dir)")
    refuse_quantized_export(path)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True
    )
    return model.eval()


def refuse_quantized_export(path: Path) -> None:
    """Refuse a checkpoint in the quantized formats Ember exports for SGLang (config.json
    `quantization_config`, `ember_rollout.sglang_quant`): the embedded engine loads full
    precision and quantizes itself (`engine.quantization`). transformers 5.19 would load one
    wrong or differently: a compressed-tensors INT4 export of a Qwen3-MoE leaves its experts
    randomly initialised ("MISSING" in its load report), and block FP8 is dequantised to the
    model dtype only without a GPU (with one it keeps FP8 layers the engine does not know).

    Raises:
        ValueError: One line naming the directory and its quant_method.
    """
    from ember_rollout.sglang_quant import METHODS, checkpoint_quantization

    qc = checkpoint_quantization(path)
    method = None if qc is None else qc.get("quant_method")
    if method in METHODS.values():
        raise ValueError(
            f"model_path={str(path)!r}: a quantized checkpoint (quantization_config quant_method="
            f"{method!r}, as Ember exports for SGLang servers); the embedded engine loads full "
            "precision and quantizes it itself (engine.quantization): point it at a "
            "full-precision checkpoint (`ember convert` of the run's checkpoint)"
        )


def write_tiny_checkpoint(
    path: str | Path,
    tiny: TinyModelConfig,
    *,
    tokenizer=None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Save the built-in model (and a tokenizer, default the toy one) as an HF model directory.

    The trainer and the engine can then start from the same weights by loading this directory.
    """
    from ember_rollout.tokenizer import toy_tokenizer

    tokenizer = tokenizer if tokenizer is not None else toy_tokenizer()
    model = build_tiny_model(
        tiny,
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype=dtype,
    )
    path = Path(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# --------------------------------------------------------------------------------------------
# MoE layers
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MoESite:
    """One MoE layer: its decoder layer index, router module and experts module."""

    layer: int
    router: nn.Module
    experts: nn.Module


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def find_routers(model: nn.Module) -> list[MoESite]:
    """Every MoE layer of `model`, in layer order.

    Routers are the modules of the class transformers records for `output_router_logits` (the
    model's `_can_record_outputs["router_logits"]`), else modules named `layers.N.mlp.gate`; the
    experts module is the router's sibling `experts`, which the MoE block calls with the ids it
    selected (see `routing.ExpertCapture`).

    Raises:
        ValueError: Two routers in one layer, or a router without a sibling `experts` module.
    """
    recorder = getattr(model, "_can_record_outputs", None) or {}
    spec = recorder.get("router_logits")
    target = getattr(spec, "target_class", spec if isinstance(spec, type) else None)
    sites: list[MoESite] = []
    for name, module in model.named_modules():
        match = _LAYER_INDEX.search(name)
        if match is None:
            continue
        hit = isinstance(module, target) if target is not None else name.endswith(".mlp.gate")
        if not hit:
            continue
        block = model.get_submodule(name.rpartition(".")[0])
        experts = getattr(block, "experts", None)
        if not isinstance(experts, nn.Module):
            raise ValueError(
                f"{type(model).__name__}: the MoE block {name.rpartition('.')[0]!r} has no "
                "`experts` module to record routed experts from"
            )
        sites.append(MoESite(int(match.group(1)), module, experts))
    layers = [s.layer for s in sites]
    if len(set(layers)) != len(layers):
        raise ValueError(f"found several routers in one layer ({layers}); cannot map to layers")
    return sorted(sites, key=lambda s: s.layer)


def model_info(model: nn.Module) -> ModelInfo:
    """Layers, experts and context length of a transformers causal LM.

    MoE layers are those with a router module; experts per layer come from whichever of
    `num_experts`, `num_local_experts`, `n_routed_experts` the config has.
    """
    config = model.config
    config = getattr(config, "text_config", None) or config
    routers = find_routers(model)
    eos = config.eos_token_id if hasattr(config, "eos_token_id") else None
    generation = getattr(model, "generation_config", None)
    gen_eos = getattr(generation, "eos_token_id", None)
    eos_ids = {e for v in (eos, gen_eos) for e in ([v] if isinstance(v, int) else v or [])}
    return ModelInfo(
        num_layers=int(config.num_hidden_layers),
        topk=int(getattr(config, "num_experts_per_tok", 0) or 0) if routers else 0,
        num_experts=(config_num_experts(config) or 0) if routers else 0,
        moe_layers=tuple(s.layer for s in routers),
        vocab_size=int(config.vocab_size),
        context_len=int(getattr(config, "max_position_embeddings", 0) or 1 << 30),
        eos_token_ids=tuple(sorted(eos_ids)),
    )


def cache_kwarg(model: nn.Module) -> str:
    """Name of the forward argument taking the KV cache (`cache` in newer transformers)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


# --------------------------------------------------------------------------------------------
# Weights by HF checkpoint name
# --------------------------------------------------------------------------------------------

_QUANTIZED = re.compile(r"\.weight_(?:scale_inv|scale|packed|shape)$")
"""Checkpoint names of the tensors that hold a quantized weight besides its values."""
_QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.int32, torch.int64)
"""Dtypes only a quantized weight's tensors have."""

_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")


def naming_of(model: nn.Module) -> Family:
    """The checkpoint naming of `model`'s family (from its config's `model_type`)."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    return checkpoint_naming(getattr(config, "model_type", None))


def _locate(
    state: dict[str, torch.Tensor], name: str, naming: Family
) -> tuple[str, int | None, str | None] | None:
    """Where checkpoint tensor `name` goes: (state-dict name, expert, gate/up/down) for a
    per-expert tensor, (state-dict name, None, None) otherwise, None if nowhere."""
    if name in state:
        return name, None, None
    if naming.moe_block != "mlp":  # then checkpoint names must use the family's block name
        block = f".{naming.moe_block}."
        if block not in name:
            return None
        name = name.replace(block, ".mlp.")
        if name in state:
            return name, None, None
    match = _EXPERT.match(name)
    if match is None or match["proj"] not in naming.expert_projections:
        return None
    proj = naming.expert_projections[match["proj"]]
    fused = f"{match['prefix']}.{'down' if proj == 'down' else 'gate_up'}_proj"
    return (fused, int(match["expert"]), proj) if fused in state else None


def _checkpoint_name(name: str, naming: Family) -> str:
    """The checkpoint name of state-dict tensor `name` (not a fused expert tensor)."""
    return name.replace(".mlp.", f".{naming.moe_block}.") if naming.moe_block != "mlp" else name


def iter_checkpoint(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in the safetensors files of an HF checkpoint directory."""
    from safetensors import safe_open

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files to load weights from")
    for file in files:
        with safe_open(str(path / file), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


@torch.no_grad()
def load_hf_weights(model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy tensors named as in an HF checkpoint into `model`'s parameters and buffers, in place.

    Names are either the model's own state-dict names, or its family's checkpoint names (see
    `ember_rollout.families`): per-expert tensors (`...experts.{e}.gate_proj.weight`, `up_proj`,
    `down_proj`; Mixtral `block_sparse_moe.experts.{e}.w1/w3/w2.weight`), which transformers
    stores fused as `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I], and
    Mixtral's `block_sparse_moe.*` for transformers' `mlp.*`.

    Returns:
        How many tensors were loaded.

    Raises:
        ValueError: An unknown name or a shape mismatch; nothing is half-copied for that tensor.
    """
    state = model.state_dict(keep_vars=True)
    naming = naming_of(model)
    count = 0
    for name, tensor in named_tensors:
        target, value = _resolve(state, name, tensor, naming)
        # copy_ on the parameter itself, not on `.data`: it bumps the version counter that
        # tells a `PackedLinear` its packed copy is stale.
        target.copy_(value.to(device=target.device, dtype=target.dtype))
        count += 1
    return count


def served_tensor(model: nn.Module, name: str, shape: Sequence[int]) -> torch.Tensor | None:
    """What `model` serves for checkpoint tensor `name` of `shape` (a view into a fused expert
    tensor for a per-expert name), or None where nothing of that shape goes by that name."""
    state = model.state_dict(keep_vars=True)
    try:
        empty = torch.empty(tuple(shape), device="meta")
        view, _ = _resolve(state, name, empty, naming_of(model), dtypes=False)
    except ValueError:
        return None
    return view.detach()


def _resolve(
    state: dict[str, torch.Tensor],
    name: str,
    tensor: torch.Tensor,
    naming: Family | None = None,
    *,
    dtypes: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The destination view for checkpoint tensor `name` and the value to copy into it.

    `naming` is the model's family (`naming_of(model)`); None: per-expert names under `mlp`.
    `dtypes`: refuse a quantized weight's tensor of another dtype than the model holds (and a
    `weight_shape` of other values); False checks names and shapes only.
    """
    where = _locate(state, name, naming or checkpoint_naming(None))
    if where is None:
        known = [n for n in state if not n.endswith("inv_freq")][:5]
        raise ValueError(
            f"weight {name!r} matches no parameter of the model (e.g. {', '.join(known)}, ...)"
        )
    key, expert, proj = where
    target = state[key]
    if expert is None:
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"weight {name!r}: shape {tuple(tensor.shape)} does not match the model's "
                f"{tuple(target.shape)}"
            )
        quantized = (
            _QUANTIZED.search(name) is not None
            or target.dtype in _QUANTIZED_DTYPES
            or tensor.dtype in _QUANTIZED_DTYPES
        )
        if dtypes and quantized and target.dtype != tensor.dtype:
            raise ValueError(
                f"weight {name!r}: dtype {tensor.dtype} where the engine's quantized model holds "
                f"{target.dtype} (engine.quantization: the sender must quantize as the engine "
                "serves, ember_core.quant)"
            )
        if (
            dtypes
            and name.endswith(".weight_shape")
            and not torch.equal(tensor.cpu(), target.cpu())
        ):
            raise ValueError(
                f"weight {name!r}: {tensor.tolist()} is not the engine's {target.tolist()}"
            )
        return target, tensor
    if not 0 <= expert < target.shape[0]:
        raise ValueError(f"weight {name!r}: expert {expert} >= {target.shape[0]} experts")
    slot = target[expert]
    if proj != "down":
        rows = tensor.shape[0]
        if slot.shape[0] == 2 * rows:
            slot = slot[:rows] if proj == "gate" else slot[rows:]
        elif slot.shape[1] == 2 * rows:  # fused as [E, H, 2I]
            slot = (slot[:, :rows] if proj == "gate" else slot[:, rows:]).T
        else:
            slot = None
    elif tuple(slot.shape) != tuple(tensor.shape) and tuple(slot.T.shape) == tuple(tensor.shape):
        slot = slot.T
    if slot is None or tuple(slot.shape) != tuple(tensor.shape):
        raise ValueError(
            f"weight {name!r}: shape {tuple(tensor.shape)} does not fit the fused "
            f"expert tensor of shape {tuple(target.shape)}"
        )
    return slot, tensor


def _names_list(names: Sequence[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def check_update_names(model: nn.Module, names: Sequence[str], *, partial: bool = False) -> None:
    """Check the names of a weight update against `model` before anything is copied.

    Args:
        model: The transformers model the update is for.
        names: HF checkpoint names: the model's own state-dict names or its family's
            checkpoint names (see `load_hf_weights`).
        partial: Allow leaving tensors out.

    Raises:
        ValueError: A name matches no tensor, or (unless `partial`) a parameter or a saved
            buffer (such as DeepSeek's `e_score_correction_bias`, which routing depends on) is
            missing; the missing ones are named as the family's checkpoint names them.
    """
    state = model.state_dict(keep_vars=True)
    naming = naming_of(model)
    covered: set[str] = set()
    experts: dict[str, set[int]] = {}  # fused tensor -> slots covered (2e gate / 2e+1 up; e down)
    unknown = []
    for name in names:
        where = _locate(state, name, naming)
        if where is None:
            unknown.append(name)
        elif where[1] is None:
            covered.add(where[0])
        else:
            key, expert, proj = where
            experts.setdefault(key, set()).add(2 * expert + (proj == "up"))
    if unknown:
        raise ValueError(
            f"weight update: {_names_list(unknown)} match no parameter of the engine's model "
            f"(its parameters include {_names_list([n for n, _ in model.named_parameters()], 3)})"
        )
    if partial:
        return
    required = [*(n for n, _ in model.named_parameters()), *(n for n, _ in model.named_buffers())]
    projections = {proj: ours for ours, proj in naming.expert_projections.items()}
    missing = []
    for name in dict.fromkeys(required):  # tied weights appear once
        if name in covered or name not in state:  # not saved: non-persistent buffers
            continue
        match = re.fullmatch(r"(?P<prefix>.+\.experts)\.(?P<which>gate_up|down)_proj", name)
        if match is None:
            missing.append(_checkpoint_name(name, naming))
            continue
        have = experts.get(name, set())
        prefix = _checkpoint_name(match["prefix"] + ".", naming)
        for e in range(state[name].shape[0]):
            for proj in ("down",) if match["which"] == "down" else ("gate", "up"):
                if 2 * e + (proj == "up") not in have:
                    missing.append(f"{prefix}{e}.{projections[proj]}.weight")
    if missing:
        raise ValueError(
            f"weight update leaves out {_names_list(missing)}: every parameter of the engine's "
            "model must be sent (partial=True loads a subset)"
        )
