"""A rank's rollout batch: mini-batches per optimizer step, packed micro-batches, scored tensors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ember_core.types import PackedBatch, Sample, pack_samples
from ember_megatron_backend import comm
from ember_megatron_backend.forward import plan_micro_batches, router_rows

__all__ = ["MicroBatch", "RolloutBatch", "pack_micro_batch", "plan_steps", "split_evenly"]


@dataclass(kw_only=True, slots=True)
class MicroBatch:
    """One packed micro-batch: what the plugins' forward contexts receive as `batch`."""

    model: Any
    """The model running the pass (possibly DDP-wrapped)."""
    samples: list[Sample]
    """The micro-batch's samples, in packing order."""
    indices: list[int]
    """Their positions in the rank's rollout batch."""
    packed: PackedBatch
    """The packed stream the model sees (padded to a multiple of TP)."""
    token_index: Tensor | None = None
    """[R] stream position of each row this rank's MoE routers see (-1 for padding): the
    padded [B, S] layout of local attention (``forward.router_rows``), or this rank's slice
    under sequence parallelism; None when the routers see the whole padded stream."""


@dataclass(kw_only=True, slots=True)
class RolloutBatch:
    """One rank's share of a rollout, scored by ``MegatronWorker.prepare``.

    Per-sample lists are in `samples` order; per-token tensors are fp32 [R_i] on the CPU.
    """

    rollout_id: int
    """The rollout."""
    samples: list[Sample]
    """This rank's samples (whole prompt groups)."""
    steps: list[list[list[int]]]
    """Sample indices per optimizer step, per micro-batch. Scoring used the same micro-batches,
    so the first training forward repeats it exactly."""
    loss_masks: list[Tensor]
    """1 where a response token is trained on."""
    log_probs: list[Tensor]
    """Old actor log-probs at the rollout temperature: the trainer's, or with
    `algorithm.use_rollout_log_probs` the engine's (the same tensors as `rollout_log_probs`)."""
    entropy: list[Tensor] | None
    """Old actor entropy at the rollout temperature; None when the actor was not scored."""
    advantages: list[Tensor]
    """Advantages from the configured estimator (whitened across ranks when configured)."""
    returns: list[Tensor]
    """Returns (the critic's regression targets)."""
    ref_log_probs: list[Tensor] | None = None
    """Reference log-probs at the rollout temperature (when a reference is built)."""
    ref_replayed_log_probs: list[Tensor] | None = None
    """The reference's log-probs with the rollout's routing replayed (`Phase.REPLAY_CHECK`),
    only when a plugin asked for that check-only forward; no loss reads them."""
    values: list[Tensor] | None = None
    """Old critic values (when a critic is built)."""
    rollout_log_probs: list[Tensor] | None = None
    """The engine's log-probs, when every sample of every rank carries them."""
    routing: Tensor | None = None
    """[B, 2] float64 per sample: (token, layer) routings where the actor's own top-k set equals
    the rollout's, and routings compared; None without routed experts."""

    @property
    def response_lengths(self) -> list[int]:
        return [s.response_length for s in self.samples]

    @property
    def old_from_engine(self) -> bool:
        """The old log-probs are the engine's (`algorithm.use_rollout_log_probs`): the trainer
        computed none of its own to compare with anything."""
        return self.log_probs is self.rollout_log_probs


def split_evenly(count: int, parts: int) -> list[range]:
    """`parts` contiguous ranges covering range(count), sizes differing by at most one."""
    base, extra = divmod(count, parts)
    bounds = [0]
    for k in range(parts):
        bounds.append(bounds[-1] + base + (1 if k < extra else 0))
    return [range(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _split_to(plan: list[list[int]], count: int) -> list[list[int]]:
    """Halve the micro-batches with the most samples until there are `count` (or none splits)."""
    plan = [list(mb) for mb in plan]
    while len(plan) < count:
        k = max(range(len(plan)), key=lambda j: len(plan[j]))
        if len(plan[k]) < 2:
            break
        half = len(plan[k]) // 2
        plan[k : k + 1] = [plan[k][:half], plan[k][half:]]
    return plan


def plan_steps(
    samples: Sequence[Sample],
    num_steps: int,
    *,
    micro_batch_size: int | None,
    max_tokens_per_micro_batch: int | None,
    group: Any = None,
    strict_counts: bool = False,
) -> list[list[list[int]]]:
    """Sample indices per optimizer step and micro-batch, the same number of micro-batches on
    every rank of `group`.

    The rank's samples split into `num_steps` contiguous mini-batches of (almost) equal size;
    each mini-batch into micro-batches by count or token budget (one micro-batch when neither
    is given). Ranks then agree on the largest micro-batch count of each step and split their
    largest micro-batches until they reach it, so collective forward passes (expert parallelism)
    stay in step.

    Args:
        samples: The rank's samples.
        num_steps: Optimizer steps (mini-batches).
        micro_batch_size: Samples per micro-batch.
        max_tokens_per_micro_batch: Token budget per micro-batch.
        group: Process group whose ranks must agree (the data-parallel group); None: no
            agreement.
        strict_counts: Fail when a rank has too few samples to reach the agreed count.

    Raises:
        ValueError: with fewer samples than steps, or, with `strict_counts`, fewer samples in a
            mini-batch than the agreed micro-batches.
    """
    if len(samples) < num_steps:
        raise ValueError(
            f"this rank has {len(samples)} samples for train.num_steps_per_rollout={num_steps}: "
            "every optimizer step needs at least one sample per data-parallel rank"
        )
    lengths = [s.total_length for s in samples]
    steps = []
    for part in split_evenly(len(samples), num_steps):
        if micro_batch_size is None and max_tokens_per_micro_batch is None:
            local = [list(part)]
        else:
            local = plan_micro_batches(
                [lengths[i] for i in part],
                micro_batch_size=micro_batch_size,
                max_tokens_per_micro_batch=max_tokens_per_micro_batch,
            )
            local = [[part.start + i for i in mb] for mb in local]
        steps.append(local)
    if group is None or dist.get_world_size(group) == 1:
        return steps
    counts = torch.tensor([len(s) for s in steps], dtype=torch.int64)
    comm.all_reduce(counts, op=dist.ReduceOp.MAX, group=group)
    steps = [_split_to(local, int(n)) for local, n in zip(steps, counts, strict=True)]
    for k, (local, n) in enumerate(zip(steps, counts, strict=True)):
        if strict_counts and len(local) < n:
            raise ValueError(
                f"step {k}: this rank has {len(local)} samples but another data-parallel rank "
                f"runs {int(n)} micro-batches; expert parallelism needs the same number on every "
                "rank (use a larger batch or a larger micro-batch limit)"
            )
    return steps


def pack_micro_batch(model: Any, samples: Sequence[Sample], indices: list[int]) -> MicroBatch:
    """Pack `samples[i] for i in indices` as the model will see them."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    chosen = [samples[i] for i in indices]
    packed = pack_samples(chosen, pad_multiple=tp)
    token_index = router_rows(packed)
    if getattr(_config(model), "sequence_parallel", False):
        # Each TP rank's routers see its contiguous slice of the padded stream.
        rows = packed.padded_length // tp
        start = ps.get_tensor_model_parallel_rank() * rows
        token_index = torch.arange(start, start + rows)
        token_index[token_index >= packed.num_tokens] = -1
    return MicroBatch(
        model=model, samples=chosen, indices=list(indices), packed=packed, token_index=token_index
    )


def _config(model: Any) -> Any:
    while not hasattr(model, "config") and hasattr(model, "module"):
        model = model.module
    return getattr(model, "config", None)
