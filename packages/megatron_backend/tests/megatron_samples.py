"""Synthetic rollout samples and worker settings shared by the worker tests."""

from __future__ import annotations

import torch

from ember_core.config import AlgorithmConfig, SamplingConfig
from ember_core.types import Sample
from ember_megatron_backend.config import BackendConfig, OptimizerConfig

VOCAB = 256
LAYERS = 4
EXPERTS = 8
TOPK = 2


def make_samples(
    num_groups: int = 4,
    per_group: int = 2,
    *,
    seed: int = 0,
    first_group: int = 0,
    experts: bool = True,
    masked: bool = False,
) -> list[Sample]:
    """Random prompt+response samples with rewards in [0, 1], rollout log-probs and experts."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for k in range(num_groups * per_group):
        length = int(torch.randint(8, 18, (1,), generator=g))
        response = int(torch.randint(2, length - 2, (1,), generator=g))
        mask = None
        if masked:
            mask = [1] * response
            mask[0] = 0
        samples.append(
            Sample(
                tokens=torch.randint(0, VOCAB, (length,), generator=g).tolist(),
                response_length=response,
                index=first_group * per_group + k,
                group_index=first_group + k // per_group,
                reward=float(torch.rand(1, generator=g)),
                loss_mask=mask,
                rollout_log_probs=(-3 * torch.rand(response, generator=g)).tolist(),
                rollout_routed_experts=(
                    torch.stack(
                        [
                            torch.randperm(EXPERTS, generator=g)[:TOPK]
                            for _ in range((length - 1) * LAYERS)
                        ]
                    )
                    .reshape(length - 1, LAYERS, TOPK)
                    .to(torch.int32)
                    if experts
                    else None
                ),
            )
        )
    return samples


def backend(**changes) -> BackendConfig:
    """A tiny-moe backend with weights far enough from uniform that losses move quickly."""
    settings = dict(
        model_overrides={"init_method_std": 0.1},
        optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.0),
        num_steps_per_rollout=2,
        micro_batch_size=2,
    )
    settings.update(changes)
    return BackendConfig(**settings)


def sampling(temperature: float = 0.8) -> SamplingConfig:
    return SamplingConfig(temperature=temperature, n_samples_per_prompt=2)


def algorithm(**changes) -> AlgorithmConfig:
    return AlgorithmConfig(**changes)
