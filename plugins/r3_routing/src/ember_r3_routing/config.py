"""The `r3_routing` config section: the model shape routed experts are checked against."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

SECTION = "r3_routing"
"""Name of the section in run configs (and of the plugin)."""


@dataclass(kw_only=True, slots=True)
class R3RoutingConfig:
    """Shape of the MoE model whose routing is replayed.

    Fields left at 0 are taken from the run's training model when the run config resolves one
    (`train.model_config()`); set them by hand for a run config that cannot.
    """

    num_layers: int = 0
    """Decoder layers of the model: the layer axis of the routed experts."""
    num_experts: int = 0
    """Routed experts per MoE layer; every expert id must lie in [0, num_experts)."""
    topk: int = 0
    """Experts each token is routed to: the last axis of the routed experts."""
    dense_layers: list[int] = field(default_factory=list)
    """Layer indices (from 0) with a dense MLP and no router; engines report zeros for them."""

    def __post_init__(self) -> None:
        for key in ("num_layers", "num_experts", "topk"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{key}={value!r}: expected an integer >= 1 (0 = not set)")
        if self.num_experts and self.topk > self.num_experts:
            raise ValueError(
                f"topk={self.topk}: expected 1 <= topk <= num_experts={self.num_experts}"
            )
        layers = self.dense_layers
        if any(not isinstance(i, int) or isinstance(i, bool) for i in layers):
            raise ValueError(f"dense_layers={layers!r}: expected a list of layer indices")
        if len(set(layers)) != len(layers):
            raise ValueError(f"dense_layers={layers!r}: expected each layer at most once")
        if self.num_layers:
            outside = [i for i in layers if not 0 <= i < self.num_layers]
            if outside:
                raise ValueError(
                    f"dense_layers={layers!r}: expected indices in [0, num_layers="
                    f"{self.num_layers}), got {outside}"
                )
            if len(layers) == self.num_layers:
                raise ValueError(
                    f"dense_layers={layers!r}: every layer is dense, so there is no routing to "
                    "replay; r3_routing needs an MoE model"
                )

    def require_shape(self) -> None:
        """Raise ValueError naming each shape field that is still 0."""
        unset = [k for k in ("num_layers", "num_experts", "topk") if not getattr(self, k)]
        if unset:
            keys = ", ".join(f"{SECTION}.{k}" for k in unset)
            raise ValueError(
                f"{keys}: not set; r3_routing checks routed experts against the model shape, so "
                "set num_layers, num_experts and topk (and dense_layers, if any) in its section"
            )

    @property
    def moe_layers(self) -> list[int]:
        """The layers with a router, ascending."""
        dense = set(self.dense_layers)
        return [i for i in range(self.num_layers) if i not in dense]

    @property
    def expert_dtype(self) -> torch.dtype:
        """The smallest integer dtype that holds every expert id."""
        return compact_dtype(self.num_experts)


def compact_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer dtype that holds ids 0 .. num_experts - 1 (uint8 up to 256 experts)."""
    if num_experts <= 1 << 8:
        return torch.uint8
    if num_experts <= 1 << 15:
        return torch.int16
    return torch.int32
