"""Test helpers: a model shape with a dense layer, and samples carrying routed experts."""

from __future__ import annotations

import torch

from ember_core.types import Sample
from ember_r3_routing import R3RoutingConfig

NUM_LAYERS, NUM_EXPERTS, TOPK, DENSE = 3, 6, 2, [1]
"""Layers 0 and 2 route to 2 of 6 experts; layer 1 is dense."""


def small_shape() -> R3RoutingConfig:
    return R3RoutingConfig(
        num_layers=NUM_LAYERS, num_experts=NUM_EXPERTS, topk=TOPK, dense_layers=list(DENSE)
    )


def random_experts(
    positions: int, config: R3RoutingConfig, generator: torch.Generator
) -> torch.Tensor:
    """Rollout-like ids [positions, layers, topk]: distinct experts per MoE row, dense rows 0."""
    experts = torch.zeros(positions, config.num_layers, config.topk, dtype=torch.int32)
    for layer in config.moe_layers:
        for p in range(positions):
            experts[p, layer] = torch.randperm(config.num_experts, generator=generator)[
                : config.topk
            ].to(torch.int32)
    return experts


def make_sample(
    length: int, config: R3RoutingConfig, *, seed: int, index: int = 0, group: int = 0
) -> Sample:
    generator = torch.Generator().manual_seed(seed)
    return Sample(
        tokens=torch.randint(0, 50, (length,), generator=generator).tolist(),
        response_length=length // 2,
        index=index,
        group_index=group,
        rollout_routed_experts=random_experts(length - 1, config, generator).to(
            config.expert_dtype
        ),
    )
