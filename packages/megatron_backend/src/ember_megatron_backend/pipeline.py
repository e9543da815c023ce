"""Pipeline parallelism: megatron-core's 1F1B schedule over the backend's packed micro-batches.

Under PP > 1 the worker's passes (scoring and training) run through megatron-core's
non-interleaved schedule (``get_forward_backward_func``): stage s forwards micro-batch k once
stage s - 1 has sent it the hidden states, and a training step alternates one forward with one
backward (1F1B). Every rank of a pipeline group packs the same micro-batches from the same
samples; the first stage feeds token ids, the others the hidden states they receive. Only the
last stage holds logits (or values), so the heads, the losses and the metrics are computed there:

- scoring (``score``): the last stage's per-sample results are broadcast to the other stages, so
  every rank holds the whole scored rollout, as under PP = 1;
- training (``train_step``): the loss backpropagates through the stages; the metric sums stay
  on the last stage until the worker sums them over the pipeline group (the others add zeros);
- forward contexts (routing replay) and routing records act on each stage's own routers, whose
  layer numbers are global (megatron-core adds the stage's layer offset).

Weights to rollout engines leave every stage: ``iter_all_stages`` hands each rank of a pipeline
group the (name, tensor) pairs of every stage, stage by stage.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ember_core.types import Sample
from ember_megatron_backend import comm
from ember_megatron_backend.batches import MicroBatch
from ember_megatron_backend.forward import (
    ROLE_OUTPUTS,
    ForwardOutput,
    ModelCall,
    heads,
)
from ember_megatron_backend.parallel import device

__all__ = [
    "check_same_samples",
    "is_pipelined",
    "iter_all_stages",
    "score",
    "train_step",
]

Context = Callable[[MicroBatch], AbstractContextManager[Any]]
"""A context entered around one micro-batch's pass on this stage."""


def _none(mb: MicroBatch) -> AbstractContextManager[Any]:
    return contextlib.nullcontext()


def is_pipelined() -> bool:
    """Whether the model is split into pipeline stages (PP > 1)."""
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_world_size() > 1


def _config(model: Any) -> Any:
    while not hasattr(model, "config") and hasattr(model, "module"):
        model = model.module
    return model.config


def _p2p_shapes_per_micro_batch(config: Any) -> None:
    """Let each micro-batch cross the stages in its own shape.

    Micro-batches differ in length, so their [S, B, H] hidden states (the "thd" stream's
    [T, 1, H]) do too. megatron-core 0.16.1 p2p_communication.py ``_communicate`` exchanges each
    tensor's shape before sending it when ``variable_seq_lengths`` is set; that is the only
    place that reads the flag. ``TransformerConfig.__post_init__`` refuses it together with the
    allgather token dispatcher that CPU runs use, because that dispatcher gathers equal pieces
    over the expert-tensor x expert-parallel group (``batches.needs_equal_layouts``): a
    condition on the ranks of one stage, which varying lengths would break and the pipeline
    does not touch. With a group of one rank it holds trivially; with more, every micro-batch
    is padded to the layout its data-parallel ranks agree on (``batches.plan_layouts``), with
    or without pipeline stages. The flag is therefore safe and is set here, after
    construction, on the config the schedule reads (on GPUs, with the alltoall dispatcher,
    ``model.transformer_config`` sets it already). The alternative, one common [B, S] for every
    micro-batch of a step, would also satisfy the p2p layer with the flag off, but would run
    the largest micro-batch's rows and columns for every micro-batch (token budgets put one
    long sample or many short ones in a micro-batch) and send the padding tokens through the
    routers, where the load-balancing loss counts them.
    """
    config.variable_seq_lengths = True


# --- running the schedule ----------------------------------------------------------------------


