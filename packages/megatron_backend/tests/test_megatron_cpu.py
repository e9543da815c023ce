"""The CPU layer over megatron-core and the distributed setup helper."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ember_megatron_backend import cpu
from ember_megatron_backend.parallel import ParallelConfig, init_distributed


def test_patches_applied_once_and_idempotent(dist_env):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    assert cpu.cpu_patches_applied()
    before = RotaryEmbedding.get_emb
    cpu.apply_cpu_patches()
    assert RotaryEmbedding.get_emb is before


def test_global_memory_buffer_on_cpu(dist_env):
    from megatron.core.utils import GlobalMemoryBuffer

    buf = GlobalMemoryBuffer()
    a = buf.get_tensor((2, 3), torch.float32, "x")
    b = buf.get_tensor((3,), torch.float32, "x")
    assert a.device.type == "cpu" and a.shape == (2, 3)
    assert b.data_ptr() == a.data_ptr()  # reused, as on GPU


def test_default_causal_mask_on_cpu(dist_env):
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    expected = torch.tensor([[False, True, True], [False, False, True], [False, False, False]])
    assert torch.equal(utils.get_default_causal_mask(3), expected)
    assert torch.equal(fused_softmax.get_default_causal_mask(3), expected)


def test_rng_tracker_fork_is_reproducible_and_isolated(dist_env):
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    def draw(seed: int) -> torch.Tensor:
        tracker = CudaRNGStatesTracker()
        tracker.add("stream", seed)
        with tracker.fork("stream"):
            first = torch.rand(4)
        with tracker.fork("stream"):
            second = torch.rand(4)
        return torch.cat([first, second])

    torch.manual_seed(0)
    outer = torch.get_rng_state()
    a = draw(7)
    assert torch.equal(torch.get_rng_state(), outer), "fork must restore the outer CPU state"
    assert torch.equal(a, draw(7))
    assert not torch.equal(a[:4], a[4:]), "the named stream advances across forks"
    assert not torch.equal(a, draw(8))


def test_full_activation_recompute_runs_and_matches(dist_env):
    from ember_core.types import Sample, pack_samples
    from ember_megatron_backend.forward import model_inputs
    from ember_megatron_backend.model import ModelConfig, build_model

    def recompute(config) -> None:
        config.recompute_granularity = "full"
        config.recompute_method = "uniform"
        config.recompute_num_layers = 1

    cfg = ModelConfig.preset("tiny-moe").replace(num_layers=2)
    samples = [Sample(tokens=list(range(3, 12)), response_length=4)]
    inputs = model_inputs(pack_samples(samples))
    grads = []
    for adjust in (None, recompute):
        model = build_model(cfg, seed=3, adjust_config=adjust)
        model.train()
        model(**inputs).square().mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert model.config.recompute_granularity == "full"
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, msg=name)


def test_init_distributed_single_process(dist_env):
    from megatron.core import parallel_state as ps

    assert dist.get_backend() == "gloo"
    assert dist.get_world_size() == 1
    assert ps.get_tensor_model_parallel_world_size() == 1
    assert ps.get_expert_model_parallel_world_size() == 1
    assert ps.get_data_parallel_world_size() == 1
    init_distributed()  # a second call is a no-op


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("tensor_parallel", 0),
        ("expert_parallel", -1),
        ("context_parallel", 1.5),
        ("pipeline_parallel", True),
    ],
)
def test_parallel_config_rejects_bad_sizes(key, value):
    with pytest.raises(ValueError, match=f"parallel.{key}"):
        ParallelConfig(**{key: value})


def test_world_size_must_fit_parallel_sizes():
    from ember_megatron_backend.parallel import _check_world

    with pytest.raises(ValueError, match="not a multiple of tensor_parallel"):
        _check_world(ParallelConfig(tensor_parallel=2), 3)
    with pytest.raises(ValueError, match="expert_parallel"):
        _check_world(ParallelConfig(expert_parallel=4), 2)


def test_context_parallel_is_refused_without_transformer_engine(dist_env):
    """megatron-core splits attention over CP ranks in TE attention only; the refusal comes
    before anything is initialised, and names the key to change."""
    with pytest.raises(ValueError) as excinfo:
        init_distributed(ParallelConfig(context_parallel=2), rank=0, world_size=2)
    message = str(excinfo.value)
    assert message.startswith("train.parallel.context_parallel=2: context parallelism needs")
    assert "Transformer Engine attention on GPUs" in message
    assert "set train.parallel.context_parallel=1" in message
