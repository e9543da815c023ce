"""The GPU code path without Transformer Engine, checked on CPU against megatron-core's rules.

Softmax: the attention built from the GPU config must neither need megatron's compiled softmax
extension nor, where one is installed, drop the packed block-diagonal mask. Collectives: one
module places them on the device the group's backend accepts. Seeds: on GPUs weights are drawn
from megatron-core's RNG tracker, which ``train.seed`` must drive.
"""

from __future__ import annotations

import ast
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ember_megatron_backend
from ember_megatron_backend import comm, cpu
from ember_megatron_backend import model as model_module
from ember_megatron_backend.model import (
    ModelConfig,
    build_model,
    layer_spec,
    packed_causal_mask,
    transformer_config,
)

# -- attention softmax ----------------------------------------------------------------------------


def _fused_softmax_kernels() -> dict[str, types.ModuleType]:
    """Python stand-ins for megatron's compiled softmax kernels, with their contracts: the
    "upper triangular" kernel takes no mask (it applies plain causality), the masked one
    fills masked scores with -10000 like ``attention_mask_func``."""

    def causal(inputs, scale):  # [attn_batches, sq, sk]
        sq, sk = inputs.shape[-2:]
        future = torch.ones(sq, sk, dtype=torch.bool).triu(1)
        scores = (inputs.float() * scale).masked_fill(future, float("-inf"))
        return scores.softmax(-1).to(inputs.dtype)

    def masked(inputs, mask, scale):  # [b, np, sq, sk]
        scores = (inputs.float() * scale).masked_fill(mask, -10000.0)
        return scores.softmax(-1).to(inputs.dtype)

    upper = types.ModuleType("scaled_upper_triang_masked_softmax_cuda")
    upper.forward = causal
    general = types.ModuleType("scaled_masked_softmax_cuda")
    general.forward = masked
    general.get_batch_per_block = lambda sq, sk, b, np: 1
    return {upper.__name__: upper, general.__name__: general}


@pytest.mark.parametrize("kernels", ["absent", "installed"])
def test_gpu_bf16_attention_softmax_keeps_packed_samples_apart(dist_env, monkeypatch, kernels):
    from megatron.core.transformer.spec_utils import build_module

    if kernels == "installed":
        for name, module in _fused_softmax_kernels().items():
            monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(model_module, "uses_gpu", lambda: True)  # a GPU without TE
    cfg = ModelConfig.preset("tiny-moe")
    config = transformer_config(cfg, dtype=torch.bfloat16)
    attention_spec = layer_spec(config).layer_specs[0].submodules.self_attention
    attention = build_module(
        attention_spec.submodules.core_attention,
        config=config,
        layer_number=1,
        attn_mask_type=attention_spec.params["attn_mask_type"],
        attention_type="self",
    )
    # Two packed samples of 10 and 14 tokens: 16 < sk = 24 <= 4096, all sizes multiples of 4,
    # the shapes megatron's fused path takes when the fusion is on.
    heads, length = cfg.num_attention_heads, 24
    mask = packed_causal_mask(torch.tensor([0, 10, length]))  # [1, 1, T, T], True = masked
    scores = torch.randn(1, heads, length, length, generator=torch.Generator().manual_seed(0))
    probs = attention.scale_mask_softmax(
        scores.to(torch.bfloat16), mask, attention.softmax_offset
    )  # [1, heads, T, T]
    assert probs.dtype == torch.bfloat16
    assert torch.count_nonzero(probs[..., 10:, :10]) == 0  # sample 2 never sees sample 1
    assert torch.count_nonzero(probs[..., :10, 10:]) == 0
    reference = scores.to(torch.bfloat16).float().masked_fill(mask, float("-inf")).softmax(-1)
    torch.testing.assert_close(probs.float(), reference, atol=1e-2, rtol=0)


# -- collectives ----------------------------------------------------------------------------------


def test_collective_device_follows_the_group_backend(dist_env, monkeypatch):
    from megatron.core import parallel_state as ps

    group = ps.get_data_parallel_group()
    assert dist.get_backend(group) == "gloo"
    assert comm.collective_device(group) == torch.device("cpu")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert comm.collective_device(group) == torch.device("cuda", 3)


def test_all_reduce_keeps_the_tensor_and_its_device(dist_env):
    from megatron.core import parallel_state as ps

    values = torch.tensor([1.0, 2.0], dtype=torch.float64)
    assert comm.all_reduce(values, group=ps.get_data_parallel_group()) is values
    assert values.tolist() == [1.0, 2.0] and values.device.type == "cpu"
    assert [t.tolist() for t in comm.all_gather(values, ps.get_data_parallel_group())] == [
        [1.0, 2.0]
    ]


_COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "send",
    "recv",
}


def test_only_the_comm_module_calls_torch_distributed_collectives():
    """Complements the two-rank check (test_megatron_data_parallel.py), which only sees the
    collectives a CPU run reaches (not sequence parallelism, pipeline stages or exports)."""
    offenders = []
    for path in sorted(Path(ember_megatron_backend.__file__).parent.glob("*.py")):
        if path.name == "comm.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in _COLLECTIVES:
                if isinstance(node.value, ast.Name) and node.value.id in ("dist", "distributed"):
                    offenders.append(f"{path.name}:{node.lineno} {node.attr}")
                if isinstance(node.value, ast.Attribute) and node.value.attr == "distributed":
                    offenders.append(f"{path.name}:{node.lineno} {node.attr}")
            if isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
                names = {alias.name for alias in node.names} & _COLLECTIVES
                offenders.extend(f"{path.name}:{node.lineno} import {n}" for n in sorted(names))
    assert offenders == []


# -- weight-init seed -----------------------------------------------------------------------------


def _gpu_initialised(seed: int):
    """`build_model(seed=seed)` through megatron-core's GPU initialisation, run on CPU: weights
    are drawn inside the RNG tracker's forks (cpu.py emulates the tracker with CPU generators),
    and the allocations on ``torch.cuda.current_device()`` land on the CPU."""
    with cpu.cuda_device_is_cpu():
        return build_model(
            ModelConfig.preset("tiny-moe"),
            seed=seed,
            adjust_config=lambda config: setattr(config, "use_cpu_initialization", False),
        )


def _tracker_states() -> dict[str, torch.Tensor]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()}


def test_train_seed_decides_every_gpu_initialised_weight(dist_env):
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    from ember_megatron_backend.parallel import ParallelConfig

    before = _tracker_states()
    first = dict(_gpu_initialised(1).named_parameters())
    after = _tracker_states()
    other = dict(_gpu_initialised(2).named_parameters())
    random_init = [n for n, p in first.items() if not torch.all(p == p.flatten()[0])]
    for part in ("router", "linear_qkv", "local_experts", "embedding", "output_layer"):
        assert any(part in n for n in random_init), part
    same = [n for n in random_init if torch.equal(first[n], other[n])]
    assert same == []  # a different train.seed changes every randomly initialised weight

    # ... and parallel.seed changes none of them.
    model_parallel_cuda_manual_seed(ParallelConfig().seed + 1)
    try:
        again = dict(_gpu_initialised(1).named_parameters())
    finally:
        get_cuda_rng_tracker().set_states(before)
    assert [n for n in first if not torch.equal(first[n], again[n])] == []

    # The tracker's streams (seeded from parallel.seed) are what they were before the build.
    assert before.keys() == after.keys()
    assert [k for k in before if not torch.equal(before[k], after[k])] == []
