"""Quantized checkpoints for SGLang: the `quantization_config` Ember exports, and sglang 0.5.23's
loader rules for them as checks that run on CPU.

Both schemes of `ember_core.quant` map onto a loader SGLang already has, which reads the scheme
from the checkpoint's config.json (`srt/configs/model_config.py:2104-2107`, `_verify_quantization`):

- `fp8_block` -> `"quant_method": "fp8"` with `weight_block_size` (DeepSeek-V3's layout: an
  e4m3 `weight` and an fp32 `weight_scale_inv` per linear layer, `Fp8Config`);
- `int4_w4a16` -> `"quant_method": "compressed-tensors"`, format `pack-quantized` (int32
  `weight_packed`, `weight_scale`, int64 `weight_shape`, `CompressedTensorsWNA16` and its MoE
  variant). `moe_wna16` is not used: it takes GPTQ/AWQ checkpoints only (moe_wna16.py:137-161).

Neither kernel runs on CPU (`check_device`). Most loader rules fail only inside CUDA kernels or
not at all (sglang skips unknown tensor names and casts dtypes silently), so
`ember_rollout.sglang_loader_rules` holds an export, or a push, to all of them here. Each message
names the sglang file and lines (under `site-packages/sglang/`) the rule comes from; where sglang
would accept silently, the message says the check is stricter than sglang (`LoaderRuleError`).
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ember_core import quant
from ember_core.quant import QuantSpec

__all__ = [
    "METHODS",
    "LoaderRuleError",
    "Served",
    "check_attached",
    "checkpoint_quantization",
    "check_config",
    "check_device",
    "describe",
    "export_layout",
    "ignored_modules",
    "launch_quantization",
    "quantization_config",
    "served_dtype_of",
    "server_quantization",
    "table",
]

SGLANG = "sglang 0.5.23"
Q = "srt/layers/quantization"

METHODS = {"fp8_block": "fp8", "int4_w4a16": "compressed-tensors"}
"""Ember's scheme -> the `quant_method` (and `--quantization`) SGLang serves it with
(srt/layers/quantization/__init__.py:63-92)."""

MARLIN_GROUP_SIZES = (32, 64, 128)
"""INT4 group sizes the Marlin kernels are built for (marlin_utils.py:44, less -1: Ember's
groups never span a whole row)."""

TensorTable = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]
"""Checkpoint name -> (dtype, shape): what a rule needs of a tensor."""


class LoaderRuleError(ValueError):
    """A checkpoint or a push that sglang 0.5.23's loader refuses, or would load wrong."""


CASTS = "casts it silently (layers/parameter.py:109-111, model_loader/weight_utils.py:1586)"
SKIPS = "skips a name its model lacks (models/qwen3_moe.py:1224-1225)"


def rule_broken(subject: str, what: str, source: str) -> None:
    """Raise one line: the subject, what is wrong, and the sglang rule's file:line."""
    raise LoaderRuleError(f"{subject}: {what} ({SGLANG} {source})")


def stricter_than_sglang(subject: str, what: str, sglang_does: str) -> None:
    """Raise one line for what sglang would take without a word (`sglang_does` says how):
    loaded, it would serve wrong weights, so the check is stricter than sglang."""
    raise LoaderRuleError(f"{subject}: {what} (stricter than {SGLANG}, which {sglang_does})")


def table(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, tuple[torch.dtype, tuple]]:
    """The (dtype, shape) of each named tensor."""
    return {name: (t.dtype, tuple(t.shape)) for name, t in named}


def describe(spec: QuantSpec | None) -> str:
    """`spec` in words: "fp8_block, group size 128, targets linear", or "full precision"."""
    if spec is None:
        return "full precision"
    return f"{spec.scheme}, group size {spec.group_size}, targets {spec.targets}"


def ignored_modules(spec: QuantSpec, names: Iterable[str]) -> list[str]:
    """The module names (`model.layers.0.self_attn.q_proj`) of the linear projections sglang
    would quantize but `spec` leaves in full precision: every non-expert one under
    targets=experts, none under targets=linear (routers, embeddings and the output layer are
    not quantizable linears in sglang's families: qwen3_moe.py:285-296, mixtral.py:85-92)."""
    return sorted(
        {
            n.removesuffix(".weight")
            for n in names
            if quant.is_target(n, "linear") and not quant.is_target(n, spec.targets)
        }
    )


