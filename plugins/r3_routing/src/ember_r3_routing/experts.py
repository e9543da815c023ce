"""Routed experts from the engine: decoding SGLang's payload, per-sample validation, storage."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any

import torch

from ember_r3_routing.config import R3RoutingConfig

META_KEY = "routed_experts"
"""Key of the base64 payload in an engine's `meta_info`."""
REQUEST_FIELD = "return_routed_experts"
"""Request field that asks the engine for routed experts."""
SERVER_FLAG = "--enable-return-routed-experts"
"""SGLang server flag that makes routed experts available at all."""


def describe(sample: Any) -> str:
    """How errors name a sample: "sample 3 (group 1)"."""
    return f"sample {sample.index} (group {sample.group_index})"


def decode_routed_experts(
    encoded: object, *, num_positions: int, num_layers: int, topk: int, where: str
) -> torch.Tensor:
    """Decode SGLang's `meta_info["routed_experts"]` into int32 [num_positions, num_layers, topk].

    SGLang writes the ids as one flat array of native (little-endian) int32 in row-major order
    (position, then layer, then rank) and base64-encodes the bytes with the standard alphabet.

    Args:
        encoded: The base64 string (or bytes) from the engine.
        num_positions: len(tokens) - 1 of the sample: the engine never forwards the last token.
        num_layers: Decoder layers.
        topk: Experts per token.
        where: Names the sample in error messages.

    Raises:
        ValueError: Not base64, or not exactly num_positions * num_layers * topk int32 values;
            the message names the sample and the expected shape.
    """
    if not isinstance(encoded, str | bytes):
        raise ValueError(
            f"{where}: meta_info[{META_KEY!r}] must be a base64 string, got "
            f"{type(encoded).__name__}"
        )
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"{where}: meta_info[{META_KEY!r}] is not valid base64 ({exc})") from None
    expected = num_positions * num_layers * topk
    if len(raw) != 4 * expected:
        got = f"{len(raw) // 4} int32 values" if len(raw) % 4 == 0 else f"{len(raw)} bytes"
        raise ValueError(
            f"{where}: routed experts hold {got}, expected [len(tokens) - 1, num_layers, topk] = "
            f"[{num_positions}, {num_layers}, {topk}] = {expected} int32 values"
        )
    flat = torch.frombuffer(bytearray(raw), dtype=torch.int32)
    return flat.view(num_positions, num_layers, topk)


def validate_routed_experts(
    experts: torch.Tensor, config: R3RoutingConfig, *, num_tokens: int, where: str
) -> torch.Tensor:
    """Check one sample's routed experts and return them in the compact dtype.

    Checks: shape [num_tokens - 1, num_layers, topk]; integer ids; dense layers all zero; MoE
    ids in [0, num_experts); no MoE layer all zero across the sample (the engine captured
    nothing there); with topk > 1, the topk ids of every MoE row distinct (as a real top-k is).

    Args:
        experts: Integer tensor from the engine, any integer dtype.
        config: The model shape.
        num_tokens: len(tokens) of the sample.
        where: Names the sample in error messages.

    Returns:
        The same ids as a CPU tensor of `config.expert_dtype` (uint8 up to 256 experts).

    Raises:
        ValueError: The first failed check, naming the sample, the layer or position, and what
            was expected.
    """
    shape = (num_tokens - 1, config.num_layers, config.topk)
    expected = f"[len(tokens) - 1, num_layers, topk] = [{shape[0]}, {shape[1]}, {shape[2]}]"
    if not isinstance(experts, torch.Tensor):
        raise ValueError(f"{where}: routed experts must be a tensor, got {type(experts).__name__}")
    if tuple(experts.shape) != shape:
        raise ValueError(
            f"{where}: routed experts have shape {list(experts.shape)}, expected {expected}"
        )
    if experts.is_floating_point() or experts.is_complex() or experts.dtype == torch.bool:
        raise ValueError(f"{where}: routed experts must be integer ids, got {experts.dtype}")
    ids = experts.detach().to("cpu", torch.int64)

    dense = config.dense_layers
    if dense:
        nonzero = ids[:, dense].flatten(1).any(dim=1)  # [P]
        if nonzero.any():
            position = int(nonzero.nonzero()[0])
            layer = next(d for d in dense if ids[position, d].any())
            raise ValueError(
                f"{where}: layer {layer} is dense (r3_routing.dense_layers) but position "
                f"{position} carries expert ids {ids[position, layer].tolist()}; expected zeros"
            )

    moe = config.moe_layers
    moe_ids = ids[:, moe]  # [P, M, k]
    bad = (moe_ids < 0) | (moe_ids >= config.num_experts)
    if bad.any():
        position, m, _ = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{where}: position {position}, layer {moe[m]} routes to experts "
            f"{moe_ids[position, m].tolist()}; expected ids in [0, num_experts="
            f"{config.num_experts})"
        )
    empty = ~moe_ids.ne(0).any(dim=2).any(dim=0)  # [M]
    if empty.any():
        layers = [moe[int(m)] for m in empty.nonzero().flatten()]
        raise ValueError(
            f"{where}: MoE layer(s) {layers} hold only zeros over all {shape[0]} positions; "
            "expected the experts the engine routed to (is the engine's layer order or "
            "r3_routing.dense_layers wrong?)"
        )
    if config.topk > 1:
        ranked = moe_ids.sort(dim=-1).values
        repeated = (ranked[..., 1:] == ranked[..., :-1]).any(dim=-1)  # [P, M]
        if repeated.any():
            position, m = (int(i) for i in repeated.nonzero()[0])
            raise ValueError(
                f"{where}: position {position}, layer {moe[m]} routes to experts "
                f"{moe_ids[position, m].tolist()}; expected {config.topk} distinct experts"
            )
    return ids.to(config.expert_dtype)


def routed_experts_for(
    sample: Any, meta_info: Mapping[str, Any], config: R3RoutingConfig
) -> torch.Tensor:
    """One sample's validated routed experts, in the compact dtype.

    The engine may already have decoded them into `sample.rollout_routed_experts`; otherwise
    they are decoded from `meta_info["routed_experts"]`.

    Raises:
        ValueError: They are missing or malformed; the message names the sample.
    """
    where = describe(sample)
    num_tokens = len(sample.tokens)
    experts = sample.rollout_routed_experts
    if experts is None:
        encoded = meta_info.get(META_KEY) if isinstance(meta_info, Mapping) else None
        if encoded is None:
            raise ValueError(
                f"{where}: no routed experts from the engine, expected [len(tokens) - 1, "
                f"num_layers, topk] = [{num_tokens - 1}, {config.num_layers}, {config.topk}]; "
                f"r3_routing asks for them with the request field {REQUEST_FIELD!r}, and an "
                f"SGLang server must also run with {SERVER_FLAG}"
            )
        experts = decode_routed_experts(
            encoded,
            num_positions=num_tokens - 1,
            num_layers=config.num_layers,
            topk=config.topk,
            where=where,
        )
    return validate_routed_experts(experts, config, num_tokens=num_tokens, where=where)
