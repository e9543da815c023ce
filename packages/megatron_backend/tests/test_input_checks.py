"""What the backend used to accept silently: a second layout, skipped steps, dropped HF fields."""

from __future__ import annotations

import logging
import math

import pytest
from megatron_samples import algorithm, backend, make_samples, sampling

from ember_megatron_backend.config import OptimizerConfig
from ember_megatron_backend.hf_layout import hf_config, model_config_from_hf
from ember_megatron_backend.model import ModelConfig
from ember_megatron_backend.optimizer import MegatronAdam
from ember_megatron_backend.parallel import ParallelConfig, init_distributed
from ember_megatron_backend.worker import MegatronWorker

# --- init_distributed twice ---------------------------------------------------------------------


def test_second_init_with_another_layout_names_both(dist_env):
    from megatron.core import parallel_state as ps

    with pytest.raises(ValueError) as info:
        init_distributed(ParallelConfig(tensor_parallel=2, expert_parallel=2))
    message = str(info.value)
    assert "already initialised as rank 0 of 1, tensor_parallel=1," in message
    assert "asked for rank 0 of 1, tensor_parallel=2," in message
    assert "expert_parallel=1" in message and "expert_parallel=2" in message
    with pytest.raises(ValueError, match="asked for rank 1 of 2, tensor_parallel=1"):
        init_distributed(rank=1, world_size=2)
    init_distributed(ParallelConfig(seed=7))  # the same layout: still a no-op
    assert ps.get_tensor_model_parallel_world_size() == 1  # the first layout is untouched


# --- the optimizer's skipped-step flag ----------------------------------------------------------


class _FakeMcoreOptimizer:
    """megatron-core's optimizer as MegatronAdam sees it: step() -> (updated, norm, zeros)."""

    def __init__(self, results):
        self.results = list(results)
        self.param_groups = [{"params": []}]

    def zero_grad(self):
        pass

    def step(self):
        return self.results.pop(0)


def _megatron_adam(model, results) -> MegatronAdam:
    # get_megatron_optimizer allocates on CUDA; the wrapper around it is what is under test.
    adam = MegatronAdam.__new__(MegatronAdam)
    adam.model, adam.cfg = model, OptimizerConfig(lr=1e-3)
    adam.optimizer = _FakeMcoreOptimizer(results)
    return adam


def test_skipped_step_is_a_metric_and_a_warning(dist_env):
    worker = MegatronWorker(backend(), algorithm(), sampling())
    worker.actor_optimizer = _megatron_adam(worker.actor, [(False, None, None), (True, 0.5, 0)])
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("ember_megatron_backend.optimizer")
    logger.addHandler(handler)
    try:
        batch = worker.prepare(0, make_samples())
        steps = worker.train(0, batch)
    finally:
        logger.removeHandler(handler)
    assert [s["train/skipped_step"] for s in steps] == [1.0, 0.0]
    assert math.isnan(steps[0]["train/grad_norm"]) and steps[1]["train/grad_norm"] == 0.5
    (record,) = records
    assert record.levelno == logging.WARNING
    assert "optimizer step 0 skipped" in record.getMessage()


def test_steps_that_update_report_no_skip(dist_env):
    worker = MegatronWorker(backend(num_steps_per_rollout=1), algorithm(), sampling())
    (step,) = worker.train(0, worker.prepare(0, make_samples(num_groups=2)))
    assert step["train/skipped_step"] == 0.0


# --- HF import keeps router_aux_loss_coef -------------------------------------------------------


def test_router_aux_loss_coef_round_trips():
    cfg = ModelConfig.preset("tiny-moe").replace(moe_aux_loss_coeff=0.01)
    assert hf_config(cfg).router_aux_loss_coef == 0.01
    assert model_config_from_hf(hf_config(cfg)).moe_aux_loss_coeff == 0.01


def test_router_aux_loss_coef_of_a_checkpoint_config_is_used():
    config = hf_config(ModelConfig.preset("tiny-moe"))
    config.router_aux_loss_coef = 0.001  # what Qwen3-30B-A3B's config.json says
    assert model_config_from_hf(config).moe_aux_loss_coeff == 0.001
    # An override still wins, as BackendConfig.model_overrides applies it.
    assert model_config_from_hf(config, moe_aux_loss_coeff=0.0).moe_aux_loss_coeff == 0.0
