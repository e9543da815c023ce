"""Low-precision rollout weights: the quantize and dequantize functions both sides call.

The engine serves a quantized copy of the trainer's weights (`engine.quantization`); with
`train.qat` the trainer's forward multiplies with the same quantized values (fake quantization,
gradients passed straight through to the full-precision weights). Both call the functions here,
so that the engine's emulated model and the trainer's fake-quantized one hold the same numbers:

- `fp8_block`: FP8 e4m3 weights in square blocks of `group_size` x `group_size`, one fp32 scale
  per block (`weight_scale_inv`, the DeepSeek-V3 layout; the weight is `q * scale`, scale =
  block amax / 448), and activations quantized per token in groups of `group_size` along the
  input (scale = max(group amax, 1e-10) / 448), where SGLang's W8A8 block kernel quantizes them.
- `int4_w4a16`: symmetric INT4 weights, one scale per `group_size` inputs of a row (scale =
  group amax / 7, values rounded and clamped to [-8, 7]), packed eight to an int32 as
  compressed-tensors' `pack-quantized` format stores them (`weight_packed`, `weight_scale`,
  `weight_shape`); activations stay in the model's dtype.

Every quantized dimension must be a multiple of `group_size` (`check_shape`): a partial block
or group is refused rather than padded. Which weights a scheme quantizes is `is_target`: the
decoder layers' linear projections ("linear"), or only the routed experts' ("experts"); never
the embedding, the output layer, norms or routers.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

__all__ = [
    "FP8_MAX",
    "INT4_MAX",
    "SCHEMES",
    "TARGETS",
    "QuantSpec",
    "check_shape",
    "dequantize",
    "fake_quantize",
    "fake_quantize_activation",
    "is_target",
    "pack_int4",
    "quantize",
    "quantize_named",
    "quantized_names",
    "unpack_int4",
]

SCHEMES = ("fp8_block", "int4_w4a16")
"""The quantization schemes of rollout weights."""

TARGETS = ("linear", "experts")
"""Which weights a scheme quantizes: every linear projection of the decoder layers, or only the
routed experts'."""

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
"""Largest finite e4m3 value (448)."""

INT4_MAX = 7
"""A group's largest magnitude maps to this INT4 value (the range is [-8, 7])."""

ACTIVATION_EPS = 1e-10
"""Smallest activation group amax a scale is computed from (SGLang's per-token-group quant)."""

_WEIGHT_EPS = 1e-12
"""Smallest weight block or group amax a scale is computed from (an all-zero block)."""

_PROJECTIONS = re.compile(
    r"\.(?:q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|w1|w2|w3|"
    r"q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|qkv_proj|dense)\.weight$"
)
"""Linear projections of a decoder layer, as transformers checkpoints name them."""


@dataclass(frozen=True, slots=True)
class QuantSpec:
    """A scheme, its block or group size and which weights it quantizes."""

    scheme: str
    group_size: int = 128
    targets: str = "linear"

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"quantization {self.scheme!r} is not one of {', '.join(SCHEMES)}")
        if self.targets not in TARGETS:
            raise ValueError(f"quantization targets {self.targets!r}: expected one of {TARGETS}")
        if self.group_size < 8 or self.group_size % 8:
            raise ValueError(
                f"quantization group size {self.group_size}: expected a multiple of 8 (INT4 "
                "packs eight values to an int32; FP8 blocks are square)"
            )

    @property
    def quantizes_activations(self) -> bool:
        """Whether the engine's products quantize their input too (W8A8)."""
        return self.scheme == "fp8_block"


def is_target(name: str, targets: str) -> bool:
    """Whether the weight of checkpoint name `name` is quantized under `targets`."""
    if ".layers." not in name or not _PROJECTIONS.search(name):
        return False
    return targets == "linear" or ".experts." in name


def check_shape(name: str, shape: tuple[int, ...] | torch.Size, spec: QuantSpec) -> None:
    """Refuse a weight `spec` cannot quantize: not 2-D, or a dimension its blocks or groups do
    not divide (FP8 blocks cover both, INT4 groups the input).

    Raises:
        ValueError: One line naming the weight, its shape and the group size.
    """
    if len(shape) != 2:
        raise ValueError(f"{name}: a quantized weight must be 2-D, got shape {tuple(shape)}")
    rows, cols = shape
    g = spec.group_size
    dims = (("output", rows), ("input", cols)) if spec.scheme == "fp8_block" else (("input", cols),)
    for which, size in dims:
        if size % g:
            fits = [d for d in (8, 16, 32, 64) if size % d == 0 and d < g]
            hint = f" such as {fits[-1]}" if fits else ""
            raise ValueError(
                f"{name}: {spec.scheme} group size {g} does not divide its {which} size {size} "
                f"(shape {tuple(shape)}); set engine.quantization_group_size to a divisor{hint}"
            )


# -- FP8 blocks -------------------------------------------------------------------------------


