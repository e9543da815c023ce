"""What the trainer's forward computes at every layer, per sample and position: the trainer's
side of `ember certify --layers` (the engine's is `ember_rollout.layer_trace`, with the same op
names).

megatron-core's `TransformerLayer` runs `input_layernorm`, `self_attention` ((output, bias)),
`pre_mlp_layernorm`, `mlp` ((output, bias); an MoE layer's `router` scores the experts) and
returns (hidden, context); the block's `final_layernorm` follows the last layer. The attention's
`linear_proj` shows its input (the core attention's output). Forward hooks
keep each output; the padded [S, B] layout's rows are mapped back to the stream
(`forward.router_rows_to_stream`) and the stream to samples.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ember_core.types import Sample

__all__ = ["trace_forward"]

_SUBMODULES = {
    "input_norm": "input_layernorm",
    "attention": "self_attention",
    "mlp_norm": "pre_mlp_layernorm",
    "mlp": "mlp",
}


def _unwrap(model: Any) -> Any:
    while hasattr(model, "module"):
        model = model.module
    return model


def _output(output: Any) -> Tensor:
    """A module's main output, its separately returned bias added (megatron-core's linear
    layers may return the bias for a later fused add)."""
    if not isinstance(output, tuple):
        return output
    main, bias = output[0], output[1] if len(output) > 1 else None
    return main + bias if isinstance(bias, Tensor) and bias.shape[-1] == main.shape[-1] else main


def trace_forward(
    model: Any,
    samples: Sequence[Sample],
    *,
    temperature: float,
    context: Any = None,
    plan: Sequence[tuple[Sequence[int], Any]] | None = None,
    keep: int | None = None,
) -> tuple[list[dict[tuple[int, str], Tensor]], list[Tensor]]:
    """Forward `samples` micro-batch by micro-batch, as the old-log-prob pass does, with every
    layer's ops recorded for the first `keep` samples.

    Args:
        model: The actor (one rank, no pipeline parallelism).
        samples: The samples.
        temperature: The rollout temperature of the log-probs.
        context: Called with each micro-batch, returns a context manager its forward runs in
            (the plugins' forward context: routing replay among them).
        plan: (sample indices, padded layout or None) per micro-batch, in order; default one
            micro-batch of every sample.
        keep: Samples whose ops are kept (default: all).

    Returns:
        For each of the first `keep` samples, (layer, op) -> [T_i - 1, ...] over the positions
        that predict a token, in `ember_rollout.layer_trace`'s names (the final norm's layer is
        the number of layers; `experts` as sorted ids); and every sample's log-probs.

    Raises:
        ValueError: A norm is fused into the next linear layer (Transformer Engine's spec).
    """
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.moe.router import TopKRouter

    from ember_megatron_backend.batches import pack_micro_batch
    from ember_megatron_backend.forward import router_rows_to_stream, score_batch

    inner = _unwrap(model)
    decoder = inner.decoder
    last: dict[tuple[int, str], Tensor] = {}
    handles = []

    def keep_output(layer: int, op: str):
        def hook(module: Any, args: Any, output: Any) -> None:
            last[(layer, op)] = _output(output).detach().clone()  # later ops add in place

        return hook

    def keep_input(layer: int, op: str):
        def hook(module: Any, args: Any) -> None:
            last[(layer, op)] = args[0].detach().clone()

        return hook

    def route(layer: int):
        def hook(router: Any, args: Any, output: Any) -> None:
            hidden = args[0]
            last[(layer, "router_logits")] = router.gating(hidden).detach()
            routing_map = output[1].detach()
            last[(layer, "experts")] = routing_map.float().topk(router.topk, dim=-1).indices

        return hook

    for layer in decoder.layers:
        index = layer.layer_number - 1
        norms = ("input_layernorm", "pre_mlp_layernorm")
        fused = [name for name in norms if isinstance(getattr(layer, name), IdentityOp)]
        if fused:
            raise ValueError(
                f"layer {index}: {', '.join(fused)} is fused into the next linear layer "
                "(Transformer Engine's layer spec); the layer trace reads the local spec's "
                "separate norms only"
            )
        for op, name in _SUBMODULES.items():
            handles.append(getattr(layer, name).register_forward_hook(keep_output(index, op)))
        projection = layer.self_attention.linear_proj
        handles.append(projection.register_forward_pre_hook(keep_input(index, "attention_core")))
        router = getattr(layer.mlp, "router", None)
        if isinstance(router, TopKRouter):
            handles.append(router.register_forward_hook(route(index)))
        handles.append(layer.register_forward_hook(keep_output(index, "layer")))
    num_layers = inner.config.num_layers
    final = decoder.final_layernorm.register_forward_hook(keep_output(num_layers, "final_norm"))
    handles.append(final)
    kept = len(samples) if keep is None else keep
    traces: list[dict[tuple[int, str], Tensor]] = [{} for _ in range(min(kept, len(samples)))]
    log_probs: list[Tensor | None] = [None] * len(samples)
    try:
        for indices, layout in plan or [(range(len(samples)), None)]:
            mb = pack_micro_batch(model, list(samples), list(indices), layout)
            with torch.no_grad(), context(mb) if context is not None else contextlib.nullcontext():
                out = score_batch(
                    model,
                    mb.packed,
                    mb.layout,
                    window=mb.window,
                    role="actor",
                    temperature=temperature,
                )
            for i, values in zip(mb.indices, out.log_probs, strict=True):
                log_probs[i] = values.detach().cpu()
            starts = mb.packed.cu_seqlens.tolist()
            for key, value in last.items():
                # [S, B, ...] or [S * B, ...]: row s * B + b, as the routers see them.
                rows = value.reshape(-1, value.shape[-1])
                if key[1] == "experts":
                    rows = rows.sort(dim=-1).values
                stream = router_rows_to_stream(rows.cpu(), mb.packed, mb.layout)
                for k, i in enumerate(mb.indices):
                    if i < kept:
                        length = samples[i].total_length - 1
                        traces[i][key] = stream[starts[k] : starts[k] + length]
            last.clear()
    finally:
        for handle in handles:
            handle.remove()
    missing = [i for i, values in enumerate(log_probs) if values is None]
    if missing:
        raise ValueError(f"the plan leaves samples {missing[:5]} out")
    return traces, log_probs  # type: ignore[return-value]
