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
from ember_megatron_backend.forward import (
    Layout,
    ResponseWindow,
    padded_shape,
    plan_micro_batches,
    response_window,
    router_rows,
)
from ember_megatron_backend.model import uses_te_spec

__all__ = [
    "MicroBatch",
    "RolloutBatch",
    "agree_layouts",
    "needs_equal_layouts",
    "pack_micro_batch",
    "padded_positions",
    "plan_layouts",
    "plan_steps",
    "shuffled_order",
    "split_evenly",
]


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
    layout: Layout | None = None
    """Pad the [B, S] batch of local attention to at least (rows, width): the layout every
    data-parallel rank agreed on where expert parallelism gathers equal shapes
    (``pipeline.needs_equal_layouts``); None: the micro-batch's own."""
    window: ResponseWindow | None = None
    """The packed stream's response windows (``forward.response_window``): the rows a forward's
    output layer computes and the heads read (set by ``pack_micro_batch``)."""
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
    `algorithm.use_rollout_log_probs` the engine's (the same tensors as `rollout_log_probs`)
    except at an audit, where they are the trainer's scoring for the metrics and checks while
    the loss keeps the engine's (``losses.actor_loss``)."""
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
    ref_rebuilt_log_probs: list[Tensor] | None = None
    """The log-probs of a reference rebuilt from its source (`train.ref_load`, or the actor's
    initial weights) for one check-only forward, only when a plugin asked for it."""
    values: list[Tensor] | None = None
    """Old critic values (when a critic is built)."""
    rollout_log_probs: list[Tensor] | None = None
    """The engine's log-probs, when every sample of every rank carries them."""
    layouts: list[list[Layout]] | None = None
    """Per step and micro-batch, the padded layout agreed across data-parallel ranks
    (``MicroBatch.layout``); None where each micro-batch keeps its own."""
    routing: Tensor | None = None
    """[B, 4] float64 per sample: (token, layer) routings where the actor's own top-k set equals
    the rollout's, and routings compared; the same for the experts a replaying forward used
    (``RoutingRecorder.record``); None without routed experts or without a scoring forward."""
    shifted_routing: Tensor | None = None
    """[B, 4] as `routing`, from one check-only actor forward at an audit under routing replay
    whose samples' experts were each moved to the next expert id
    (`ember_core.certify.shifted_experts`): experts no router picks by itself, which only a
    forward that replays follows. None outside audits or without routing to score."""
    has_experts: bool = False
    """Some sample of some rank carries the engine's routed experts: the training forwards
    record the routing too (`train/routing_agreement`, `train/replay_agreement`)."""
    audit: bool = False
    """An audit iteration (`EmberPlugins.audit_rollout`): the engine sampled from the weights
    the trainer holds, and the actor scored the rollout itself even under
    `algorithm.use_rollout_log_probs`, to be compared, not trained against."""
    stale: bool = False
    """Some sample was generated from weights older than the trainer's (its `weight_version`
    is below the trainer's): a train/rollout log-prob gap then holds that staleness too."""

    @property
    def response_lengths(self) -> list[int]:
        return [s.response_length for s in self.samples]

    @property
    def old_from_engine(self) -> bool:
        """`log_probs` are the engine's: the trainer computed none of its own to compare with
        anything (`algorithm.use_rollout_log_probs` outside audits; at an audit this is False
        while the loss still takes the engine's log-probs as the old policy's)."""
        return self.log_probs is self.rollout_log_probs


