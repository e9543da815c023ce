"""Forward-only passes over packed micro-batches: per-sample log-probs, entropy or values."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ember_core.heads import PolicyHead, ValueHead
from ember_core.types import PackedBatch, Sample
from ember_megatron_backend.model import uses_te_spec
from ember_megatron_backend.parallel import device, require_no_context_parallel

__all__ = [
    "ROLE_OUTPUTS",
    "ForwardOutput",
    "Layout",
    "ModelCall",
    "ResponseWindow",
    "forward_only",
    "heads",
    "model_inputs",
    "plan_micro_batches",
    "response_window",
    "router_rows",
    "router_rows_to_stream",
    "run_model",
    "score_batch",
]

ROLE_OUTPUTS = {"actor": "policy", "ref": "policy", "critic": "value"}
"""What each role's forward produces: "policy" log-probs (and entropy) or critic "value"s."""


@dataclass(kw_only=True, slots=True)
class ForwardOutput:
    """Per-sample results of ``forward_only``, in the order of the input samples."""

    log_probs: list[Tensor] | None = None
    """[R_i] fp32 log-probs of the response tokens (policy roles)."""
    entropy: list[Tensor] | None = None
    """[R_i] fp32 entropy of the temperature-scaled distribution (when requested)."""
    values: list[Tensor] | None = None
    """[R_i] fp32 critic values at the response rows (critic role)."""


def plan_micro_batches(
    lengths: Sequence[int],
    *,
    micro_batch_size: int | None = None,
    max_tokens_per_micro_batch: int | None = None,
) -> list[list[int]]:
    """Group sample indices into micro-batches, keeping sample order.

    Exactly one of the limits is given. With a token budget a micro-batch takes samples while
    their total length stays within it; a sample longer than the budget goes alone.

    Args:
        lengths: Total length of each sample.
        micro_batch_size: Samples per micro-batch.
        max_tokens_per_micro_batch: Token budget per micro-batch.

    Raises:
        ValueError: unless exactly one limit is given and it is >= 1.
    """
    if (micro_batch_size is None) == (max_tokens_per_micro_batch is None):
        raise ValueError(
            "give exactly one of micro_batch_size and max_tokens_per_micro_batch, got "
            f"{micro_batch_size!r} and {max_tokens_per_micro_batch!r}"
        )
    limit = micro_batch_size if micro_batch_size is not None else max_tokens_per_micro_batch
    key = "micro_batch_size" if micro_batch_size is not None else "max_tokens_per_micro_batch"
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise ValueError(f"{key} must be an int >= 1, got {limit!r}")
    if micro_batch_size is not None:
        return [list(range(i, min(i + limit, len(lengths)))) for i in range(0, len(lengths), limit)]
    plan: list[list[int]] = []
    used = 0
    for i, length in enumerate(lengths):
        if plan and used + length <= limit:
            plan[-1].append(i)
            used += length
        else:
            plan.append([i])
            used = length
    return plan


Layout = tuple[int, int]
"""(rows, width): a padded [B, S] batch at least this large (``MicroBatch.layout``)."""


def padded_shape(lengths: Sequence[int], layout: Layout | None = None) -> tuple[int, int]:
    """(B, S) of the padded [B, S] batch of samples of these total lengths: their count and the
    longest, or `layout` where that is larger."""
    rows, width = len(lengths), max(lengths)
    if layout is not None:
        rows, width = max(rows, layout[0]), max(width, layout[1])
    return rows, width


def _padded_rows(batch: PackedBatch, layout: Layout | None = None) -> tuple[Tensor, int, int]:
    """For the padded [B, S] layout: each stream token's row in the flattened [B * S] batch, B
    and S (the sample count and longest sample, or `layout` where that is larger)."""
    lengths = torch.tensor(batch.total_lengths)
    num_rows, width = padded_shape(batch.total_lengths, layout)
    sample_of = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    offsets = batch.cu_seqlens[: len(lengths)].to(torch.long)  # a padding segment left out
    within = torch.arange(batch.num_tokens) - offsets[sample_of]
    return sample_of * width + within, num_rows, width