@contextlib.contextmanager
def _backward_contexts(micro_batches: Sequence[MicroBatch], context: Context) -> Iterator[None]:
    """Run each backward of the schedule inside `context(mb)` of its micro-batch.

    megatron-core 0.16.1 schedules.py: ``forward_backward_pipelining_without_interleaving``
    calls the module-level ``backward_step`` once per micro-batch, in forward order, on every
    stage, and offers no hook around it; the PP = 1 loop wraps each backward (and the activation
    recompute it triggers) in its micro-batch's ``Phase.BACKWARD`` context, and so does this.
    """
    from megatron.core.pipeline_parallel import schedules

    pending = collections.deque(micro_batches)
    original = schedules.backward_step

    def backward_step(*args: Any, **kwargs: Any) -> Any:
        with context(pending.popleft()):
            return original(*args, **kwargs)

    schedules.backward_step = backward_step
    try:
        yield
    finally:
        schedules.backward_step = original
    assert not pending, f"the schedule ran no backward for {len(pending)} micro-batches"


def _run(
    model: Any,
    micro_batches: Sequence[MicroBatch],
    *,
    last_stage: Callable[[MicroBatch, Tensor], Tensor | None],
    forward_context: Context,
    backward_context: Context | None,
) -> None:
    """One schedule over `micro_batches` (forward only when `backward_context` is None).

    `last_stage(mb, rows)` runs on the last stage with the output rows of the micro-batch's
    response window (``forward.ModelCall``: the output layer runs at those alone) and returns
    the micro-batch's loss, already weighted (None when scoring).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    _p2p_shapes_per_micro_batch(_config(model))
    last = ps.is_pipeline_last_stage()
    count = len(micro_batches)

    def loss_func(mb: MicroBatch, call: ModelCall, output: Tensor) -> tuple[Tensor, dict[str, Any]]:
        loss = last_stage(mb, call.rows(output))
        if loss is None:
            return output.new_zeros(()), {}
        # The schedule divides the loss by the number of micro-batches (schedules.py
        # forward_step_calc_loss); the weights already make the step's mean.
        return loss * count, {}

    def forward_step(data_iterator: Iterator[MicroBatch], stage: Any) -> tuple[Tensor, Any]:
        mb = next(data_iterator)
        call = ModelCall(stage, mb.packed, mb.layout, window=mb.window)
        with forward_context(mb), call.selecting():
            output = stage(**call.inputs, runtime_gather_output=True)
        return output, functools.partial(loss_func, mb, call) if last else None

    backward = (
        contextlib.nullcontext()
        if backward_context is None
        else _backward_contexts(micro_batches, backward_context)
    )
    # On CPU the schedule's CUDA-only spots are handled by `cpu` (spot 10).
    with backward:
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=[model],
            num_microbatches=count,
            # Each micro-batch's shape travels with it (_p2p_shapes_per_micro_batch); these only
            # have to describe a valid one.
            seq_length=micro_batches[0].packed.padded_length,
            micro_batch_size=1,
            forward_only=backward_context is None,
        )


def _from_last_stage(values: list[list[Tensor]], lengths: list[int]) -> list[list[Tensor]]:
    """Per quantity, the last stage's per-sample [R_i] fp32 tensors on every pipeline rank."""
    from megatron.core import parallel_state as ps

    if ps.is_pipeline_last_stage():
        flat = torch.stack([torch.cat([t.detach().float().cpu() for t in v]) for v in values])
    else:
        flat = torch.empty(len(values), sum(lengths), dtype=torch.float32)
    comm.broadcast(
        flat,
        src=ps.get_pipeline_model_parallel_last_rank(),
        group=ps.get_pipeline_model_parallel_group(),
    )
    return [list(row.split(lengths)) for row in flat]


