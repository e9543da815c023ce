"""Rollout samples and their packing into one "thd" token stream for training."""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


class SampleStatus(enum.StrEnum):
    """Why generation of a sample stopped."""

    PENDING = "pending"
    COMPLETED = "completed"
    """The engine sampled a stop token."""
    TRUNCATED = "truncated"
    """The response hit `max_response_len`."""
    ABORTED = "aborted"
    """The request was cancelled (for example by over-sampling)."""
    FAILED = "failed"
    """The engine reported an error for this request."""


@dataclass(kw_only=True, slots=True)
class Sample:
    """One prompt + response, as it travels from the rollout engine to the trainer.

    Token-level fields cover the response only (length `response_length`), except
    `rollout_routed_experts`, which covers every forwarded position: the engine never forwards
    the last sampled token, so it is [len(tokens) - 1, num_layers, topk].
    """

    tokens: list[int]
    """Prompt followed by response token ids."""
    response_length: int
    """Number of response tokens: the last `response_length` entries of `tokens`."""
    index: int = 0
    """Position of the sample in its rollout batch."""
    group_index: int = 0
    """Index of the prompt group (the `n_samples_per_prompt` responses of one prompt)."""
    prompt: str | list[dict[str, str]] = ""
    """The prompt as text or chat messages, kept for logging and reward functions."""
    response: str = ""
    """Decoded response text."""
    label: Any = None
    """Ground truth handed to the reward function."""
    reward: float | None = None
    """Scalar reward; None until scored."""
    loss_mask: list[int] | None = None
    """Per response token: 1 trains on the token, 0 skips it. None means all ones."""
    rollout_log_probs: list[float] | None = None
    """Log-probs of the sampled response tokens, log softmax(logits / rollout.temperature) over
    the whole vocabulary (before any top-k/top-p filter), on every engine."""
    rollout_routed_experts: torch.Tensor | None = None
    """Integer tensor [len(tokens) - 1, num_layers, topk] of the experts the engine chose."""
    status: SampleStatus = SampleStatus.PENDING
    weight_version: str | None = None
    """Version of the weights that generated the sample's first response token (the oldest of
    its spans); Ember's versions are str(rollout id) of the training that produced them, "-1"
    for the initial weights. None: the engine reported none."""
    weight_versions: list[tuple[int, str]] | None = None
    """The response's spans by the weight version that generated them, as (index of the
    span's first response token, version) pairs, ascending from index 0, with `weight_version`
    the first one and integer versions never decreasing; more than one span only under partial
    rollouts. None: the engine reported no spans, and every token came from `weight_version`."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Free-form data: engine meta info, reward details, plugin annotations."""

    def __post_init__(self) -> None:
        self.validate()

    @property
    def total_length(self) -> int:
        return len(self.tokens)

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    def effective_loss_mask(self) -> list[int]:
        """The loss mask with None resolved to all ones."""
        return [1] * self.response_length if self.loss_mask is None else list(self.loss_mask)

    def validate(self) -> None:
        """Raise ValueError naming this sample and the field if the sample is inconsistent."""
        where = f"sample {self.index} (group {self.group_index})"
        n = len(self.tokens)
        if not 1 <= self.response_length < n:
            raise ValueError(
                f"{where}: response_length={self.response_length} must be >= 1 and smaller than "
                f"len(tokens)={n} (a sample needs at least one prompt token)"
            )
        if self.loss_mask is not None:
            if len(self.loss_mask) != self.response_length:
                raise ValueError(
                    f"{where}: loss_mask has {len(self.loss_mask)} entries, expected "
                    f"response_length={self.response_length}"
                )
            if any(m not in (0, 1) for m in self.loss_mask):
                raise ValueError(f"{where}: loss_mask entries must be 0 or 1")
        if (
            self.rollout_log_probs is not None
            and len(self.rollout_log_probs) != self.response_length
        ):
            raise ValueError(
                f"{where}: rollout_log_probs has {len(self.rollout_log_probs)} entries, expected "
                f"response_length={self.response_length}"
            )
        if self.reward is not None and not math.isfinite(self.reward):
            raise ValueError(f"{where}: reward={self.reward!r} is not a finite number")
        if self.weight_versions is not None:
            starts = [start for start, _ in self.weight_versions]
            if (
                not starts
                or starts[0] != 0
                or any(b <= a for a, b in zip(starts, starts[1:], strict=False))
                or starts[-1] >= self.response_length
            ):
                raise ValueError(
                    f"{where}: weight_versions={self.weight_versions!r}: expected (start, "
                    "version) spans with starts ascending from 0 and below "
                    f"response_length={self.response_length}"
                )
            if self.weight_version is not None and self.weight_versions[0][1] != (
                self.weight_version
            ):
                raise ValueError(
                    f"{where}: weight_version={self.weight_version!r} is not the first span's "
                    f"version in weight_versions={self.weight_versions!r}"
                )
            numbers = [_integer(version) for _, version in self.weight_versions]
            if None not in numbers and any(
                b < a for a, b in zip(numbers, numbers[1:], strict=False)
            ):
                # Weights only move forward: a later span from older weights is a mislabel.
                raise ValueError(
                    f"{where}: weight_versions={self.weight_versions!r}: expected versions "
                    "that never decrease from one span to the next"
                )
        experts = self.rollout_routed_experts
        if experts is not None:
            if experts.dim() != 3 or experts.shape[0] != n - 1:
                raise ValueError(
                    f"{where}: rollout_routed_experts has shape {tuple(experts.shape)}, expected "
                    f"[len(tokens) - 1 = {n - 1}, num_layers, topk]"
                )
            if experts.is_floating_point() or experts.is_complex():
                raise ValueError(
                    f"{where}: rollout_routed_experts must hold integer expert ids, got "
                    f"{experts.dtype}"
                )


