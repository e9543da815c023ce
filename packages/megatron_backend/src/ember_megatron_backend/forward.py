"""Forward-only passes over packed micro-batches: per-sample log-probs, entropy or values."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ember_core.heads import PolicyHead, ValueHead
from ember_core.types import PackedBatch, Sample, pack_samples
from ember_megatron_backend.model import uses_te_spec
from ember_megatron_backend.parallel import device

__all__ = [
    "ROLE_OUTPUTS",
    "ForwardOutput",
    "forward_only",
    "model_inputs",
    "plan_micro_batches",
    "router_rows",
    "router_rows_to_stream",
    "run_model",
    "stream_rows",
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


def _padded_rows(batch: PackedBatch) -> tuple[Tensor, int]:
    """For the padded [B, S] layout: each stream token's row in the flattened [B * S] batch, and
    S (the longest sample)."""
    lengths = torch.tensor(batch.total_lengths)
    width = int(lengths.max())
    sample_of = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    offsets = batch.cu_seqlens[: len(lengths)].to(torch.long)  # a padding segment left out
    within = torch.arange(batch.num_tokens) - offsets[sample_of]
    return sample_of * width + within, width


def model_inputs(batch: PackedBatch) -> dict[str, Any]:
    """GPTModel keyword arguments for a packed batch on this rank's device.

    Transformer Engine attention reads the packing from ``PackedSeqParams`` ("thd"). megatron-
    core's local attention refuses those, so without TE the samples go in as a right-padded
    [B, S] batch under one causal mask: every sample starts at position 0 (RoPE sees its own
    positions, as in transformers), real tokens never see the padding that follows them, and
    attention costs B * S^2 rather than the (B * S)^2 of a block-diagonal mask over the stream.
    ``stream_rows`` maps the output back to stream order and ``router_rows`` says which stream
    token each MoE router row holds.
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
    return _padded_inputs(batch, *_padded_rows(batch))


def _padded_inputs(batch: PackedBatch, rows: Tensor, width: int) -> dict[str, Any]:
    dev = device()
    ids = torch.zeros(batch.num_samples * width, dtype=torch.long)
    ids[rows] = batch.tokens[: batch.num_tokens]
    masked = torch.ones(width, width, dtype=torch.bool).triu(diagonal=1)
    return {
        "input_ids": ids.view(batch.num_samples, width).to(dev),
        "position_ids": torch.arange(width).expand(batch.num_samples, width).to(dev),
        # local attention builds its default causal mask on CUDA, so it is passed here.
        "attention_mask": masked[None, None].to(dev),
    }


def stream_rows(output: Tensor, batch: PackedBatch) -> Tensor:
    """The model's output [b, s, ...] for the inputs of ``model_inputs(batch)`` as
    [num_tokens, ...] rows in stream order (padding dropped)."""
    if uses_te_spec():
        return output[0, : batch.num_tokens]
    return _gather_rows(output, _padded_rows(batch)[0])


def _gather_rows(output: Tensor, rows: Tensor) -> Tensor:
    flat = output.reshape(-1, *output.shape[2:])
    return flat.index_select(0, rows.to(flat.device))


def router_rows(batch: PackedBatch) -> Tensor | None:
    """For the padded layout: [B * S] stream position of each row the MoE routers see (megatron-
    core flattens [s, b] hidden states: row = s * B + b), -1 for padding; None for "thd", whose
    router rows are the stream itself."""
    if uses_te_spec():
        return None
    rows, width = _padded_rows(batch)
    index = torch.full((batch.num_samples * width,), -1, dtype=torch.long)
    index[rows] = torch.arange(batch.num_tokens)
    # [b, s] -> [s, b] order
    return index.view(batch.num_samples, width).t().reshape(-1)


def router_rows_to_stream(values: Tensor, batch: PackedBatch) -> Tensor:
    """Per-row values of the MoE routers ([R, ...], e.g. a routing map) in stream order
    ([num_tokens, ...]); the values themselves for "thd", whose router rows are the stream."""
    index = router_rows(batch)
    if index is None:
        return values[: batch.num_tokens]
    real = index >= 0
    out = values.new_zeros(batch.num_tokens, *values.shape[1:])
    out[index[real]] = values[real.to(values.device)]
    return out


def run_model(model: Any, batch: PackedBatch) -> Tensor:
    """`model` over `batch`: logits (or values) [num_tokens, ...] in stream order, whole rows
    (vocabulary-sharded logits are gathered under TP)."""
    if uses_te_spec():
        return stream_rows(model(**model_inputs(batch), runtime_gather_output=True), batch)
    rows, width = _padded_rows(batch)  # once for the inputs and the output
    out = model(**_padded_inputs(batch, rows, width), runtime_gather_output=True)
    return _gather_rows(out, rows)


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
    Without a limit, all samples form one micro-batch.

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
    if ps.get_pipeline_model_parallel_world_size() > 1 or ps.get_context_parallel_world_size() > 1:
        # TODO: PP and CP go through megatron-core's pipeline schedules and a zigzag split;
        # those schedules allocate on CUDA, so they wait for the GPU training loop.
        raise NotImplementedError("forward_only supports PP = CP = 1 for now")
    for sample in samples:
        sample.validate()
    if micro_batch_size is None and max_tokens_per_micro_batch is None:
        micro_batch_size = max(1, len(samples))
    plan = plan_micro_batches(
        [s.total_length for s in samples],
        micro_batch_size=micro_batch_size,
        max_tokens_per_micro_batch=max_tokens_per_micro_batch,
    )
    policy = ROLE_OUTPUTS[role] == "policy"
    head = PolicyHead(temperature) if policy else ValueHead()
    tp = ps.get_tensor_model_parallel_world_size()
    results: list[Any] = [None] * len(samples)
    was_training = model.training
    model.eval()
    try:
        for indices in plan:
            batch = pack_samples([samples[i] for i in indices], pad_multiple=tp)
            rows = run_model(model, batch)
            if policy:
                heads = head.log_probs(
                    rows,
                    batch.tokens[: batch.num_tokens].to(rows.device),
                    batch.total_lengths,
                    batch.response_lengths,
                    with_entropy=with_entropy,
                )
                for k, i in enumerate(indices):
                    entropy = heads.entropy[k].float() if heads.entropy is not None else None
                    results[i] = (heads.log_probs[k].float(), entropy)
            else:
                values = head.values(rows, batch.total_lengths, batch.response_lengths)
                for k, i in enumerate(indices):
                    results[i] = values[k].float()
    finally:
        model.train(was_training)
    if not policy:
        return ForwardOutput(values=list(results))
    return ForwardOutput(
        log_probs=[r[0] for r in results],
        entropy=[r[1] for r in results] if with_entropy else None,
    )