def model_inputs(batch: PackedBatch, layout: Layout | None = None) -> dict[str, Any]:
    """GPTModel keyword arguments for a packed batch on this rank's device.

    Transformer Engine attention reads the packing from ``PackedSeqParams`` ("thd"). megatron-
    core's local attention refuses those, so without TE the samples go in as a right-padded
    [B, S] batch under one causal mask: every sample starts at position 0 (RoPE sees its own
    positions, as in transformers), real tokens never see the padding that follows them, and
    attention costs B * S^2 rather than the (B * S)^2 of a block-diagonal mask over the stream.
    ``ModelCall`` maps the output back to stream rows (by default the response windows') and
    ``router_rows`` says which stream token each MoE router row holds.

    Args:
        batch: The packed micro-batch.
        layout: Pad the [B, S] batch to at least (rows, width) with rows and columns of padding
            (``MicroBatch.layout``); the "thd" stream ignores it.
    """
    dev = device()
    if uses_te_spec():
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = batch.cu_seqlens.to(dev, torch.int32)
        longest = int((batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).max())
        return {
            "input_ids": batch.tokens[None].to(dev),
            "position_ids": batch.position_ids[None].to(dev),
            "attention_mask": None,
            "packed_seq_params": PackedSeqParams(
                qkv_format="thd",
                cu_seqlens_q=cu,
                cu_seqlens_kv=cu,
                max_seqlen_q=longest,
                max_seqlen_kv=longest,
            ),
        }
    return _padded_inputs(batch, *_padded_rows(batch, layout))


def _padded_inputs(batch: PackedBatch, rows: Tensor, num_rows: int, width: int) -> dict[str, Any]:
    dev = device()
    ids = torch.zeros(num_rows * width, dtype=torch.long)
    ids[rows] = batch.tokens[: batch.num_tokens]
    masked = torch.ones(width, width, dtype=torch.bool).triu(diagonal=1)
    return {
        "input_ids": ids.view(num_rows, width).to(dev),
        "position_ids": torch.arange(width).expand(num_rows, width).to(dev),
        # local attention builds its default causal mask on CUDA, so it is passed here.
        "attention_mask": masked[None, None].to(dev),
    }


def _gather_rows(output: Tensor, rows: Tensor) -> Tensor:
    flat = output.reshape(-1, *output.shape[2:])
    return flat.index_select(0, rows.to(flat.device))


def router_rows(batch: PackedBatch, layout: Layout | None = None) -> Tensor | None:
    """For the padded layout: [B * S] stream position of each row the MoE routers see (megatron-
    core flattens [s, b] hidden states: row = s * B + b), -1 for padding; None for "thd", whose
    router rows are the stream itself."""
    if uses_te_spec():
        return None
    rows, num_rows, width = _padded_rows(batch, layout)
    index = torch.full((num_rows * width,), -1, dtype=torch.long)
    index[rows] = torch.arange(batch.num_tokens)
    # [b, s] -> [s, b] order
    return index.view(num_rows, width).t().reshape(-1)


def router_rows_to_stream(
    values: Tensor, batch: PackedBatch, layout: Layout | None = None
) -> Tensor:
    """Per-row values of the MoE routers ([R, ...], e.g. a routing map) in stream order
    ([num_tokens, ...]); the values themselves for "thd", whose router rows are the stream."""
    index = router_rows(batch, layout)
    if index is None:
        return values[: batch.num_tokens]
    real = index >= 0
    out = values.new_zeros(batch.num_tokens, *values.shape[1:])
    out[index[real]] = values[real.to(values.device)]
    return out


@dataclass(frozen=True, slots=True)
class ResponseWindow:
    """Each sample's response window: its last R_i + 1 positions, the last prompt token and then
    the response. Their rows are the ones the heads read (row j predicts token j + 1), and one
    more per sample, so the window is itself a packed batch of samples with a response."""

    positions: Tensor
    """[N] int64 stream positions of the windows, sample by sample (N = sum(R_i + 1))."""
    batch: PackedBatch
    """The windows as a packed batch: sample i is [last prompt token, response] (length
    R_i + 1, response R_i), for ``heads`` over the rows that ``run_model`` returns."""