def _blocks(w: torch.Tensor, g: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.reshape(rows // g, g, cols // g, g)


def quantize_fp8_block(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 weight [N, K] and fp32 `weight_scale_inv` [N/g, K/g] of `w` [N, K]."""
    blocks = _blocks(w.detach().float(), group_size)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=_WEIGHT_EPS) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(w.shape), scale


def dequantize_fp8_block(
    q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The weight [N, K] in `dtype` that FP8 `q` [N, K] with block scales `scale_inv` holds."""
    rows, cols = q.shape
    g = rows // scale_inv.shape[0]
    blocks = _blocks(q.float(), g) * scale_inv.float()[:, None, :, None]
    return blocks.reshape(rows, cols).to(dtype)


def fake_quantize_activation(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """`x` [..., K] as the W8A8 block kernel sees it: each token's groups of `group_size` inputs
    quantized to FP8 with their own scale, and back in `x`'s dtype."""
    groups = x.float().reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    scale = groups.abs().amax(dim=-1, keepdim=True).clamp(min=ACTIVATION_EPS) / FP8_MAX
    q = (groups / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).reshape(x.shape).to(x.dtype)


# -- INT4 groups ------------------------------------------------------------------------------


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """Signed INT4 `values` [N, K] (in [-8, 7], K a multiple of 8) packed to int32 [N, K/8]:
    offset by 8 to [0, 15], column 8c + i in bits 4i..4i+3 of word c (compressed-tensors'
    `pack_to_int32`)."""
    rows, cols = values.shape
    nibbles = (values.to(torch.int64) + 8).reshape(rows, cols // 8, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=values.device)
    words = (nibbles << shifts).sum(dim=-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def unpack_int4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """The signed INT4 values [N, cols] (int8) that `pack_int4` packed into `packed`."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=packed.device)
    nibbles = (packed.to(torch.int64)[..., None] >> shifts) & 0xF
    return (nibbles.reshape(packed.shape[0], -1)[:, :cols] - 8).to(torch.int8)


def quantize_int4(
    w: torch.Tensor, group_size: int, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed INT4 weight int32 [N, K/8] and `weight_scale` [N, K/g] in `scale_dtype` of `w`.

    The scale is rounded to `scale_dtype` before the values are, so that the stored scale is
    the one they were divided by."""
    rows, cols = w.shape
    groups = w.detach().float().reshape(rows, cols // group_size, group_size)
    amax = groups.abs().amax(dim=-1).clamp(min=_WEIGHT_EPS)
    scale = (amax / INT4_MAX).to(scale_dtype)
    q = torch.round(groups / scale.float()[..., None]).clamp(-8, INT4_MAX)
    return pack_int4(q.reshape(rows, cols)), scale


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] in `dtype` that packed INT4 `packed` with group scales `scale` holds."""
    rows, groups = scale.shape
    cols = packed.shape[1] * 8
    values = unpack_int4(packed, cols).float().reshape(rows, groups, cols // groups)
    return (values * scale.float()[..., None]).reshape(rows, cols).to(dtype)


# -- by scheme --------------------------------------------------------------------------------


def quantize(
    w: torch.Tensor, spec: QuantSpec, *, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """The tensors that hold `w` [N, K] under `spec`, by the suffix that replaces `weight` in
    its checkpoint name: FP8 `weight` and `weight_scale_inv`, or INT4 `weight_packed`,
    `weight_scale` (in `dtype`, default `w`'s: the dtype the engine serves) and `weight_shape`.
    """
    if spec.scheme == "fp8_block":
        q, scale = quantize_fp8_block(w, spec.group_size)
        return {"weight": q, "weight_scale_inv": scale}
    packed, scale = quantize_int4(w, spec.group_size, dtype or w.dtype)
    shape = torch.tensor(list(w.shape), dtype=torch.int64)
    return {"weight_packed": packed, "weight_scale": scale, "weight_shape": shape}


def dequantize(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The weight in `dtype` that `quantize`'s `tensors` hold."""
    if "weight_scale_inv" in tensors:
        return dequantize_fp8_block(tensors["weight"], tensors["weight_scale_inv"], dtype)
    return dequantize_int4(tensors["weight_packed"], tensors["weight_scale"], dtype)


class _StraightThrough(torch.autograd.Function):
    """`quantized` forward, the identity's gradient backward (straight-through estimator)."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, quantized: torch.Tensor) -> torch.Tensor:
        return quantized

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def straight_through(w: torch.Tensor, quantized: torch.Tensor) -> torch.Tensor:
    """`quantized` in the forward; gradients pass to `w` unchanged."""
    return _StraightThrough.apply(w, quantized)


def fake_quantize(w: torch.Tensor, spec: QuantSpec, *, dtype: torch.dtype | None = None):
    """`w` as the engine serves it under `spec` (quantized, then dequantized to `w`'s dtype;
    INT4 scales rounded to `dtype`, default `w`'s), with straight-through gradients."""
    with torch.no_grad():
        served = dequantize(quantize(w, spec, dtype=dtype), w.dtype)
    return straight_through(w, served)


def quantized_names(name: str, spec: QuantSpec) -> list[str]:
    """The checkpoint names `quantize` gives weight `name` (`....weight`)."""
    stem = name.removesuffix("weight")
    if spec.scheme == "fp8_block":
        return [name, f"{stem}weight_scale_inv"]
    return [f"{stem}weight_packed", f"{stem}weight_scale", f"{stem}weight_shape"]


def quantize_named(
    named: Iterable[tuple[str, torch.Tensor]],
    spec: QuantSpec,
    *,
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """`named` as a quantized engine takes it: every target weight (`is_target`) replaced by its
    quantized tensors (`quantize`, from the weight as given; INT4 scales in `dtype`), every
    other tensor cast to `dtype` (None: each as given).

    Raises:
        ValueError: A target weight `check_shape` refuses.
    """
    for name, tensor in named:
        if not is_target(name, spec.targets):
            yield name, tensor if dtype is None else tensor.to(dtype)
            continue
        check_shape(name, tensor.shape, spec)
        stem = name.removesuffix("weight")
        for suffix, value in quantize(tensor, spec, dtype=dtype).items():
            yield stem + suffix, value
