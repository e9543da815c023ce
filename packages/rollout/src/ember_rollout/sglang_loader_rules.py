"""sglang 0.5.23's loader rules for quantized checkpoints and pushes, as checks that run on CPU.

The rules come from reading its fp8, compressed-tensors and Marlin code (see
`ember_rollout.sglang_quant`); each message names the file and lines.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ember_core import quant
from ember_rollout.sglang_quant import (
    CASTS,
    SKIPS,
    Q,
    TensorTable,
    check_config,
    rule_broken,
    served_dtype_of,
    stricter_than_sglang,
)

__all__ = ["check_push", "check_session", "check_sglang_quantized"]

_COLUMN = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3", "q_b_proj"}
_COLUMN |= {"kv_b_proj", "qkv_proj"}
_ROW = {"o_proj", "down_proj", "w2", "dense"}
_FUSED = (
    {"q_proj", "k_proj", "v_proj"},
    {"gate_proj", "up_proj"},
    {"q_a_proj", "kv_a_proj_with_mqa"},
)
"""Checkpoint projections sglang loads into one fused layer (qkv_proj, gate_up_proj, DeepSeek's
fused_qkv_a_proj_with_mqa): all shards share one quant method and one block grid."""
_EXPERT_UP = {"gate_proj", "up_proj", "w1", "w3"}

_SUFFIXES = {
    "fp8_block": ("weight", "weight_scale_inv"),
    "int4_w4a16": ("weight_packed", "weight_scale", "weight_shape"),
}


def _fp8_ignored(module: str, ignored: list[str]) -> bool:
    """sglang's `is_layer_skipped` for one checkpoint module (utils.py:48-59, fp8.py:354-364:
    entries with and without `model.`, matched on dotted module-path boundaries)."""
    for entry in ignored:
        base = entry.removeprefix("model.")
        for name in (base, f"model.{base}"):
            if module == name or module.startswith(name + ".") or f".{name}." in f".{module}.":
                return True
    return False


def _ct_ignored(module: str, ignore: list[str]) -> bool:
    """compressed-tensors' `check_equal_or_regex_match` (compressed_tensors/utils.py:78-100):
    equal, `re:` + re.match, or a dotted suffix; never a prefix."""
    for entry in ignore:
        if entry.startswith("re:"):
            if re.match(entry[3:], module):
                return True
        elif module == entry or module.endswith("." + entry):
            return True
    return False


def _is_ignored(module: str, qc: Mapping) -> bool:
    if qc["quant_method"] == "fp8":
        return _fp8_ignored(
            module, qc.get("ignored_layers", qc.get("modules_to_not_convert")) or []
        )
    return _ct_ignored(module, qc.get("ignore") or [])


def _group(names: Iterable[str]) -> dict[str, dict[str, str]]:
    """Checkpoint module -> {suffix: name} of the linear projections among `names`."""
    modules: dict[str, dict[str, str]] = {}
    for name in names:
        module, _, suffix = name.rpartition(".")
        if module and quant.is_target(module + ".weight", "linear"):
            modules.setdefault(module, {})[suffix] = name
    return modules


def check_sglang_quantized(
    tensors: TensorTable,
    config: Mapping[str, Any],
    *,
    tp_size: int = 1,
    dtype: torch.dtype | None = None,
    partial: bool = False,
    updates: bool = True,
) -> None:
    """Hold a quantized checkpoint (or, `partial`, the tensors of one push) to sglang 0.5.23's
    loader rules for the scheme config.json `config` names in its `quantization_config`: names
    and suffixes, dtypes, the shapes of weights and scales, and what the kernels need of every
    dimension on each of `tp_size` tensor-parallel ranks (no expert parallelism).

    Args:
        tensors: Checkpoint name -> (dtype, shape).
        config: The checkpoint's config.json (its `quantization_config`, head counts, dtype).
        tp_size: The server's --tp-size.
        dtype: The dtype the server computes in (default: `served_dtype_of(config)`).
        partial: `tensors` is part of a model (a bucket): a weight's other tensors may be in
            another push, and shape rules that need the whole weight are left to the model's.
        updates: The server will take weight updates (Ember's pushes), not only load.

    Raises:
        LoaderRuleError: The first rule broken, one line naming the tensor and the rule.
    """
    qc = config.get("quantization_config")
    spec = check_config(qc)
    served = dtype or served_dtype_of(config)
    scheme = spec.scheme
    if scheme == "int4_w4a16" and served not in (torch.bfloat16, torch.float16):
        rule_broken(
            "int4_w4a16",
            f"served in {served}: Marlin's MoE GEMM takes float16 and bfloat16 activations only",
            "srt/layers/moe/fused_moe_triton/fused_marlin_moe.py:211",
        )
    modules = _group(tensors)
    projected = {name for sfx in modules.values() for name in sfx.values()}
    for name, (tensor_dtype, _) in tensors.items():
        if name in projected:
            continue
        suffix = name.rpartition(".")[2]
        if suffix in _SUFFIXES["fp8_block"][1:] + _SUFFIXES["int4_w4a16"]:
            stricter_than_sglang(
                name, "a quantized tensor of a layer sglang does not quantize", SKIPS
            )
        if tensor_dtype.is_floating_point and tensor_dtype != served:
            stricter_than_sglang(
                name, f"{tensor_dtype} where the model computes in {served}", CASTS
            )
    quantized = {m: not _is_ignored(m, qc) for m in modules}
    _check_uniform(quantized)
    for module, suffixes in sorted(modules.items()):
        if quantized[module]:
            _check_quantized_tensors(module, suffixes, tensors, spec, served, partial)
        else:
            _check_plain_tensors(module, suffixes, tensors, served, partial)
    if partial:
        return
    for module, suffixes in sorted(modules.items()):
        if quantized[module]:
            _check_dims(module, suffixes, tensors, spec, config, tp_size, updates)


def _check_uniform(quantized: Mapping[str, bool]) -> None:
    """Every shard of a fused layer, and every projection of a MoE layer's experts, quantized
    alike."""
    fused: dict[tuple[str, int], dict[str, bool]] = {}
    experts: dict[str, dict[str, bool]] = {}
    for module, q in quantized.items():
        parent, _, proj = module.rpartition(".")
        if ".experts." in module:
            experts.setdefault(module.split(".experts.")[0], {})[module] = q
            continue
        for i, shards in enumerate(_FUSED):
            if proj in shards:
                fused.setdefault((parent, i), {})[module] = q
    for (parent, i), shards in fused.items():
        if len(set(shards.values())) > 1:
            rule_broken(
                parent,
                f"some but not all of the fused shards {sorted(_FUSED[i])} are quantized "
                f"(ignored: {sorted(m for m, q in shards.items() if not q)})",
                f"{Q}/utils.py:96-105, compressed_tensors/utils.py:57-66",
            )
    for layer, members in experts.items():
        if len(set(members.values())) > 1:
            rule_broken(
                layer + ".experts",
                "All MoE projections need to have same quantization scheme but found multiple",
                f"{Q}/compressed_tensors/compressed_tensors.py:888-895; fp8.py:408-414 takes "
                "one method for the whole FusedMoE",
            )


def _check_quantized_tensors(module, suffixes, tensors, spec, served, partial) -> None:
    wanted = _SUFFIXES[spec.scheme]
    source = (
        f"{Q}/fp8.py:653-714"
        if spec.scheme == "fp8_block"
        else f"{Q}/compressed_tensors/schemes/compressed_tensors_wNa16.py:131-206"
    )
    for suffix, name in suffixes.items():
        if suffix not in (*wanted, "bias"):
            what = "a full-precision weight" if suffix == "weight" else f"suffix .{suffix}"
            takes = ", ".join("." + s for s in wanted)
            stricter_than_sglang(name, f"{what} where the {spec.scheme} layer takes {takes}", SKIPS)
    missing = [s for s in wanted if s not in suffixes]
    if missing and not partial:
        rule_broken(
            f"{module}.{missing[0]}",
            f"missing: the {spec.scheme} layer takes {', '.join(wanted)}",
            source,
        )
    if spec.scheme == "fp8_block":
        expect = {"weight": torch.float8_e4m3fn, "weight_scale_inv": torch.float32}
    else:
        expect = {"weight_packed": torch.int32, "weight_scale": served, "weight_shape": torch.int64}
    for suffix, want in expect.items():
        if suffix in suffixes and tensors[suffixes[suffix]][0] != want:
            got = tensors[suffixes[suffix]][0]
            stricter_than_sglang(
                suffixes[suffix], f"{got} where the {spec.scheme} layer holds {want}", CASTS
            )
    if "bias" in suffixes and tensors[suffixes["bias"]][0] != served:
        got = tensors[suffixes["bias"]][0]
        stricter_than_sglang(suffixes["bias"], f"{got} where the model computes in {served}", CASTS)
    g = spec.group_size
    if spec.scheme == "fp8_block":
        if "weight" in suffixes and "weight_scale_inv" in suffixes:
            rows, cols = tensors[suffixes["weight"]][1]
            want = (math.ceil(rows / g), math.ceil(cols / g))
            got = tensors[suffixes["weight_scale_inv"]][1]
            if tuple(got) != want:
                rule_broken(
                    suffixes["weight_scale_inv"],
                    f"shape {tuple(got)}, a weight of {(rows, cols)} in {g}x{g} blocks takes "
                    f"{want}: Attempted to load weight into parameter",
                    f"{Q}/fp8.py:653-714, layers/parameter.py:110",
                )
        return
    if "weight_shape" in suffixes and tuple(tensors[suffixes["weight_shape"]][1]) != (2,):
        rule_broken(
            suffixes["weight_shape"],
            f"shape {tensors[suffixes['weight_shape']][1]}, expected (2,)",
            "layers/parameter.py:110",
        )
    if "weight_packed" in suffixes and "weight_scale" in suffixes:
        rows, words = tensors[suffixes["weight_packed"]][1]
        cols = words * 8
        want = (rows, cols // g)
        got = tuple(tensors[suffixes["weight_scale"]][1])
        if got != want:
            rule_broken(
                suffixes["weight_scale"],
                f"shape {got}, a packed weight of {(rows, words)} ({cols} inputs) in groups of "
                f"{g} takes {want}: Attempted to load weight into parameter",
                f"{Q}/compressed_tensors/schemes/compressed_tensors_wNa16.py:131-206, "
                "layers/parameter.py:110",
            )


def _check_plain_tensors(module, suffixes, tensors, served, partial) -> None:
    for suffix, name in suffixes.items():
        if suffix not in ("weight", "bias"):
            stricter_than_sglang(
                name, f"a quantized tensor of {module}, which the config leaves unquantized", SKIPS
            )
        if tensors[name][0] != served:
            # An ignored layer is UnquantizedLinearMethod (fp8.py:397-415): model dtype.
            stricter_than_sglang(
                name,
                f"{tensors[name][0]} in an unquantized layer, which computes in {served}",
                CASTS,
            )
    if "weight" not in suffixes and not partial:
        rule_broken(f"{module}.weight", "missing", "model_loader/weight_utils.py:1582-1586")


def _kind(module: str) -> str:
    proj = module.rpartition(".")[2]
    if ".experts." in module:
        return "expert_up" if proj in _EXPERT_UP else "expert_down"
    if proj in _COLUMN:
        return "column"
    if proj in _ROW:
        return "row"
    return "replicated"


def _per_rank(subject: str, size: int, tp: int, what: str) -> int:
    if size % tp:
        rule_broken(
            subject,
            f"{what} {size} does not split over tp_size {tp}: {size} is not divisible by {tp}",
            "srt/distributed/utils.py:68-79",
        )
    return size // tp


def _check_dims(module, suffixes, tensors, spec, config, tp, updates) -> None:
    """What the kernels need of each dimension on each rank."""
    g = spec.group_size
    if spec.scheme == "fp8_block":
        rows, cols = tensors[suffixes["weight"]][1]
    else:
        rows, cols = (
            tensors[suffixes["weight_packed"]][1][0],
            tensors[suffixes["weight_packed"]][1][1] * 8,
        )
    kind = _kind(module)
    proj = module.rpartition(".")[2]
    subject = f"{module} ({rows}x{cols}, tp_size {tp})"
    # sglang checks the shards of QKVParallelLinear and MergedColumnParallelLinear.
    fused = kind != "expert_up" and any(proj in shards for shards in _FUSED[:2])
    if kind == "column":
        kv = config.get("num_key_value_heads")
        if proj in ("k_proj", "v_proj") and isinstance(kv, int) and tp >= kv:
            if tp % kv:
                rule_broken(
                    subject,
                    f"{kv} key/value heads cannot be replicated over tp_size {tp}",
                    "srt/layers/linear.py:1138-1145",
                )
            out_pp, in_pp = rows // kv, cols
        else:
            out_pp, in_pp = _per_rank(subject, rows, tp, "output size"), cols
    elif kind == "row":
        out_pp, in_pp = rows, _per_rank(subject, cols, tp, "input size")
    elif kind == "replicated":
        out_pp, in_pp = rows, cols
    elif kind == "expert_up":
        out_pp, in_pp = _per_rank(subject, rows, tp, "expert intermediate size"), cols
    else:
        out_pp, in_pp = rows, _per_rank(subject, cols, tp, "expert intermediate size")
    if spec.scheme == "fp8_block":
        _fp8_dims(subject, kind, fused, out_pp, in_pp, g, tp)
    else:
        _int4_dims(subject, kind, out_pp, in_pp, g, updates)


def _fp8_dims(subject, kind, fused, out_pp, in_pp, g, tp) -> None:
    if kind.startswith("expert"):
        inter = out_pp if kind == "expert_up" else in_pp
        if inter % g:
            rule_broken(
                subject,
                f"The output_size of gate's and up's weight = {inter} is not divisible by "
                f"weight quantization block_n = {g}.",
                f"{Q}/fp8.py:1588-1593",
            )
    elif (fused or (kind == "column" and tp > 1)) and out_pp % g:
        rule_broken(
            subject,
            f"Weight output_partition_size = {out_pp} is not divisible by weight "
            f"quantization block_n = {g}.",
            f"{Q}/fp8.py:600-610",
        )
    if in_pp % g:
        # Row-parallel layers hit fp8.py:592-598 at load; every layer hits the activation quant.
        rule_broken(
            subject,
            f"input size per rank {in_pp} is not divisible by the block {g}: activations are "
            "quantized per token in groups of the block, and the last dimension of `x` must "
            "be divisible by `group_size`",
            f"kernels/ops/quantization/fp8_kernel.py:252-254, {Q}/fp8.py:592-598",
        )


def _int4_dims(subject, kind, out_pp, in_pp, g, updates) -> None:
    ct = f"{Q}/compressed_tensors/schemes"
    if not kind.startswith("expert"):
        if updates:
            rule_broken(
                subject,
                "a dense INT4 layer cannot take weight updates: after loading, sglang replaces "
                "weight_packed and weight_scale by Marlin-layout parameters without weight "
                "loaders and has no restore, so a push (or end_weight_update's transform) "
                "fails; quantize the routed experts only (engine.quantization_targets=experts)",
                f"{ct}/compressed_tensors_wNa16.py:234-249, {Q}/utils.py:199-219",
            )
        rules = (
            (out_pp, 64, "output_size_per_partition", "min_thread_n"),
            (in_pp, 128, "input_size_per_partition", "min_thread_k"),
        )
        for size, unit, what, name in rules:
            if size % unit:
                rule_broken(
                    subject,
                    f"Weight {what} = {size} is not divisible by  {name} = {unit}.",
                    f"{Q}/marlin_utils.py:161-177, enforced only in "
                    "kernels/jit/csrc/gemm/marlin/gptq_marlin_repack.cuh:305-316",
                )
        if in_pp % g:
            rule_broken(
                subject,
                f"input size per rank {in_pp} is not divisible by group_size {g}",
                f"{ct}/compressed_tensors_wNa16.py:125-129",
            )
        return
    # Marlin MoE: w13 is K=H, N=2I/tp; w2 is K=I/tp, N=H (compressed_tensors_wNa16_moe.py:351-365).
    hidden, inter = (in_pp, out_pp) if kind == "expert_up" else (out_pp, in_pp)
    rules = (
        (
            hidden,
            16,
            "hidden size (w13's size_k)",
            "hardware_backend/gpu/quantization/gptq_kernels.py:70",
        ),
        (
            inter,
            16,
            "expert intermediate size per rank (w2's size_k)",
            "hardware_backend/gpu/quantization/gptq_kernels.py:70",
        ),
        (
            2 * inter,
            64,
            "w13's size_n (2 x intermediate per rank)",
            "kernels/jit/csrc/gemm/marlin/gptq_marlin_repack.cuh:305-316",
        ),
        (
            hidden,
            64,
            "w2's size_n (hidden size)",
            "kernels/jit/csrc/gemm/marlin/gptq_marlin_repack.cuh:305-316",
        ),
        (
            hidden,
            g,
            "hidden size (w13's scale groups)",
            f"{ct}/compressed_tensors_wNa16_moe.py:156-159",
        ),
        (
            inter,
            g,
            "expert intermediate size per rank (w2's scale groups)",
            f"{ct}/compressed_tensors_wNa16_moe.py:156-159",
        ),
    )
    for size, unit, what, source in rules:
        if size % unit:
            rule_broken(subject, f"{what} {size} is not divisible by {unit}", source)


def check_push(pushed: TensorTable, model: TensorTable) -> None:
    """Hold pushed tensors to the model a server loaded: known names, the same shapes (sglang
    asserts them) and dtypes (sglang casts them silently).

    Raises:
        LoaderRuleError: One line naming the first tensor that does not fit.
    """
    for name, (dtype, shape) in pushed.items():
        have = model.get(name)
        if have is None:
            stricter_than_sglang(name, "no such tensor in the served model", SKIPS)
        if tuple(shape) != tuple(have[1]):
            rule_broken(
                name,
                f"Attempted to load weight ({torch.Size(shape)}) into parameter "
                f"({torch.Size(have[1])})",
                "model_loader/weight_utils.py:1582-1585, layers/parameter.py:110",
            )
        if dtype != have[0]:
            stricter_than_sglang(name, f"{dtype} into a tensor of {have[0]}", CASTS)


def check_session(pushed: Iterable[str], model: TensorTable, config: Mapping[str, Any]) -> None:
    """At the end of a weight-update session: under compressed-tensors every INT4 expert's
    weight_packed and weight_scale must have been sent again. `restore_weights_before_loading`
    resizes the Marlin-repacked tensors back without undoing the repack, and
    `end_weight_update` repacks every MoE layer again (compressed_tensors_wNa16_moe.py:282-304,
    406-418), so an expert not resent is silently corrupted.

    Raises:
        LoaderRuleError: One line naming a tensor that was not resent.
    """
    qc = config.get("quantization_config") or {}
    if qc.get("quant_method") != "compressed-tensors":
        return
    sent = set(pushed)
    for name in sorted(model):
        if (
            ".experts." in name
            and name.endswith((".weight_packed", ".weight_scale"))
            and name not in sent
        ):
            stricter_than_sglang(
                name,
                "not resent in this weight-update session: every session must resend all INT4 "
                "expert weights and scales",
                "repacks the stale Marlin bytes again and corrupts the expert "
                f"({Q}/compressed_tensors/schemes/compressed_tensors_wNa16_moe.py:282-304, "
                "406-418)",
            )
