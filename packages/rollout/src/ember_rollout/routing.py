"""Routed experts: recorded from a transformers MoE as dispatched, and SGLang's wire format
(base64 of int32 [len(tokens) - 1, layers, topk])."""

from __future__ import annotations

import base64
import binascii
import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from ember_core import exact

ROUTED_EXPERTS_KEY = "routed_experts"
"""Key of the encoded experts in `meta_info`."""
ROUTED_EXPERTS_DTYPE_KEY = "routed_experts_dtype"
"""Optional `meta_info` key naming a narrower wire dtype (newer SGLang releases)."""

_WIRE_DTYPES = {"int32": np.dtype("<i4"), "uint16": np.dtype("<u2"), "uint8": np.dtype("u1")}


def encode_routed_experts(experts: torch.Tensor) -> str:
    """Encode integer expert ids [positions, num_layers, topk] as SGLang does.

    The ids are written as little-endian int32 in row-major order (position, then layer, then
    rank) and base64-encoded with the standard alphabet.
    """
    if experts.dim() != 3:
        raise ValueError(
            "routed experts must be [positions, num_layers, topk], got shape "
            f"{tuple(experts.shape)}"
        )
    if experts.is_floating_point() or experts.is_complex():
        raise ValueError(f"routed experts must be integer ids, got {experts.dtype}")
    array = experts.detach().to("cpu", torch.int32).contiguous().numpy().astype("<i4", copy=False)
    return base64.b64encode(array.tobytes()).decode("ascii")


def decode_routed_experts(
    encoded: object,
    *,
    num_tokens: int,
    num_layers: int,
    topk: int,
    where: str,
    wire_dtype: object = None,
) -> torch.Tensor:
    """Decode `meta_info["routed_experts"]` into an int32 tensor [num_tokens - 1, num_layers, topk].

    Args:
        encoded: The base64 string from the engine.
        num_tokens: len(tokens) of the sample (prompt + response); the last token is never
            forwarded, so there are num_tokens - 1 positions.
        num_layers: Decoder layers of the model.
        topk: Experts per token.
        where: Names the sample in error messages.
        wire_dtype: `meta_info["routed_experts_dtype"]` when the engine sent one (int32 default).

    Raises:
        ValueError: Not a base64 string, or not the expected number of ids; the message names
            the sample and both sizes.
    """
    if not isinstance(encoded, str | bytes):
        raise ValueError(
            f"{where}: meta_info['routed_experts'] must be a base64 string, got "
            f"{type(encoded).__name__}"
        )
    name = "int32" if wire_dtype is None else str(wire_dtype).strip().lower()
    if name not in _WIRE_DTYPES:
        raise ValueError(
            f"{where}: meta_info['routed_experts_dtype']={wire_dtype!r} is not one of "
            f"{', '.join(_WIRE_DTYPES)}"
        )
    dtype = _WIRE_DTYPES[name]
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(
            f"{where}: meta_info['routed_experts'] is not valid base64 ({exc})"
        ) from None
    if len(raw) % dtype.itemsize:
        raise ValueError(
            f"{where}: routed experts payload has {len(raw)} bytes, not a whole number of "
            f"{name} ids"
        )
    positions = num_tokens - 1
    expected = positions * num_layers * topk
    got = len(raw) // dtype.itemsize
    if got != expected:
        rows = f"{got / (num_layers * topk):g}" if num_layers * topk else "?"
        raise ValueError(
            f"{where}: routed experts hold {got} ids ({rows} positions), expected "
            f"(len(tokens) - 1) * num_layers * topk = {positions} * {num_layers} * {topk} = "
            f"{expected}"
        )
    array = np.frombuffer(raw, dtype=dtype).astype(np.int32)
    return torch.from_numpy(array.reshape(positions, num_layers, topk))