def quantization_config(spec: QuantSpec, names: Iterable[str]) -> dict[str, Any]:
    """config.json's `quantization_config` for a checkpoint of `names` quantized under `spec`,
    with the keys sglang reads: `Fp8Config.from_config` (fp8.py:346-381), or
    `CompressedTensorsConfig.from_config` (compressed_tensors.py:282-318, 342-401)."""
    ignored = ignored_modules(spec, names)
    g = spec.group_size
    if spec.scheme == "fp8_block":
        return {
            "quant_method": METHODS[spec.scheme],
            "activation_scheme": "dynamic",
            "weight_block_size": [g, g],
            "ignored_layers": ignored,
        }
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": True,
        "strategy": "group",
        "group_size": g,
        "dynamic": False,
        "actorder": None,
    }
    return {
        "quant_method": METHODS[spec.scheme],
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}
        },
        "ignore": ignored,
    }


def check_config(qc: Any) -> QuantSpec:
    """The scheme and group size of an Ember-readable `quantization_config` (targets from its
    ignore list: empty is linear, else experts), after sglang's parsing rules.

    Raises:
        LoaderRuleError: One line naming the key and the sglang rule.
    """
    if not isinstance(qc, Mapping):
        rule_broken(
            "quantization_config",
            f"expected a JSON object, got {qc!r}",
            "srt/configs/model_config.py:1727-1730",
        )
    method = qc.get("quant_method")
    if method == "fp8":
        return _check_fp8_config(qc)
    if method == "compressed-tensors":
        return _check_ct_config(qc)
    rule_broken(
        "quantization_config.quant_method",
        f"{method!r}: Ember serves {' or '.join(map(repr, METHODS.values()))}",
        f"{Q}/__init__.py:63-92",
    )
    raise AssertionError  # unreachable


def _check_fp8_config(qc: Mapping) -> QuantSpec:
    key = "quantization_config"
    if "activation_scheme" not in qc:
        rule_broken(
            key,
            "Cannot find any of ['activation_scheme'] in the model's quantization config.",
            f"{Q}/base_config.py:257-264",
        )
    scheme = qc["activation_scheme"]
    if scheme not in ("static", "dynamic"):
        rule_broken(
            f"{key}.activation_scheme",
            f"Unsupported activation scheme {scheme}",
            f"{Q}/fp8.py:285-286",
        )
    block = qc.get("weight_block_size")
    if block is None:
        rule_broken(
            f"{key}.weight_block_size",
            "missing: without it sglang loads per-tensor FP8 (a `weight_scale` per layer), not "
            "Ember's blocks",
            f"{Q}/fp8.py:653-714",
        )
    if not isinstance(block, list) or len(block) != 2:
        rule_broken(
            f"{key}.weight_block_size",
            f"The quantization block size of weight must have 2 dimensions, but got {block}",
            f"{Q}/fp8.py:306-310",
        )
    if scheme != "dynamic":
        rule_broken(
            f"{key}.activation_scheme",
            "The block-wise quantization only supports dynamic activation scheme for now, but "
            f"got {scheme} activation scheme.",
            f"{Q}/fp8.py:311-314",
        )
    for edge in block:
        if not isinstance(edge, int) or edge < 16 or edge & (edge - 1):
            rule_broken(
                f"{key}.weight_block_size",
                f"{block}: the Triton block-FP8 GEMM takes each edge as a tile size "
                "(BLOCK_SIZE_N/K), which must be a power of two >= 16",
                "kernels/ops/gemm/fp8_kernel.py:812-819",
            )
    if block[0] != block[1]:  # sglang takes [block_n, block_k] (fp8.py:580-583); Ember's are square
        raise LoaderRuleError(
            f"{key}.weight_block_size: {block}: Ember's FP8 blocks are square "
            "(ember_core.quant.quantize_fp8_block)"
        )
    if qc.get("scale_fmt") is not None:
        rule_broken(
            f"{key}.scale_fmt",
            f"{qc['scale_fmt']!r} quantizes activations with power-of-two scales",
            f"{Q}/fp8.py:548-552",
        )
    ignored = qc.get("ignored_layers", qc.get("modules_to_not_convert")) or []
    if not isinstance(ignored, list) or not all(isinstance(n, str) for n in ignored):
        rule_broken(
            f"{key}.ignored_layers",
            f"expected a list of module names, got {ignored!r}",
            f"{Q}/fp8.py:354-364",
        )
    return QuantSpec("fp8_block", block[0], "experts" if ignored else "linear")