@torch.no_grad()
def score(
    model: Any,
    micro_batches: Sequence[MicroBatch],
    *,
    role: str,
    temperature: float = 1.0,
    with_entropy: bool = False,
    context: Context = _none,
) -> ForwardOutput:
    """A forward-only pass of every micro-batch through the pipeline, and the role's head.

    Collective over the pipeline group (and whatever groups the model's forward uses).

    Args:
        model: This rank's stage (possibly wrapped).
        micro_batches: The packed micro-batches, the same on every stage.
        role: "actor", "ref" or "critic" (``forward.ROLE_OUTPUTS``).
        temperature: Rollout temperature for the policy roles.
        with_entropy: Also return per-token entropy (policy roles).
        context: Entered around each micro-batch's forward on this stage.

    Returns:
        Per sample, in the order of the micro-batches' samples, fp32 CPU tensors: the same on
        every rank of the pipeline group.
    """
    keys = ["values"] if ROLE_OUTPUTS[role] == "value" else ["log_probs"]
    if with_entropy and keys == ["log_probs"]:
        keys.append("entropy")
    outputs: list[list[Tensor]] = [[] for _ in keys]

    def last_stage(mb: MicroBatch, rows: Tensor) -> None:
        out = heads(
            rows, mb.window.batch, role=role, temperature=temperature, with_entropy=with_entropy
        )
        for values, key in zip(outputs, keys, strict=True):
            values.extend(getattr(out, key))

    was_training = model.training
    model.eval()
    try:
        _run(
            model,
            micro_batches,
            last_stage=last_stage,
            forward_context=context,
            backward_context=None,
        )
    finally:
        model.train(was_training)
    lengths = [s.response_length for mb in micro_batches for s in mb.samples]
    return ForwardOutput(**dict(zip(keys, _from_last_stage(outputs, lengths), strict=True)))


def train_step(
    model: Any,
    micro_batches: Sequence[MicroBatch],
    *,
    loss: Callable[[MicroBatch, Tensor], Tensor],
    forward_context: Context = _none,
    backward_context: Context = _none,
) -> None:
    """Forward and backward of every micro-batch through the pipeline (1F1B), accumulating the
    gradients into the DDP buffers; the optimizer step is the caller's.

    Args:
        model: This rank's stage, DDP-wrapped.
        micro_batches: The step's packed micro-batches, the same on every stage.
        loss: On the last stage, `loss(mb, rows)` from the output rows of the micro-batch's
            response window (``MicroBatch.window``): its loss, weighted as the gradient
            should count it.
        forward_context: Entered around each micro-batch's forward on this stage.
        backward_context: Entered around each micro-batch's backward on this stage.
    """
    _run(
        model,
        micro_batches,
        last_stage=loss,
        forward_context=forward_context,
        backward_context=backward_context,
    )


# --- samples and weights across stages ---------------------------------------------------------


def check_same_samples(samples: Sequence[Sample]) -> None:
    """Raise unless every rank of this pipeline group holds the same samples (collective).

    Raises:
        ValueError: when the stages of one model replica received different samples.
    """
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    key = torch.tensor(
        [[s.index, s.group_index, s.total_length, s.response_length] for s in samples],
        dtype=torch.int64,
    )
    digest = hashlib.sha256(key.numpy().tobytes()).hexdigest()
    everyone: list[Any] = [None] * dist.get_world_size(group)
    comm.all_gather_object(everyone, (len(samples), digest), group=group)
    if len(set(everyone)) > 1:
        counts = [n for n, _ in everyone]
        raise ValueError(
            "the pipeline stages of one model replica received different samples (per stage: "
            f"{counts} samples, {len(set(everyone))} distinct sets); every rank of a pipeline "
            "group must get its data-parallel rank's share"
        )


def iter_all_stages(named: Iterator[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """Every pipeline stage's (name, tensor) pairs on every rank of the pipeline group.

    Stage by stage, in stage order: the stage's ranks consume their own `named` (its gathers
    over TP/EP are collective within the stage) and broadcast each tensor, after its name,
    shape and dtype, to the other stages, which receive it on this rank's device. Every rank of
    the group must consume the result in step.

    Args:
        named: This stage's pairs (e.g. ``weights.iter_hf_weights``).
    """
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    mine = ps.get_pipeline_model_parallel_rank()
    for stage, src in enumerate(dist.get_process_group_ranks(group)):
        while True:
            item = next(named, None) if stage == mine else None
            header: list[Any] = [None]
            if item is not None:
                header = [(item[0], tuple(item[1].shape), item[1].dtype)]
            comm.broadcast_object_list(header, src=src, group=group)
            if header[0] is None:
                break
            name, shape, dtype = header[0]
            if item is not None:
                tensor = item[1].detach().contiguous()
            else:
                tensor = torch.empty(shape, dtype=dtype, device=device())
            yield name, comm.broadcast(tensor, src=src, group=group)