class ExpertCapture:
    """Records, for every forwarded token, the experts each MoE layer dispatched it to.

    A forward pre-hook on each layer's `experts` module reads the ids the MoE block passes in
    (`experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])` in every transformers 5
    MoE family), so whatever rule chose them (softmax top-k, sigmoid plus expert bias, group
    limits) the ids are those the layer computed with. They keep the block's order: descending
    score for the softmax families, unspecified for DeepSeek-V3 and GLM-4.5 (`torch.topk(...,
    sorted=False)`); consumers compare sets.
    """

    def __init__(self, sites: Sequence[tuple[int, nn.Module]], num_layers: int, topk: int) -> None:
        """Hook `sites`, (layer index, experts module) pairs; stays hooked until `close()`."""
        self.num_layers = num_layers
        self.topk = topk
        self._captured: dict[int, torch.Tensor] = {}
        self._handles = [
            module.register_forward_pre_hook(self._hook(layer), with_kwargs=True)
            for layer, module in sites
        ]

    def _hook(self, layer: int):
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            ids = args[1] if len(args) > 1 else kwargs.get("top_k_index")
            if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] != self.topk:
                got = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
                raise ValueError(
                    f"layer {layer}: {type(module).__name__} was called without expert ids of "
                    f"shape [tokens, topk={self.topk}] as its second argument (got {got}); "
                    "routed experts cannot be recorded for this model"
                )
            self._captured[layer] = ids.detach()

        return hook

    def pop(self, batch: int, seq: int) -> torch.Tensor:
        """Experts of the last forward: int32 [batch, seq, num_layers, topk]; dense layers 0."""
        out = torch.zeros(batch, seq, self.num_layers, self.topk, dtype=torch.int32)
        for layer, ids in self._captured.items():
            out[:, :, layer] = ids.reshape(batch, seq, self.topk).to("cpu", torch.int32)
        self._captured.clear()
        return out

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


@contextlib.contextmanager
def replay_routing(model: nn.Module, experts: torch.Tensor) -> Iterator[None]:
    """Within the block, every MoE layer of `model` computes with the experts `experts` names
    instead of those its router picks: the embedded engine's side of R3's replay.

    A forward hook on each router replaces its choice with the recorded ids and weighs them as
    the family's router weighs the experts it picks (`Family.router_scores`), from the router's
    own logits, as megatron-core's `RouterReplay` does in the trainer: recorded ids equal to
    the router's own give the router's own output, bit for bit.

    Args:
        model: A transformers MoE causal LM of a family in `families.FAMILIES`.
        experts: int [positions, num_layers, topk], the ids each layer is to use at each
            position of the next forward (batch 1; dense layers' rows are ignored).

    Raises:
        ValueError: The family has no known router rule, `experts` does not fit the model, or
            a forward in the block has another number of positions.
    """
    from ember_rollout.families import FAMILIES, config_num_experts
    from ember_rollout.models import find_routers

    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type or "")
    if family is None:
        raise ValueError(
            f"routing replay knows the routers of {', '.join(FAMILIES)}; the model's "
            f"model_type is {model_type!r}"
        )
    sites = find_routers(model)
    layers, topk = int(config.num_hidden_layers), int(config.num_experts_per_tok)
    if experts.dim() != 3 or tuple(experts.shape[1:]) != (layers, topk):
        raise ValueError(
            f"experts to replay must be [positions, num_layers={layers}, topk={topk}], got "
            f"{tuple(experts.shape)}"
        )
    ids = experts.to(torch.long)
    num_experts = config_num_experts(config) or 0
    if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < num_experts:
        raise ValueError(
            f"experts to replay hold ids in [{int(ids.min())}, {int(ids.max())}], outside "
            f"[0, {num_experts})"
        )

    def hook(layer: int):
        def replace(router: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            logits, weights, chosen = output
            if logits.shape[0] != ids.shape[0]:
                raise ValueError(
                    f"layer {layer}: the forward routes {logits.shape[0]} positions, the "
                    f"experts to replay cover {ids.shape[0]}"
                )
            forced = ids[:, layer].to(chosen.device)
            sigmoid = family.router_scores == "sigmoid"
            forced_weights = exact.route_weights(
                logits.float(),
                forced,
                score=family.router_scores,
                norm_topk_prob=router.norm_topk_prob
                if sigmoid
                else getattr(router, "norm_topk_prob", True),
                scaling=float(router.routed_scaling_factor) if sigmoid else 1.0,
            )
            return logits, forced_weights.to(weights.dtype), forced.to(chosen.dtype)

        return replace

    handles = [site.router.register_forward_hook(hook(site.layer)) for site in sites]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