def _check_ct_config(qc: Mapping) -> QuantSpec:
    key = "quantization_config"
    ct = f"{Q}/compressed_tensors/compressed_tensors.py"
    if qc.get("format") != "pack-quantized":
        rule_broken(
            f"{key}.format",
            f"{qc.get('format')!r}: WNA16 layers and their MoE take pack-quantized only",
            f"{ct}:733-751, schemes/compressed_tensors_wNa16_moe.py:83-92",
        )
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping) or len(groups) != 1:
        rule_broken(
            f"{key}.config_groups",
            f"expected one group (Ember quantizes with one scheme), got {groups!r}",
            f"{ct}:362-364",
        )
    ((name, group),) = groups.items()
    where = f"{key}.config_groups.{name}"
    targets = group.get("targets") if isinstance(group, Mapping) else None
    if not isinstance(targets, list) or not targets:
        rule_broken(f"{where}.targets", f"expected a list, got {targets!r}", f"{ct}:362-364")
    if group.get("input_activations") is not None:
        rule_broken(
            f"{where}.input_activations", "W4A16 quantizes no activations: null", f"{ct}:633-651"
        )
    weights = group.get("weights")
    if not isinstance(weights, Mapping):
        rule_broken(
            f"{where}.weights", f"expected QuantizationArgs, got {weights!r}", f"{ct}:366-368"
        )
    g = weights.get("group_size")
    if weights.get("strategy") != "group" or not isinstance(g, int) or g <= 0:
        rule_broken(
            f"{where}.weights",
            f"strategy {weights.get('strategy')!r} with group_size {g!r}: Ember's INT4 needs "
            "strategy 'group' with a positive group_size",
            "compressed_tensors 0.18.0 quantization/quant_args.py:332-345",
        )
    wanted = {"num_bits": 4, "type": "int", "symmetric": True, "dynamic": False, "actorder": None}
    for field, value in wanted.items():
        if weights.get(field, value if field in ("dynamic", "actorder") else None) != value:
            rule_broken(
                f"{where}.weights.{field}",
                f"{weights.get(field)!r}, expected {value!r} (symmetric static INT4 groups, "
                "no zero points or g_idx: Ember's pack-quantized layout)",
                f"{ct}:633-651, schemes/compressed_tensors_wNa16.py:55-91",
            )
    if g not in MARLIN_GROUP_SIZES:
        rule_broken(
            f"{where}.weights.group_size",
            f"{g}: Marlin's INT4 kernels take group sizes {list(MARLIN_GROUP_SIZES)}",
            f"{Q}/marlin_utils.py:44,131-137",
        )
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(n, str) for n in ignore):
        rule_broken(
            f"{key}.ignore", f"expected a list of module names, got {ignore!r}", f"{ct}:283"
        )
    return QuantSpec("int4_w4a16", g, "experts" if ignore else "linear")


def served_dtype_of(config: Mapping, dtype: str = "auto") -> torch.dtype:
    """The dtype a server started with `--dtype dtype` computes in for config.json `config`:
    auto serves the checkpoint's dtype, but float32 as float16 (model_config.py:2300-2319)."""
    if dtype != "auto":
        return getattr(torch, dtype)
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    stored = getattr(torch, name)
    return torch.float16 if stored == torch.float32 else stored


