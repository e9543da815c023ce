"""What a transformers decoder computes at every layer, per sequence and position, recorded
while the embedded engine decodes (`HFEngine.trace`): the engine's side of `ember certify
--layers`, which compares it with the trainer's forward op by op.

Every family Ember serves builds its decoder layers alike (transformers 5.19): `input_layernorm`,
`self_attn` (its output first in a tuple; its output projection `o_proj` shows the heads'
output as its input), `post_attention_layernorm`, `mlp` (an MoE block with a `gate` router
returning (logits, weights, ids), or a dense MLP), the layer's output, and after the last layer
the model's `norm`. Each of those modules gets a forward hook; the engine says after each forward
which batch slot and which columns hold which sequence's positions (`LayerTrace.take`), so the
positions of a sequence come out in order, as prefill and decode steps forwarded them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["FINAL_OPS", "LAYER_OPS", "LayerTrace", "decoder_layers"]

LAYER_OPS = (
    "input_norm",
    "attention_core",
    "attention",
    "mlp_norm",
    "router_logits",
    "experts",
    "mlp",
    "layer",
)
"""The ops of a decoder layer in the order they run: `attention_core` is the attention's
output before its output projection (the heads side by side), `attention` after it; router rows
only in MoE layers, `experts` each position's expert ids as the router chose or a replay imposed
them."""
FINAL_OPS = ("final_norm",)
"""After the last layer."""

_SUBMODULES = {
    "input_norm": "input_layernorm",
    "attention": "self_attn",
    "mlp_norm": "post_attention_layernorm",
    "mlp": "mlp",
}


def decoder_layers(model: nn.Module) -> tuple[Sequence[nn.Module], nn.Module]:
    """The decoder layers and the final norm of a transformers causal LM.

    Raises:
        ValueError: The model is not built as the families Ember serves are (`model.layers`
            of layers with the four submodules above, and `model.norm`).
    """
    inner = getattr(model, "model", None)
    layers, norm = getattr(inner, "layers", None), getattr(inner, "norm", None)
    if not isinstance(layers, nn.ModuleList) or not isinstance(norm, nn.Module):
        raise ValueError(
            f"{type(model).__name__}: no `model.layers` and `model.norm` to trace layer by layer"
        )
    for index, layer in enumerate(layers):
        missing = [name for name in _SUBMODULES.values() if not hasattr(layer, name)]
        if missing:
            raise ValueError(
                f"{type(model).__name__}: layer {index} has no {', '.join(missing)}; the layer "
                "trace knows decoder layers with input_layernorm, self_attn, "
                "post_attention_layernorm and mlp"
            )
    return layers, norm


def _first(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


class LayerTrace:
    """Hooks a decoder and keeps, per traced sequence, each op's output at every position."""

    def __init__(self, model: nn.Module, sequences: int) -> None:
        """Hook `model` (until `close()`) for `sequences` sequences, numbered 0..sequences-1."""
        layers, norm = decoder_layers(model)
        self._last: dict[tuple[int, str], torch.Tensor] = {}
        self._kept: list[dict[tuple[int, str], list[torch.Tensor]]] = [{} for _ in range(sequences)]
        self._handles = []
        for index, layer in enumerate(layers):
            for op, name in _SUBMODULES.items():
                module = getattr(layer, name)
                self._handles.append(module.register_forward_hook(self._keep(index, op)))
            projection = getattr(layer.self_attn, "o_proj", None)
            if isinstance(projection, nn.Module):
                hook = self._keep_input(index, "attention_core")
                self._handles.append(projection.register_forward_pre_hook(hook))
            gate = getattr(layer.mlp, "gate", None)
            if isinstance(gate, nn.Module) and hasattr(layer.mlp, "experts"):
                self._handles.append(gate.register_forward_hook(self._router(index)))
            self._handles.append(layer.register_forward_hook(self._keep(index, "layer")))
        self._handles.append(norm.register_forward_hook(self._keep(len(layers), "final_norm")))

    def _keep(self, layer: int, op: str):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self._last[(layer, op)] = _first(output).detach().clone()

        return hook

    def _keep_input(self, layer: int, op: str):
        def hook(module: nn.Module, args: Any) -> None:
            self._last[(layer, op)] = args[0].detach().clone()

        return hook

    def _router(self, layer: int):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            logits, _, ids = output
            self._last[(layer, "router_logits")] = logits.detach()
            self._last[(layer, "experts")] = ids.detach()

        return hook

    def take(self, slots: Sequence[tuple[int, int, int]], batch: int, width: int) -> None:
        """Attribute the last forward ([batch, width] positions) to the traced sequences.

        Args:
            slots: (sequence, batch slot, first column) per sequence the forward advanced: the
                sequence's new positions are columns first..width-1 of that slot.
            batch: Rows of the forward.
            width: Columns of the forward.
        """
        for key, value in self._last.items():
            # Routers see [batch * width, ...]; the other ops [batch, width, ...].
            rows = value.reshape(batch, width, *value.shape[(1 if key[1] in _FLAT else 2) :])
            for sequence, slot, first in slots:
                if sequence < 0:  # a row of the batch that is not traced
                    continue
                self._kept[sequence].setdefault(key, []).append(rows[slot, first:].cpu())
        self._last.clear()

    def positions(self, sequence: int) -> int:
        """Positions of `sequence` recorded so far."""
        kept = self._kept[sequence].get((0, "layer"))
        return sum(t.shape[0] for t in kept) if kept else 0

    def result(self) -> list[dict[tuple[int, str], torch.Tensor]]:
        """Per sequence, (layer, op) -> [positions, ...] in position order (the final norm's
        layer is the number of layers)."""
        return [{k: torch.cat(v) for k, v in kept.items()} for kept in self._kept]

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


_FLAT = frozenset({"router_logits", "experts"})
"""Ops whose outputs have one row per token ([batch * width, ...])."""