def split_evenly(count: int, parts: int) -> list[range]:
    """`parts` contiguous ranges covering range(count), sizes differing by at most one."""
    base, extra = divmod(count, parts)
    bounds = [0]
    for k in range(parts):
        bounds.append(bounds[-1] + base + (1 if k < extra else 0))
    return [range(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def shuffled_order(count: int, seed: int, rollout_id: int) -> list[int]:
    """A permutation of range(count), the same for the same (seed, rollout_id) on every rank
    and pipeline stage (`train.shuffle_mini_batches`)."""
    generator = torch.Generator().manual_seed((seed * 1_000_003 + rollout_id) % (1 << 63))
    return torch.randperm(count, generator=generator).tolist()


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
    order: Sequence[int] | None = None,
    by_length: bool = False,
) -> list[list[list[int]]]:
    """Sample indices per optimizer step and micro-batch, the same number of micro-batches on
    every rank of `group`.

    The rank's samples, taken in `order`, split into `num_steps` contiguous mini-batches of
    (almost) equal size; each mini-batch into micro-batches by count or token budget (one
    micro-batch when neither is given). Ranks then agree on the largest micro-batch count of
    each step and split their largest micro-batches until they reach it, so collective forward
    passes (expert parallelism) stay in step.

    Args:
        samples: The rank's samples.
        num_steps: Optimizer steps (mini-batches).
        micro_batch_size: Samples per micro-batch.
        max_tokens_per_micro_batch: Token budget per micro-batch.
        group: Process group whose ranks must agree (the data-parallel group); None: no
            agreement.
        strict_counts: Fail when a rank has too few samples to reach the agreed count.
        order: A permutation of the sample indices (`shuffled_order`); None: arrival order, so
            each mini-batch holds whole prompt groups.
        by_length: Within each mini-batch, take the samples longest first before splitting it
            into micro-batches (`train.micro_batches_by_length`), so that samples of like
            length share a padded micro-batch. Which samples each step trains on is unchanged.

    Raises:
        ValueError: with fewer samples than steps, or, with `strict_counts`, fewer samples in a
            mini-batch than the agreed micro-batches.
    """
    if len(samples) < num_steps:
        raise ValueError(
            f"this rank has {len(samples)} samples for train.num_steps_per_rollout={num_steps}: "
            "every optimizer step needs at least one sample per data-parallel rank"
        )
    if order is None:
        order = range(len(samples))
    elif sorted(order) != list(range(len(samples))):
        raise ValueError(f"order {list(order)}: expected a permutation of 0..{len(samples) - 1}")
    lengths = [s.total_length for s in samples]
    steps = []
    for span in split_evenly(len(samples), num_steps):
        part = [order[k] for k in span]
        if by_length:
            part.sort(key=lambda i: -lengths[i])
        if micro_batch_size is None and max_tokens_per_micro_batch is None:
            local = [part]
        else:
            local = plan_micro_batches(
                [lengths[i] for i in part],
                micro_batch_size=micro_batch_size,
                max_tokens_per_micro_batch=max_tokens_per_micro_batch,
            )
            local = [[part[i] for i in mb] for mb in local]
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


def needs_equal_layouts(model: Any) -> bool:
    """Whether micro-batch k must have one padded [B, S] on every data-parallel rank.

    megatron-core 0.16.1 token_dispatcher.py ``MoEAllGatherTokenDispatcher.token_dispatch``
    all-gathers hidden states, probabilities and routing maps over the expert-tensor x
    expert-parallel group in equal pieces (``gather_from_sequence_parallel_region`` without
    split sizes), so every rank of that group must hold as many tokens. CPU runs use that
    dispatcher (the alltoall one, which takes any split, needs CUDA); the ranks of the group
    hold the same micro-batch only when they are tensor-parallel peers.
    """
    from megatron.core import parallel_state as ps

    config = _config(model)
    return (
        config is not None
        and not uses_te_spec()
        and bool(getattr(config, "num_moe_experts", None))
        and config.moe_token_dispatcher_type == "allgather"
        and ps.get_expert_tensor_and_model_parallel_world_size() > 1
    )


def agree_layouts(lengths: Sequence[Sequence[int]], group: Any) -> list[Layout]:
    """Per micro-batch, the largest (samples, longest sample) over the ranks of `group`.

    Args:
        lengths: Per micro-batch, the total lengths of its samples.
        group: The data-parallel group.

    Raises:
        ValueError: when the ranks run different numbers of micro-batches.
    """
    count = torch.tensor([len(lengths), -len(lengths)], dtype=torch.int64)
    comm.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    most, fewest = int(count[0]), -int(count[1])
    if most != fewest:
        raise ValueError(
            f"data-parallel ranks run between {fewest} and {most} micro-batches (this rank "
            f"{len(lengths)}): expert parallelism on CPU needs the same number on every rank, "
            "since its allgather token dispatcher gathers equal shapes"
        )
    local = torch.tensor([[len(mb), max(mb)] for mb in lengths], dtype=torch.int64)
    comm.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
    return [(int(b), int(s)) for b, s in local.tolist()]


def plan_layouts(
    model: Any, samples: Sequence[Sample], steps: list[list[list[int]]], group: Any
) -> list[list[Layout]] | None:
    """Per step and micro-batch of `steps`, the padded layout every rank of the data-parallel
    `group` uses where ``needs_equal_layouts(model)``; else None (each micro-batch keeps its
    own). Collective over `group` when layouts are needed."""
    if not needs_equal_layouts(model):
        return None
    lengths = [[samples[i].total_length for i in mb] for step in steps for mb in step]
    agreed = iter(agree_layouts(lengths, group))
    return [[next(agreed) for _ in step] for step in steps]


def padded_positions(
    samples: Sequence[Sample],
    steps: list[list[list[int]]],
    layouts: list[list[Layout]] | None = None,
) -> tuple[int, int]:
    """(positions a training forward processes, tokens among them) over every micro-batch of
    `steps`: without Transformer Engine a micro-batch is a padded [B, S] batch (its `layouts`
    entry where one is agreed), with it a packed stream of its tokens alone."""
    processed = tokens = 0
    for k, step in enumerate(steps):
        for j, mb in enumerate(step):
            lengths = [samples[i].total_length for i in mb]
            tokens += sum(lengths)
            if uses_te_spec():
                processed += sum(lengths)
                continue
            rows, width = padded_shape(lengths, layouts[k][j] if layouts is not None else None)
            processed += rows * width
    return processed, tokens


def pack_micro_batch(
    model: Any, samples: Sequence[Sample], indices: list[int], layout: Layout | None = None
) -> MicroBatch:
    """Pack `samples[i] for i in indices` as the model will see them (padded to `layout`)."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    chosen = [samples[i] for i in indices]
    packed = pack_samples(chosen, pad_multiple=tp)
    token_index = router_rows(packed, layout)
    if getattr(_config(model), "sequence_parallel", False):
        # Each TP rank's routers see its contiguous slice of the padded stream.
        rows = packed.padded_length // tp
        start = ps.get_tensor_model_parallel_rank() * rows
        token_index = torch.arange(start, start + rows)
        token_index[token_index >= packed.num_tokens] = -1
    return MicroBatch(
        model=model,
        samples=chosen,
        indices=list(indices),
        packed=packed,
        layout=layout,
        window=response_window(packed),
        token_index=token_index,
    )


def _config(model: Any) -> Any:
    while not hasattr(model, "config") and hasattr(model, "module"):
        model = model.module
    return getattr(model, "config", None)