def check_device(spec: QuantSpec, device: str, why: str) -> None:
    """Refuse a scheme SGLang cannot run on `device` (cpu: the CPU kernels of both need what
    PyPI's sgl-kernel lacks); `why` says how the device was resolved.

    Raises:
        ValueError: One line naming the scheme and the GPU-only kernel.
    """
    if device != "cpu":
        return
    if spec.scheme == "fp8_block":
        kernel = (
            f"{Q}/fp8.py:826-829 asserts 'Fp8LinearMethod on CPU requires that CPU has AMX "
            "support' and computes with sgl_kernel's fp8_scaled_mm_cpu (fp8.py:1400-1410), "
            "which PyPI's CUDA-only sgl-kernel and Ember's CPU stand-in lack"
        )
    else:
        kernel = (
            f"{Q}/compressed_tensors/compressed_tensors.py:1090-1091 builds WNA16 layers only "
            "after torch.cuda.get_device_capability(), and the MoE's Marlin repack and "
            f"workspace are CUDA kernels (schemes/compressed_tensors_wNa16_moe.py:351-403, "
            "marlin_utils.py:266-274)"
        )
    raise ValueError(
        f"engine.quantization={spec.scheme} with SGLang servers on CPU ({why}): {SGLANG} "
        f"{kernel}; run the servers on GPUs (engine.sglang.device=cuda), or let the embedded "
        "engine (engine.kind=hf) emulate the scheme on CPU"
    )


def export_layout(
    shapes: Mapping[str, tuple[int, ...]], spec: QuantSpec, dtype: torch.dtype
) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The (dtype, shape) of every tensor `quant.quantize_named(..., spec, dtype=dtype)` makes
    of full-precision tensors of `shapes`, without making them.

    Raises:
        ValueError: A target weight `quant.check_shape` refuses.
    """
    out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    g = spec.group_size
    for name, shape in shapes.items():
        if not quant.is_target(name, spec.targets):
            out[name] = (dtype, tuple(shape))
            continue
        quant.check_shape(name, shape, spec)
        rows, cols = shape
        stem = name.removesuffix("weight")
        if spec.scheme == "fp8_block":
            out[stem + "weight"] = (torch.float8_e4m3fn, (rows, cols))
            out[stem + "weight_scale_inv"] = (torch.float32, (rows // g, cols // g))
        else:
            out[stem + "weight_packed"] = (torch.int32, (rows, cols // 8))
            out[stem + "weight_scale"] = (dtype, (rows, cols // g))
            out[stem + "weight_shape"] = (torch.int64, (2,))
    return out


@dataclass(frozen=True, slots=True)
class Served:
    """What an attached server serves, and how that was found out."""

    method: str | None
    """Its quant_method, None for full precision (or when it cannot be told)."""
    config: dict | None
    """The quantization_config of its checkpoint, when that can be read here."""
    how: str
    """Where `method` was read ("unknown": neither place says)."""
    checkpoint_read: bool
    """Whether its checkpoint's config.json was read here."""


def server_quantization(url: str, timeout_s: float = 10.0) -> Served:
    """What an attached server serves. sglang 0.5.23's GET /server_info reports the server
    arguments (utils/common.py:3584-3593), whose `quantization` is null unless --quantization
    was given: the checkpoint's config.json decides then (configs/model_config.py:2104-2107);
    GET /model_info names the checkpoint (`model_path`, entrypoints/http_server.py:812-850),
    which is read when it is a directory on this machine.

    Raises:
        OSError, ValueError: The server did not answer either route with a JSON object.
    """

    def get(route: str) -> dict:
        with urllib.request.urlopen(f"{url.rstrip('/')}{route}", timeout=timeout_s) as answer:
            body = json.loads(answer.read())
        if not isinstance(body, dict):
            raise ValueError(f"GET {route} answered {body!r}")
        return body

    method = get("/server_info").get("quantization")
    path = get("/model_info").get("model_path")
    file = Path(path) / "config.json" if isinstance(path, str) else None
    read = file is not None and file.is_file()
    qc = None
    if read:
        config = json.loads(file.read_text())
        qc = config.get("quantization_config") or config.get("compression_config")
    if method is not None:
        return Served(method, qc, f"GET /server_info reports quantization={method!r}", read)
    if qc is not None:
        how = f"its checkpoint {file} says quant_method={qc.get('quant_method')!r}"
        return Served(qc.get("quant_method"), qc, how, read)
    if read:
        return Served(None, None, f"its checkpoint {file} has no quantization_config", read)
    return Served(None, None, "unknown", read)