def response_window(batch: PackedBatch) -> ResponseWindow:
    """The response windows of `batch`'s samples (``ResponseWindow``)."""
    starts = batch.cu_seqlens[: batch.num_samples].tolist()
    spans = zip(starts, batch.total_lengths, batch.response_lengths, strict=True)
    positions = torch.cat([torch.arange(s + n - r - 1, s + n) for s, n, r in spans])
    sizes = [r + 1 for r in batch.response_lengths]
    cu_seqlens = torch.zeros(len(sizes) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.tensor(sizes).cumsum(0)
    window = PackedBatch(
        tokens=batch.tokens[positions],
        cu_seqlens=cu_seqlens,
        total_lengths=sizes,
        response_lengths=list(batch.response_lengths),
        loss_masks=batch.loss_masks,
        position_ids=batch.position_ids[positions],
        num_tokens=int(positions.numel()),
    )
    return ResponseWindow(positions=positions, batch=window)


class ModelCall:
    """One forward of a model over a packed micro-batch: its inputs, and its output as rows.

    With a `window` (``response_window``; ``MicroBatch.window`` holds each micro-batch's) the
    output is the window's rows and the output layer runs at those positions only:
    megatron-core's GPTModel projects every position it is given onto the vocabulary
    (models/gpt/gpt_model.py ``_postprocess``), the prompt's included, and at a vocabulary of
    49k that is a fifth of a small model's FLOPs per position. A forward
    pre-hook on ``output_layer`` hands it the window's rows of the [s, b, h] hidden states
    instead, as [N, 1, h]. Under sequence parallelism the output layer gathers the sharded
    hidden states itself, so there it runs at every position and the window is read from its
    output. Without one it is every stream token's row, in stream order.

        call = ModelCall(model, mb.packed, mb.layout, window=mb.window)
        with call.selecting():
            output = model(**call.inputs, runtime_gather_output=True)
        rows = call.rows(output)
    """

    def __init__(
        self,
        model: Any,
        batch: PackedBatch,
        layout: Layout | None = None,
        *,
        window: ResponseWindow | None,
    ) -> None:
        if uses_te_spec():
            self.inputs = model_inputs(batch)
            stream = torch.arange(batch.num_tokens)  # [1, T] output rows; [T, 1] hidden rows
            hidden = stream
        else:
            stream, num_rows, width = _padded_rows(batch, layout)  # [b, s] output rows
            self.inputs = _padded_inputs(batch, stream, num_rows, width)
            hidden = (stream % width) * num_rows + stream // width  # [s, b] hidden rows
        self._model = model
        self._selected = False
        if window is not None:
            self._stream, self._hidden = stream[window.positions], hidden[window.positions]
        else:
            self._stream, self._hidden = stream, None

    @contextlib.contextmanager
    def selecting(self) -> Iterator[None]:
        """Around the model's forward: its output layer runs at the window's rows only (a no-op
        without a window, on a pipeline stage without the output layer, or under sequence
        parallelism)."""
        layer = _output_layer(self._model)
        if self._hidden is None or layer is None or getattr(layer, "sequence_parallel", False):
            yield
            return
        index = self._hidden

        def select(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            hidden = args[0]  # ColumnParallelLinear.forward(input_, weight, runtime_gather_output)
            flat = hidden.reshape(-1, hidden.shape[-1])
            return (flat.index_select(0, index.to(flat.device)).unsqueeze(1), *args[1:]), kwargs

        handle = layer.register_forward_pre_hook(select, with_kwargs=True)
        self._selected = True
        try:
            yield
        finally:
            handle.remove()

    def rows(self, output: Tensor) -> Tensor:
        """The model's output (logits [b, s, V] or values [b, s, 1]) as rows [N, ...]: the
        window's, or every stream token's in stream order (padding dropped)."""
        if self._selected:
            return output[0]  # [1, N, ...]: the selected rows, in window order
        return _gather_rows(output, self._stream)


def _output_layer(model: Any) -> Any:
    """The GPTModel's output layer (the critic's value layer), None on a pipeline stage
    without one."""
    while not hasattr(model, "output_layer") and hasattr(model, "module"):
        model = model.module
    return getattr(model, "output_layer", None)


def run_model(
    model: Any,
    batch: PackedBatch,
    layout: Layout | None = None,
    *,
    window: ResponseWindow | None,
) -> Tensor:
    """`model` over `batch`: logits (or values) of the rows of `window` [N, ...] (the batch's
    ``response_window``), the output layer run at those alone; without a window, of every
    stream token [num_tokens, ...] in stream order. Vocabulary-sharded logits are gathered
    under TP."""
    call = ModelCall(model, batch, layout, window=window)
    with call.selecting():
        output = model(**call.inputs, runtime_gather_output=True)
    return call.rows(output)


@torch.no_grad()
def forward_only(
    model: Any,
    samples: Sequence[Sample],
    *,
    role: str,
    temperature: float = 1.0,
    with_entropy: bool = False,
    micro_batch_size: int | None = None,
    max_tokens_per_micro_batch: int | None = None,
) -> ForwardOutput:
    """Run `model` over `samples` in packed micro-batches and read the role's head.

    Policy roles ("actor", "ref") divide logits by `temperature` (the rollout temperature) in
    ``PolicyHead``; the critic's values go through ``ValueHead``, which has no temperature.
    Without a limit, all samples form one micro-batch. Under pipeline parallelism the
    micro-batches go through megatron-core's schedule (``pipeline.score``) and every rank
    returns the last stage's results. Where the CPU expert dispatcher gathers equal shapes
    (``batches.needs_equal_layouts``), every data-parallel rank must call it with as many
    micro-batches, which are padded to the shapes they agree on.

    Args:
        model: This rank's GPTModel (possibly wrapped); a critic for role "critic".
        samples: The samples; each is validated.
        role: "actor", "ref" or "critic".
        temperature: Rollout temperature for the policy roles.
        with_entropy: Also return per-token entropy (policy roles).
        micro_batch_size: Samples per micro-batch.
        max_tokens_per_micro_batch: Token budget per micro-batch instead.

    Raises:
        ValueError: for an unknown role, an inconsistent sample (naming it) or bad limits.
    """
    from megatron.core import parallel_state as ps

    if role not in ROLE_OUTPUTS:
        raise ValueError(f"unknown role {role!r}; expected one of {sorted(ROLE_OUTPUTS)}")
    require_no_context_parallel()
    for sample in samples:
        sample.validate()
    if micro_batch_size is None and max_tokens_per_micro_batch is None:
        micro_batch_size = max(1, len(samples))
    plan = plan_micro_batches(
        [s.total_length for s in samples],
        micro_batch_size=micro_batch_size,
        max_tokens_per_micro_batch=max_tokens_per_micro_batch,
    )
    # Equal shapes on every data-parallel rank where the CPU expert dispatcher needs them.
    from ember_megatron_backend.batches import pack_micro_batch, plan_layouts

    agreed = plan_layouts(model, samples, [plan], ps.get_data_parallel_group())
    layouts = agreed[0] if agreed is not None else [None] * len(plan)
    micro_batches = [
        pack_micro_batch(model, samples, indices, layout)
        for indices, layout in zip(plan, layouts, strict=True)
    ]
    options = dict(role=role, temperature=temperature, with_entropy=with_entropy)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        from ember_megatron_backend import pipeline

        return pipeline.score(model, micro_batches, **options)  # the plan keeps sample order
    pieces = [
        score_batch(model, mb.packed, mb.layout, window=mb.window, **options)
        for mb in micro_batches
    ]
    merged: dict[str, list[Tensor] | None] = {}
    for key in ("log_probs", "entropy", "values"):
        parts = [getattr(piece, key) for piece in pieces]
        merged[key] = None if parts[0] is None else [t for part in parts for t in part]
    return ForwardOutput(**merged)


@torch.no_grad()
def score_batch(
    model: Any,
    batch: PackedBatch,
    layout: Layout | None = None,
    *,
    role: str,
    temperature: float = 1.0,
    with_entropy: bool = False,
    window: ResponseWindow | None = None,
) -> ForwardOutput:
    """A forward-only pass of `model` (in eval mode) over one packed micro-batch, and the
    role's head (``heads``); the PP = 1 step of ``forward_only``. `window` is the batch's
    ``response_window`` (``MicroBatch.window``), made here when not given."""
    window = response_window(batch) if window is None else window
    was_training = model.training
    model.eval()
    try:
        rows = run_model(model, batch, layout, window=window)
    finally:
        model.train(was_training)
    return heads(rows, window.batch, role=role, temperature=temperature, with_entropy=with_entropy)


def heads(
    rows: Tensor,
    batch: PackedBatch,
    *,
    role: str,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> ForwardOutput:
    """The role's head over the rows of `batch`'s tokens ([num_tokens, ...] in stream order):
    per-sample fp32 log-probs (and entropy) at the rollout temperature, or critic values. What
    ``run_model`` returns are the rows of the response window, whose ``ResponseWindow.batch`` is
    the `batch` to read them with."""
    if ROLE_OUTPUTS[role] == "value":
        values = ValueHead().values(rows, batch.total_lengths, batch.response_lengths)
        return ForwardOutput(values=[v.float() for v in values])
    out = PolicyHead(temperature).log_probs(
        rows,
        batch.tokens[: batch.num_tokens].to(rows.device),
        batch.total_lengths,
        batch.response_lengths,
        with_entropy=with_entropy,
    )
    entropy = [e.float() for e in out.entropy] if out.entropy is not None else None
    return ForwardOutput(log_probs=[lp.float() for lp in out.log_probs], entropy=entropy)


def with_rest(log_probs: Tensor, ids: Tensor) -> Tensor:
    """[R, k + 1]: `log_probs` ([R, V]) at `ids` ([R, k]), then the log of the mass of every
    other id (a log-sum-exp over them, not 1 minus a sum: exact where the rest is tiny)."""
    rest = log_probs.scatter(1, ids, float("-inf")).logsumexp(-1, keepdim=True)
    return torch.cat([log_probs.gather(1, ids), rest], dim=1)


@torch.no_grad()
def log_probs_at(
    model: Any,
    samples: Sequence[Sample],
    ids: Sequence[Tensor],
    *,
    temperature: float,
    context: Callable[[Any], AbstractContextManager[Any]],
) -> list[Tensor]:
    """The full vocabulary's log-softmax at the rollout temperature, read at given token ids:
    per sample i, [R_i, k + 1] fp32 log-probs of `ids[i]` ([R_i, k]) at each response position,
    then of every other id together (-inf when the k ids cover the vocabulary).

    One sample per forward, each inside `context(micro_batch)` (the plugins' forward context).
    Collective over the model-parallel ranks: every rank passes the same samples. Needs
    PP = 1 and CP = 1.
    """
    from megatron.core import parallel_state as ps

    from ember_megatron_backend.batches import pack_micro_batch, plan_layouts

    require_no_context_parallel()
    if ps.get_pipeline_model_parallel_world_size() > 1:
        raise ValueError("log-probs at given ids need train.parallel.pipeline_parallel=1")
    plan = [[i] for i in range(len(samples))]
    agreed = plan_layouts(model, list(samples), [plan], ps.get_data_parallel_group())
    layouts = agreed[0] if agreed is not None else [None] * len(plan)
    was_training = model.training
    model.eval()
    out = []
    try:
        for indices, layout in zip(plan, layouts, strict=True):
            sample, wanted = samples[indices[0]], ids[indices[0]]
            if tuple(wanted.shape[:1]) != (sample.response_length,):
                raise ValueError(
                    f"sample {sample.index}: ids for {wanted.shape[0]} positions, expected one "
                    f"row per response token ({sample.response_length})"
                )
            mb = pack_micro_batch(model, samples, indices, layout)
            with context(mb):
                rows = run_model(model, mb.packed, mb.layout, window=mb.window)
            logits = rows[: sample.response_length].float() / temperature
            log_probs = torch.log_softmax(logits, dim=-1)
            out.append(with_rest(log_probs, wanted.to(log_probs.device, torch.long)).cpu())
    finally:
        model.train(was_training)
    return out