@dataclass(kw_only=True, slots=True)
class PackedBatch:
    """Samples packed into one [T] stream, the layout Megatron calls "thd".

    Sample i spans tokens [cu_seqlens[i], cu_seqlens[i + 1]). When the stream is padded to a
    multiple, the padding is one extra trailing segment in `cu_seqlens` (so attention treats it as
    its own sequence) but not in `total_lengths`: per-sample heads read only the first
    `num_tokens` positions.
    """

    tokens: torch.Tensor
    """[T_padded] int64 token ids."""
    cu_seqlens: torch.Tensor
    """[num_samples + 1] int32 offsets, or [num_samples + 2] when padding was added."""
    total_lengths: list[int]
    response_lengths: list[int]
    loss_masks: list[torch.Tensor]
    """Per sample, [R_i] float32 mask of the response tokens."""
    position_ids: torch.Tensor
    """[T_padded] int64 position of each token inside its own sequence."""
    num_tokens: int
    """sum(total_lengths): the stream length before padding."""

    @property
    def num_samples(self) -> int:
        return len(self.total_lengths)

    @property
    def padded_length(self) -> int:
        return int(self.tokens.numel())


def _integer(version: str) -> int | None:
    """A weight version as an integer (Ember's are str(rollout id)), or None for another form."""
    try:
        return int(version)
    except (TypeError, ValueError):
        return None


def pack_samples(
    samples: Sequence[Sample], *, pad_multiple: int = 1, pad_token_id: int = 0
) -> PackedBatch:
    """Pack samples into one token stream, padding its end to a multiple of `pad_multiple`.

    Args:
        samples: The samples to pack, in order.
        pad_multiple: The padded stream length is a multiple of this (for example the
            tensor-parallel size with sequence parallelism).
        pad_token_id: Token id used for the padding positions.

    Returns:
        The packed batch. Padding adds a trailing segment to `cu_seqlens` only.
    """
    if not samples:
        raise ValueError("pack_samples: samples is empty; a batch needs at least one sample")
    if pad_multiple < 1:
        raise ValueError(f"pack_samples: pad_multiple={pad_multiple} must be >= 1")
    for sample in samples:
        sample.validate()
    total_lengths = [s.total_length for s in samples]
    num_tokens = sum(total_lengths)
    padded = -(-num_tokens // pad_multiple) * pad_multiple

    tokens = torch.full((padded,), pad_token_id, dtype=torch.long)
    tokens[:num_tokens] = torch.tensor([t for s in samples for t in s.tokens], dtype=torch.long)
    bounds = [0]
    for length in total_lengths:
        bounds.append(bounds[-1] + length)
    if padded > num_tokens:
        bounds.append(padded)
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
    position_ids = torch.cat(
        [
            torch.arange(b - a, dtype=torch.long)
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)
        ]
    )
    return PackedBatch(
        tokens=tokens,
        cu_seqlens=cu_seqlens,
        total_lengths=total_lengths,
        response_lengths=[s.response_length for s in samples],
        loss_masks=[torch.tensor(s.effective_loss_mask(), dtype=torch.float32) for s in samples],
        position_ids=position_ids,
        num_tokens=num_tokens,
    )