def check_attached(urls: Iterable[str], spec: QuantSpec | None, timeout_s: float = 10.0) -> None:
    """Refuse attached servers that serve another quantization than `spec` (None: full
    precision), asked as `server_quantization` finds out. A server that does not answer is left
    to the engine's start, unless the run is quantized: then it must say what it serves.

    Raises:
        ValueError: One line naming the server, what it serves and the run's setting.
    """
    ours = "engine.quantization=" + ("null" if spec is None else spec.scheme)
    want = None if spec is None else METHODS[spec.scheme]
    for url in urls:
        try:
            served = server_quantization(url, timeout_s)
        except (OSError, ValueError) as exc:
            if spec is None:
                continue
            raise ValueError(
                f"{ours}: cannot ask the attached SGLang server {url} what it serves (GET "
                f"/server_info, /model_info: {exc}); start it first"
            ) from None
        method, qc, how = served.method, served.config, served.how
        method = "compressed-tensors" if method == "compressed_tensors" else method
        if how == "unknown":
            if spec is None:
                continue
            raise ValueError(
                f"{ours}: the attached SGLang server {url} does not say what it serves (GET "
                "/server_info reports quantization null and its model_path cannot be read "
                f"here); launch it with --quantization {want} from Ember's quantized export"
            )
        if method != want:
            fix = (
                "attach servers of a full-precision checkpoint"
                if spec is None
                else f"launch them from Ember's {spec.scheme} export (quant_method {want!r})"
            )
            raise ValueError(
                f"{ours}, but the attached SGLang server {url} serves quantization "
                f"{method!r} ({how}): its layers would take the pushed tensors cast or not at "
                f"all; set engine.quantization to what it serves, or {fix}"
            )
        if spec is None:
            continue
        if qc is None and served.checkpoint_read:
            raise ValueError(
                f"{ours}, but the attached SGLang server {url} quantizes its full-precision "
                f"checkpoint online (--quantization {method}; {how}): Ember's pushes carry "
                f"pre-quantized {spec.scheme} tensors; launch it from Ember's quantized export"
            )
        if qc is not None:
            try:
                theirs = check_config(qc)
            except LoaderRuleError as exc:
                raise ValueError(f"{ours}: the attached SGLang server {url}: {exc}") from None
            if (theirs.group_size, theirs.targets) != (spec.group_size, spec.targets):
                raise ValueError(
                    f"{ours} with engine.quantization_group_size={spec.group_size} and "
                    f"engine.quantization_targets={spec.targets}, but the attached SGLang "
                    f"server {url} serves group size {theirs.group_size} with targets "
                    f"{theirs.targets} ({how}); set them to match"
                )


def checkpoint_quantization(path: str | Path) -> dict | None:
    """The `quantization_config` of the checkpoint at `path` (None: full precision, or no
    config.json there)."""
    file = Path(path) / "config.json"
    if not file.is_file():
        return None
    config = json.loads(file.read_text())
    qc = config.get("quantization_config") or config.get("compression_config")
    return dict(qc) if isinstance(qc, Mapping) else None


def launch_quantization(model_path: str | Path, spec: QuantSpec) -> str:
    """The `--quantization` of a server of a run under `spec` launched from `model_path`,
    which must be a checkpoint of that scheme (Ember's quantized export).

    sglang 0.5.23 reads the method from config.json by itself (configs/model_config.py:
    2104-2107); naming it too makes sglang refuse a checkpoint of another method ("does not
    match the quantization method specified in the `quantization` argument",
    model_config.py:2141-2147) and GET /server_info report it, as Ember asks attached servers.

    Raises:
        ValueError: One line: the checkpoint holds another scheme, or none.
    """
    qc = checkpoint_quantization(model_path)
    ours = f"engine.quantization={spec.scheme}"
    if qc is None:
        raise ValueError(
            f"{ours}: SGLang servers would launch from {model_path}, which holds no "
            "quantization_config and would be served in full precision; launch them from the "
            "run's quantized export"
        )
    try:
        theirs = check_config(qc)
    except LoaderRuleError as exc:
        raise ValueError(f"{ours}: {model_path}: {exc}") from None
    if theirs != spec:
        raise ValueError(
            f"{ours} (group size {spec.group_size}, targets {spec.targets}): SGLang servers "
            f"would launch from {model_path}, a {theirs.scheme} checkpoint (group size "
            f"{theirs.group_size}, targets {theirs.targets})"
        )
    return METHODS[spec.scheme]
