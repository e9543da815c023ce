"""Data-parallel wrapping, the learning-rate schedule and one optimizer interface for GPU and CPU.

Models train inside megatron-core's ``DistributedDataParallel`` on both devices: backward
accumulates every gradient into the fp32 buffer ``param.main_grad``, and ``step()`` reduces the
buffers across data-parallel ranks (``finalize_model_grads``: DP all-reduce, plus the
sequence-parallel norm and tied-embedding reductions) before updating. On GPUs the update is
megatron-core's optimizer (``get_megatron_optimizer``: fp32 master weights for bf16 models,
global-norm clipping, Adam); on CPU, where those wrappers allocate on CUDA, torch's AdamW with
the same settings, the same global-norm clipping (norms summed over the model-parallel groups as
megatron-core does) and the same weight-decay exemptions (1-D parameters and biases).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ember_core.algorithms import Registry
from ember_megatron_backend import comm
from ember_megatron_backend.config import OptimizerConfig
from ember_megatron_backend.parallel import uses_gpu

logger = logging.getLogger(__name__)

__all__ = [
    "LR_DECAY_STYLES",
    "ModelOptimizer",
    "StepResult",
    "build_optimizer",
    "learning_rate",
    "wrap_ddp",
]

LR_DECAY_STYLES: Registry[Callable[[float], float]] = Registry("LR decay style")
"""Decay styles by name: progress in [0, 1] -> fraction of (lr - min_lr) still applied."""
LR_DECAY_STYLES.add("constant", lambda progress: 1.0)
LR_DECAY_STYLES.add("linear", lambda progress: 1.0 - progress)
LR_DECAY_STYLES.add("cosine", lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)))


def learning_rate(step: int, cfg: OptimizerConfig) -> float:
    """The learning rate of optimizer step `step` (counted from 0 over the whole run).

    Warmup: step s < lr_warmup_steps uses lr * (s + 1) / lr_warmup_steps, so the first step
    already moves. Then the decay style takes the rate from lr (at step lr_warmup_steps) to
    min_lr (at step lr_decay_steps) and holds min_lr afterwards; "constant" stays at lr.
    """
    if step < cfg.lr_warmup_steps:
        return cfg.lr * (step + 1) / cfg.lr_warmup_steps
    if cfg.lr_decay_steps is None:
        progress = 0.0
    else:
        span = max(cfg.lr_decay_steps - cfg.lr_warmup_steps, 1)
        progress = min(1.0, (step - cfg.lr_warmup_steps) / span)
    coeff = LR_DECAY_STYLES.get(cfg.lr_decay_style)(progress)
    if coeff == 1.0:  # exactly lr, without the rounding of min_lr + (lr - min_lr)
        return cfg.lr
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * coeff


def wrap_ddp(model: Any) -> Any:
    """Wrap a GPTModel in megatron-core's DistributedDataParallel (fp32 ``main_grad`` buffers).

    Parameters are broadcast from the first rank of each data-parallel group, so every replica
    starts identical whatever each rank loaded or initialised.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from ember_megatron_backend import cpu

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
    )
    allocate = contextlib.nullcontext() if uses_gpu() else cpu.cuda_device_is_cpu()
    with allocate:
        ddp = DistributedDataParallel(model.config, ddp_config, model)
    ddp.broadcast_params()
    return ddp


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one optimizer step reports."""

    grad_norm: float
    """Global L2 norm of the reduced gradients before clipping."""
    lr: float
    """Learning rate the step used."""
    skipped: bool = False
    """The optimizer left the weights unchanged (megatron-core found inf/NaN gradients under a
    loss scaler); logged as ``train/skipped_step``."""


class ModelOptimizer:
    """The optimizer of one DDP-wrapped model; `build_optimizer` picks the implementation.

    One step: ``zero_grad()``, backward passes (accumulating into ``main_grad``), then
    ``step(step_index)``, which reduces gradients across ranks, clips them to ``clip_grad``,
    applies the scheduled learning rate and updates the weights.
    """

    kind = "abstract"

    def __init__(self, model: Any, cfg: OptimizerConfig) -> None:
        self.model = model
        self.cfg = cfg

    def zero_grad(self) -> None:
        """Clear the gradient buffers before a step's first backward."""
        raise NotImplementedError

    def step(self, step_index: int) -> StepResult:
        """Reduce, clip and apply the accumulated gradients at run-wide step `step_index`."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Optimizer state for a checkpoint (tensors and plain Python values only)."""
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output.

        Raises:
            ValueError: if the state was written by the other implementation.
        """
        raise NotImplementedError

    def _finalize_grads(self) -> None:
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.model])

    def _set_lr(self, groups: list[dict[str, Any]], lr: float) -> None:
        for group in groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.cfg.weight_decay * group.get("wd_mult", 1.0)

    def _check_kind(self, state: dict[str, Any]) -> None:
        if state.get("kind") != self.kind:
            raise ValueError(
                f"optimizer state was written by {state.get('kind')!r}, but this run uses "
                f"{self.kind!r} (GPU runs use megatron-core's optimizer, CPU runs torch's AdamW)"
            )


class TorchAdamW(ModelOptimizer):
    """CPU: torch AdamW over the model's parameters, fed from the DDP ``main_grad`` buffers.

    A model below float32 (``train.dtype: bfloat16``) trains on float32 master copies of its
    weights, as megatron-core's mixed-precision optimizer does on GPUs: the gradients (reduced
    in float32, ``grad_reduce_in_fp32``) update the masters, and the model gets the masters
    rounded to its dtype after each step. The masters are part of the optimizer's state, so a
    resumed run continues from the same float32 weights. A float32 parameter is its own master.
    """

    kind = "torch_adamw"

    def __init__(self, model: Any, cfg: OptimizerConfig) -> None:
        super().__init__(model, cfg)
        decay, no_decay = [], []
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            (no_decay if param.dim() == 1 or name.endswith(".bias") else decay).append(param)
        self.params = decay + no_decay
        self.masters: list[Tensor] = [
            param if param.dtype == torch.float32 else param.detach().float().clone()
            for param in self.params
        ]
        """Per parameter, the float32 tensor the optimizer updates (the parameter itself when
        it is float32)."""
        groups = [
            {"params": self.masters[: len(decay)], "wd_mult": 1.0},
            {"params": self.masters[len(decay) :], "wd_mult": 0.0},
        ]
        self.optimizer = torch.optim.AdamW(
            [g for g in groups if g["params"]],
            lr=cfg.lr,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
            # One fused kernel for the whole update (torch picks a Python loop over the
            # tensors on CPU unless asked); the same AdamW arithmetic.
            fused=True,
        )
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        # The parameters the gradient norm counts (TP duplicates once), dense and expert.
        self._norm_groups: tuple[list[Tensor], list[Tensor]] = ([], [])
        for param, master in zip(self.params, self.masters, strict=True):
            if param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param):
                self._norm_groups[int(not getattr(param, "allreduce", True))].append(master)

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        for master in self.masters:
            master.grad = None

    @torch.no_grad()
    def step(self, step_index: int) -> StepResult:
        self._finalize_grads()
        for param, master in zip(self.params, self.masters, strict=True):
            master.grad = param.main_grad.to(master.dtype)
        grad_norm = self._grad_norm()
        if self.cfg.clip_grad > 0:
            coeff = self.cfg.clip_grad / (grad_norm + 1e-6)  # megatron-core's formula
            if coeff < 1.0:
                torch._foreach_mul_([master.grad for master in self.masters], coeff)
        lr = learning_rate(step_index, self.cfg)
        self._set_lr(self.optimizer.param_groups, lr)
        self.optimizer.step()
        for param, master in zip(self.params, self.masters, strict=True):
            master.grad = None
            if master is not param:
                param.copy_(master)  # rounded to the model's dtype
        return StepResult(grad_norm=grad_norm, lr=lr)

    def _grad_norm(self) -> float:
        """Global L2 norm: TP duplicates counted once, summed over the model-parallel groups."""
        from megatron.core import parallel_state as ps

        sums = torch.zeros(2, dtype=torch.float64)  # [dense, expert]
        for k, params in enumerate(self._norm_groups):
            if params:
                grads = [param.grad.detach() for param in params]
                norms = torch._foreach_norm(grads, 2, dtype=torch.float64)
                sums[k] = torch.stack(norms).square().sum()
        dense, expert = sums[:1].clone(), sums[1:].clone()
        if dist.is_initialized():
            comm.all_reduce(dense, group=ps.get_model_parallel_group())
            comm.all_reduce(expert, group=ps.get_expert_tensor_model_pipeline_parallel_group())
        return float((dense + expert).sqrt())

    def _below_fp32(self) -> list[int]:
        """The indices of the parameters with a master copy of their own."""
        pairs = zip(self.params, self.masters, strict=True)
        return [i for i, (param, master) in enumerate(pairs) if master is not param]

    def state_dict(self) -> dict[str, Any]:
        masters = {i: self.masters[i].detach().clone() for i in self._below_fp32()}
        return {"kind": self.kind, "state": self.optimizer.state_dict(), "masters": masters}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_kind(state)
        masters = state.get("masters", {})
        wanted = self._below_fp32()
        if sorted(masters) != wanted:
            raise ValueError(
                f"the optimizer state holds float32 master weights of {len(masters)} "
                f"parameters, this model needs {len(wanted)}: the checkpoint was written with "
                "another train.dtype"
            )
        self.optimizer.load_state_dict(state["state"])
        with torch.no_grad():
            for i in wanted:
                self.masters[i].copy_(masters[i])
                self.params[i].copy_(self.masters[i])


class MegatronAdam(ModelOptimizer):
    """GPU: megatron-core's optimizer (Adam, fp32 master weights for bf16, global-norm clip)."""

    kind = "megatron"

    def __init__(self, model: Any, cfg: OptimizerConfig) -> None:
        super().__init__(model, cfg)
        from megatron.core.optimizer import OptimizerConfig as McoreOptimizerConfig
        from megatron.core.optimizer import get_megatron_optimizer

        params_dtype = next(model.parameters()).dtype
        mcore = McoreOptimizerConfig(
            optimizer="adam",
            lr=cfg.lr,
            min_lr=cfg.min_lr,
            weight_decay=cfg.weight_decay,
            adam_beta1=cfg.adam_beta1,
            adam_beta2=cfg.adam_beta2,
            adam_eps=cfg.adam_eps,
            clip_grad=cfg.clip_grad,
            bf16=params_dtype == torch.bfloat16,
            params_dtype=params_dtype,
            use_distributed_optimizer=False,
        )
        self.optimizer = get_megatron_optimizer(mcore, [model])

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self, step_index: int) -> StepResult:
        self._finalize_grads()
        lr = learning_rate(step_index, self.cfg)
        self._set_lr(self.optimizer.param_groups, lr)
        # megatron-core 0.16.1 optimizer.py: step() -> (update_successful, grad_norm, num_zeros);
        # (False, None, None) when the loss scaler found inf/NaN gradients: nothing was updated.
        updated, grad_norm, _ = self.optimizer.step()
        grad_norm = float("nan") if grad_norm is None else float(grad_norm)
        if not updated:
            logger.warning(
                "optimizer step %d skipped: megatron-core's optimizer found inf/NaN gradients "
                "and left the weights unchanged (grad_norm=%s)",
                step_index,
                grad_norm,
            )
        return StepResult(grad_norm=grad_norm, lr=lr, skipped=not updated)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "state": _plain(self.optimizer.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_kind(state)
        self.optimizer.load_state_dict(state["state"])


def _plain(obj: Any) -> Any:
    """Parameters -> plain detached tensors, recursively (``torch.load(weights_only=True)``)."""
    if isinstance(obj, Tensor):
        return obj.detach()
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_plain(v) for v in obj)
    return obj


def build_optimizer(model: Any, cfg: OptimizerConfig) -> ModelOptimizer:
    """megatron-core's optimizer on GPUs, torch AdamW on CPU (with float32 master weights for
    a model below float32), for a DDP-wrapped `model`."""
    if uses_gpu():
        return MegatronAdam(model, cfg)
    return TorchAdamW(model, cfg)
