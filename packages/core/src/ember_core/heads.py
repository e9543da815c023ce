"""Loss heads: per-sample response log-probs, entropy and values from packed model outputs."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "HeadOutput",
    "PolicyHead",
    "ResponseRows",
    "RowSpan",
    "ValueHead",
    "assemble_cp",
    "cp_padded_length",
    "response_spans",
    "select_response_rows",
    "zigzag_split",
]

DEFAULT_CHUNK_BYTES = 128 * 1024 * 1024
"""Default bound on PolicyHead's fp32 scratch memory (two [C, V] chunk buffers).

Chunks much smaller than this fit in cache but multiply the number of kernel launches and,
on CPU, of thread-pool barriers, which is slower as soon as the cores are shared."""


# ---------------------------------------------------------------------------------------------
# Response slicing (shared by both heads)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RowSpan:
    """A run of consecutive local rows that predict consecutive tokens of one response."""

    sample: int
    """Index of the sample in `total_lengths`."""
    start: int
    """First local row of the run (row index in this rank's packed stream)."""
    stop: int
    """One past the last local row of the run."""
    offset: int
    """Position within the sample's response of the token that row `start` predicts."""


@dataclass(frozen=True, slots=True)
class ResponseRows:
    """Per-sample response rows held locally, with their positions in the response."""

    rows: list[Tensor]
    """One tensor per sample: the local response rows, in local order."""
    positions: list[Tensor] | None
    """One int64 tensor per sample with each row's position in [0, R_i); None without CP,
    where every sample's rows are all of its response, in order."""


def cp_padded_length(length: int, cp_size: int) -> int:
    """Length a sample occupies in the packed stream before a zigzag split over `cp_size` ranks.

    Without context parallelism (`cp_size == 1`) samples are not padded. With it, each sample is
    padded at its end to a multiple of `2 * cp_size` so it splits into `2 * cp_size` equal chunks.
    """
    if cp_size == 1:
        return length
    step = 2 * cp_size
    return -(-length // step) * step


def _check_cp(cp_rank: int, cp_size: int) -> None:
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be an int >= 1, got {cp_size!r}")
    if not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be an int in [0, cp_size={cp_size}), got {cp_rank!r}")


def _check_lengths(total_lengths: Sequence[int], response_lengths: Sequence[int]) -> None:
    if len(total_lengths) != len(response_lengths):
        raise ValueError(
            f"total_lengths and response_lengths must have one entry per sample, got "
            f"{len(total_lengths)} and {len(response_lengths)} entries"
        )
    for i, (length, response) in enumerate(zip(total_lengths, response_lengths, strict=True)):
        if not 1 <= response < length:
            raise ValueError(
                f"sample {i}: response_lengths[{i}]={response} must be >= 1 and < "
                f"total_lengths[{i}]={length} (the first token has no predicting row)"
            )


def _local_rows(total_lengths: Sequence[int], cp_size: int) -> int:
    return sum(cp_padded_length(n, cp_size) for n in total_lengths) // cp_size


def response_spans(
    total_lengths: Sequence[int],
    response_lengths: Sequence[int],
    *,
    cp_rank: int = 0,
    cp_size: int = 1,
) -> list[list[RowSpan]]:
    """Rows of a packed stream that predict each sample's response tokens.

    Sample i spans [s_i, s_i + L_i) of the packed stream and its response is its last R_i
    tokens, so rows [s_i + L_i - R_i - 1, s_i + L_i - 1) predict it (row j predicts token j+1).

    With context parallelism each sample is first padded at its end to
    `cp_padded_length(L_i, cp_size)` (the caller pads; lengths here stay the real ones) and cut
    into `2 * cp_size` equal chunks; rank r holds chunks r and `2 * cp_size - 1 - r`, and its
    local stream is those two chunks of every sample, concatenated in sample order (what
    `zigzag_split` produces). Each returned span then lies inside one chunk.

    Args:
        total_lengths: L_i, real (unpadded) length of each packed sample.
        response_lengths: R_i, response length of each sample, 1 <= R_i < L_i.
        cp_rank: This rank's context-parallel rank.
        cp_size: Context-parallel world size; 1 means no context parallelism.

    Returns:
        For each sample, the spans of local rows in the response window, in local row order
        (at most one without CP, at most two with it; none if this rank holds no such row).

    Raises:
        ValueError: If the lengths or the CP rank and size are inconsistent.
    """
    _check_cp(cp_rank, cp_size)
    _check_lengths(total_lengths, response_lengths)
    spans: list[list[RowSpan]] = []
    local_start = 0
    for i, (length, response) in enumerate(zip(total_lengths, response_lengths, strict=True)):
        first = length - response - 1  # in-sample position of the first predicting row
        if cp_size == 1:
            spans.append([RowSpan(i, local_start + first, local_start + length - 1, 0)])
            local_start += length
            continue
        chunk = cp_padded_length(length, cp_size) // (2 * cp_size)
        sample_spans = []
        for k, index in enumerate((cp_rank, 2 * cp_size - 1 - cp_rank)):
            lo, hi = max(index * chunk, first), min((index + 1) * chunk, length - 1)
            if lo < hi:
                row = local_start + k * chunk + lo - index * chunk
                sample_spans.append(RowSpan(i, row, row + hi - lo, lo - first))
        spans.append(sample_spans)
        local_start += 2 * chunk
    return spans


def _packed_rows(tensor: Tensor, name: str, trailing_dims: int) -> Tensor:
    """View `tensor` as packed rows [T, ...] with `trailing_dims` dims after T."""
    if tensor.dim() == trailing_dims + 2 and tensor.shape[0] == 1:
        return tensor.squeeze(0)  # a view whose backward is a view too: no [T, V] copy
    if tensor.dim() != trailing_dims + 1:
        want = "[T]" if trailing_dims == 0 else "[T, V]"
        raise ValueError(
            f"{name} must be {want} or [1, {want[1:]}, got shape {tuple(tensor.shape)}"
        )
    return tensor


def _check_rows(num_rows: int, total_lengths: Sequence[int], cp_size: int, name: str) -> None:
    expected = _local_rows(total_lengths, cp_size)
    if expected != num_rows:
        where = "" if cp_size == 1 else f" ({cp_size}-way zigzag split of padded samples)"
        raise ValueError(
            f"total_lengths sum to {sum(total_lengths)}, which gives {expected} packed rows"
            f"{where}, but {name} has T={num_rows} rows"
        )


def _positions(sample_spans: list[RowSpan]) -> Tensor:
    parts = [torch.arange(s.offset, s.offset + s.stop - s.start) for s in sample_spans]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)


def select_response_rows(
    rows: Tensor,
    total_lengths: Sequence[int],
    response_lengths: Sequence[int],
    *,
    cp_rank: int = 0,
    cp_size: int = 1,
) -> ResponseRows:
    """Per-sample rows of a packed per-token tensor that predict the response tokens.

    Args:
        rows: Packed per-token rows [T, ...] or [1, T, ...] (this rank's local stream under CP).
        total_lengths: L_i per sample (see `response_spans`).
        response_lengths: R_i per sample.
        cp_rank: This rank's context-parallel rank.
        cp_size: Context-parallel world size.

    Returns:
        The rows as views of `rows` ([R_i, ...] each without CP) and, under CP, their
        positions in the response.

    Raises:
        ValueError: If the lengths do not match each other or the number of rows.
    """
    spans = response_spans(total_lengths, response_lengths, cp_rank=cp_rank, cp_size=cp_size)
    expected = _local_rows(total_lengths, cp_size)
    if rows.dim() >= 2 and rows.shape[0] == 1 and expected != 1:
        rows = rows.squeeze(0)  # [1, T, ...] -> [T, ...]
    _check_rows(rows.shape[0], total_lengths, cp_size, "rows")
    pieces = []
    for sample_spans in spans:
        parts = [rows[s.start : s.stop] for s in sample_spans]
        if len(parts) == 1:
            pieces.append(parts[0])
        else:
            pieces.append(torch.cat(parts) if parts else rows[:0])
    positions = None if cp_size == 1 else [_positions(s) for s in spans]
    return ResponseRows(pieces, positions)


def zigzag_split(
    tensor_T: Tensor, total_lengths: Sequence[int], cp_size: int, cp_rank: int
) -> Tensor:
    """One rank's local stream of a packed tensor under zigzag context parallelism.

    Each sample is padded with zeros at its end to `cp_padded_length(L_i, cp_size)`, cut into
    `2 * cp_size` equal chunks, and the rank keeps chunks `cp_rank` and
    `2 * cp_size - 1 - cp_rank`; the result concatenates those over samples.

    Args:
        tensor_T: Packed tensor [T, ...] with T = sum(total_lengths), unpadded.
        total_lengths: L_i per sample.
        cp_size: Context-parallel world size.
        cp_rank: The rank whose local stream to return.

    Returns:
        The local stream [sum_i cp_padded_length(L_i, cp_size) / cp_size, ...].

    Raises:
        ValueError: If the lengths do not add up to T or the CP rank and size are invalid.
    """
    _check_cp(cp_rank, cp_size)
    _check_rows(tensor_T.shape[0], total_lengths, 1, "tensor_T")
    if cp_size == 1:
        return tensor_T
    parts = []
    start = 0
    for length in total_lengths:
        sample = tensor_T[start : start + length]
        start += length
        padded = cp_padded_length(length, cp_size)
        if padded > length:
            pad = sample.new_zeros((padded - length, *sample.shape[1:]))
            sample = torch.cat([sample, pad])
        chunk = padded // (2 * cp_size)
        for index in (cp_rank, 2 * cp_size - 1 - cp_rank):
            parts.append(sample[index * chunk : (index + 1) * chunk])
    return torch.cat(parts) if parts else tensor_T[:0]


def assemble_cp(
    pieces_by_rank: Sequence[Sequence[Tensor]],
    positions_by_rank: Sequence[Sequence[Tensor]],
    response_lengths: Sequence[int],
) -> list[Tensor]:
    """Reassemble full per-sample results from every CP rank's local pieces.

    Args:
        pieces_by_rank: For each rank, its per-sample local results (e.g. `HeadOutput.log_probs`).
        positions_by_rank: For each rank, the matching per-sample positions.
        response_lengths: R_i per sample.

    Returns:
        One [R_i, ...] tensor per sample; differentiable wrt the pieces.

    Raises:
        ValueError: If the positions do not cover every response position exactly once.
    """
    out = []
    for i, response in enumerate(response_lengths):
        pieces = [rank_pieces[i] for rank_pieces in pieces_by_rank]
        positions = torch.cat([rank_positions[i] for rank_positions in positions_by_rank])
        covered = torch.bincount(positions, minlength=response)
        if positions.numel() != response or not bool((covered == 1).all()):
            raise ValueError(
                f"sample {i}: positions from {len(pieces)} ranks do not cover each of the "
                f"response_lengths[{i}]={response} positions exactly once"
            )
        source = torch.cat(pieces)
        full = source.new_zeros((response, *source.shape[1:]))
        out.append(full.index_copy(0, positions.to(source.device), source))
    return out


# ---------------------------------------------------------------------------------------------
# Chunked log-softmax gather and entropy
# ---------------------------------------------------------------------------------------------

# A chunk of the selected rows: the flat range [n0, n1) it covers and the pieces
# (source row start, source row stop, row in chunk) that fill it.
_Chunk = tuple[int, int, list[tuple[int, int, int]]]


def _plan_chunks(spans: Sequence[tuple[int, int]], chunk_rows: int) -> list[_Chunk]:
    """Cut the concatenated row spans into chunks of at most `chunk_rows` rows."""
    chunks: list[_Chunk] = []
    pieces: list[tuple[int, int, int]] = []
    n0 = filled = 0
    for start, stop in spans:
        while start < stop:
            take = min(stop - start, chunk_rows - filled)
            pieces.append((start, start + take, filled))
            start += take
            filled += take
            if filled == chunk_rows:
                chunks.append((n0, n0 + filled, pieces))
                n0, filled, pieces = n0 + filled, 0, []
    if filled:
        chunks.append((n0, n0 + filled, pieces))
    return chunks


_GATHER_BELOW = 32
"""A chunk whose pieces average fewer rows than this is read and written through one row index
(index_select / index_copy_) instead of one slice op per piece: many short responses (a few
tokens each) would otherwise cost a handful of tiny ops per sample."""


def _row_index(pieces: list[tuple[int, int, int]], device: torch.device) -> Tensor | None:
    """The chunk's source rows in chunk order, when the chunk is gathered (see _GATHER_BELOW)."""
    rows = sum(stop - start for start, stop, _ in pieces)
    if len(pieces) < 2 or rows >= _GATHER_BELOW * len(pieces):
        return None
    index = [r for start, stop, _ in pieces for r in range(start, stop)]
    return torch.tensor(index, dtype=torch.long, device=device)


def _load_scaled(
    logits_TV: Tensor, pieces, temperature: float, z_CV: Tensor, index: Tensor | None
) -> None:
    """Fill z_CV with the chunk's rows of logits / temperature, in fp32."""
    if index is not None:
        if logits_TV.dtype == torch.float32:
            torch.index_select(logits_TV, 0, index, out=z_CV)
        else:
            z_CV.copy_(logits_TV.index_select(0, index))
        z_CV.div_(temperature)
        return
    for start, stop, row in pieces:
        dst = z_CV[row : row + stop - start]
        if logits_TV.dtype == torch.float32:
            torch.div(logits_TV[start:stop], temperature, out=dst)
        else:
            dst.copy_(logits_TV[start:stop]).div_(temperature)


class _ChunkedLogProbs(torch.autograd.Function):
    """log softmax(logits / t)[target] and entropy over selected rows, chunk by chunk.

    With z = logits / t, p = softmax(z), lse = logsumexp(z) and mu = sum_v p_v z_v:
      log p_target = z_target - lse,         d/dz = onehot(target) - p
      H = lse - mu,                          dH/dz_k = -p_k (z_k - mu)
    and d/dlogits = (d/dz) / t. Besides the [T, V] gradient itself, only two fp32 [C, V]
    chunk buffers are allocated. Rows are read in place from the logits, span by span: gathering
    the selected rows first (index_select) would copy most of the logits again. Only a chunk of
    many short spans is gathered, chunk by chunk (`_GATHER_BELOW`; for a half-precision logits
    tensor that adds one [C, V] temporary in its dtype).
    """

    @staticmethod
    def forward(ctx, logits_TV, targets_N, spans, temperature, with_entropy, chunk_rows):
        device = logits_TV.device
        num_rows = targets_N.shape[0]
        # Each chunk with its row index (None: read slice by slice), for backward too.
        chunks = [
            (n0, n1, pieces, _row_index(pieces, device))
            for n0, n1, pieces in _plan_chunks(spans, chunk_rows)
        ]
        rows = max((n1 - n0 for n0, n1, _, _ in chunks), default=0)
        z_CV = torch.empty(rows, logits_TV.shape[1], dtype=torch.float32, device=device)
        log_p_CV = torch.empty_like(z_CV)
        log_probs_N = torch.empty(num_rows, dtype=torch.float32, device=device)
        lse_N = torch.empty_like(log_probs_N)
        entropy_N = torch.empty(num_rows if with_entropy else 0, dtype=torch.float32, device=device)
        for n0, n1, pieces, index in chunks:
            z, log_p = z_CV[: n1 - n0], log_p_CV[: n1 - n0]
            targets = targets_N[n0:n1, None]
            _load_scaled(logits_TV, pieces, temperature, z, index)
            torch.log_softmax(z, dim=1, out=log_p)
            log_probs_N[n0:n1] = log_p.gather(1, targets)[:, 0]
            lse_N[n0:n1] = z.gather(1, targets)[:, 0] - log_probs_N[n0:n1]
            if with_entropy:
                p = torch.exp(log_p, out=z)
                # -sum_v p_v log p_v as a batched dot product: no [C, V] product temporary.
                entropy_N[n0:n1] = torch.bmm(p.unsqueeze(1), log_p.unsqueeze(2))[:, 0, 0].neg_()
        ctx.save_for_backward(logits_TV, targets_N, lse_N, entropy_N)
        ctx.spans, ctx.temperature, ctx.chunks = spans, temperature, chunks
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy_N)
        return log_probs_N, entropy_N

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_log_probs_N, grad_entropy_N):
        logits_TV, targets_N, lse_N, entropy_N = ctx.saved_tensors
        if grad_log_probs_N is None and grad_entropy_N is None:
            return (None,) * 6
        t = ctx.temperature
        spans = ctx.spans
        grad_TV = torch.empty_like(logits_TV, memory_format=torch.contiguous_format)
        # Rows outside the spans get no gradient; zero only those.
        done = 0
        for start, stop in sorted(spans):
            grad_TV[done:start].zero_()
            done = max(done, stop)
        grad_TV[done:].zero_()
        # With y = z - lse = log p, mu - lse = -H and d/dlogits = (d/dz) / t:
        #   d/dz = p * (a * y + b) + onehot * g_lp,  a = -g_H,  b = -(g_H * H + g_lp).
        g_lp_N = torch.zeros_like(lse_N) if grad_log_probs_N is None else grad_log_probs_N
        if grad_entropy_N is None:
            a_N, b_N = None, -g_lp_N / t
        else:
            a_N, b_N = -grad_entropy_N / t, -(grad_entropy_N * entropy_N + g_lp_N) / t
        chunks = ctx.chunks
        rows = max((n1 - n0 for n0, n1, _, _ in chunks), default=0)
        y_CV = torch.empty(rows, logits_TV.shape[1], dtype=torch.float32, device=grad_TV.device)
        p_CV = torch.empty_like(y_CV)
        direct = grad_TV.dtype == torch.float32
        for n0, n1, pieces, index in chunks:
            y, p = y_CV[: n1 - n0], p_CV[: n1 - n0]
            if index is not None:
                _load_scaled(logits_TV, pieces, t, y, index)
                y.sub_(lse_N[n0:n1, None])
            else:
                for start, stop, row in pieces:
                    torch.add(
                        -lse_N[n0 + row : n0 + row + stop - start, None],
                        logits_TV[start:stop],
                        alpha=1.0 / t,
                        out=y[row : row + stop - start],
                    )
            torch.exp(y, out=p)
            b = b_N[n0:n1, None]
            if a_N is None:
                y = b.expand_as(y)
            else:
                torch.addcmul(b, y, a_N[n0:n1, None], out=y)
            targets, g_lp = targets_N[n0:n1, None], g_lp_N[n0:n1, None] / t
            if index is not None:  # the whole chunk at once, then into its rows
                torch.mul(p, y, out=p)
                if grad_log_probs_N is not None:
                    p.scatter_add_(1, targets, g_lp)
                grad_TV.index_copy_(0, index, p.to(grad_TV.dtype))
                continue
            if not direct:
                torch.mul(p, y, out=p)
                if grad_log_probs_N is not None:
                    p.scatter_add_(1, targets, g_lp)
            for start, stop, row in pieces:
                rows_slice = slice(row, row + stop - start)
                if direct:  # fp32 gradient: finish the chunk in place, no copy pass
                    dst = grad_TV[start:stop]
                    torch.mul(p[rows_slice], y[rows_slice], out=dst)
                    if grad_log_probs_N is not None:
                        dst.scatter_add_(1, targets[rows_slice], g_lp[rows_slice])
                else:
                    grad_TV[start:stop].copy_(p[rows_slice])
        return grad_TV, None, None, None, None, None


# ---------------------------------------------------------------------------------------------
# Heads
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HeadOutput:
    """Per-sample response log-probs (and entropy) from `PolicyHead.log_probs`."""

    log_probs: list[Tensor]
    """One fp32 tensor per sample: [R_i] without CP, this rank's local pieces under CP."""
    entropy: list[Tensor] | None
    """Entropy of the temperature-scaled distribution at the same rows, or None if not asked."""
    positions: list[Tensor] | None = None
    """Under CP, each local value's position in the response (see `assemble_cp`); else None."""


class PolicyHead:
    """Response log-probs and entropy of the temperature-scaled policy distribution.

    Logits are divided by the temperature the rollouts were sampled at, so that the log-probs
    reproduce the rollout engine's. The computation runs over the response-predicting rows only,
    in chunks of rows with fp32 scratch buffers bounded by `chunk_bytes`: it never materialises a
    full-size softmax, log-softmax or scaled copy of the logits, in forward or in backward (whose
    only [T, V] tensor is the gradient itself, in the logits' dtype).
    """

    def __init__(self, temperature: float, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        """Create the head.

        Args:
            temperature: Sampling temperature of the rollouts; finite and > 0.
            chunk_bytes: Bound on fp32 scratch memory (two [C, V] buffers); at least one row
                is processed at a time whatever the bound.

        Raises:
            ValueError: If `temperature` is not finite and > 0 or `chunk_bytes` is not >= 1.
        """
        if (
            isinstance(temperature, bool)
            or not isinstance(temperature, numbers.Real)
            or not math.isfinite(temperature)
            or temperature <= 0
        ):
            raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
        if not isinstance(chunk_bytes, int) or chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be an int >= 1, got {chunk_bytes!r}")
        self.temperature = float(temperature)
        self.chunk_bytes = chunk_bytes

    def __repr__(self) -> str:
        return f"PolicyHead(temperature={self.temperature}, chunk_bytes={self.chunk_bytes})"

    def log_probs(
        self,
        logits: Tensor,
        tokens: Tensor,
        total_lengths: Sequence[int],
        response_lengths: Sequence[int],
        with_entropy: bool = False,
        *,
        cp_rank: int = 0,
        cp_size: int = 1,
    ) -> HeadOutput:
        """Log-probs of each sample's response tokens, and optionally the entropy there.

        Row j of the logits predicts token j + 1. Differentiable wrt `logits`.

        Args:
            logits: Packed logits [T, V] or [1, T, V], any float dtype. Under CP, this rank's
                local zigzag stream (see `response_spans`).
            tokens: Packed token ids [sum(total_lengths)] (the full, unsplit stream also
                under CP).
            total_lengths: L_i per sample.
            response_lengths: R_i per sample.
            with_entropy: Also return the entropy of softmax(logits / temperature) per row.
            cp_rank: This rank's context-parallel rank.
            cp_size: Context-parallel world size. Above 1 the outputs hold only this rank's
                rows, with their positions; `assemble_cp` combines all ranks' outputs.

        Returns:
            A HeadOutput with fp32 [R_i] tensors per sample (local pieces under CP).

        Raises:
            ValueError: If shapes, lengths, token ids or the CP rank and size are inconsistent.
        """
        spans = response_spans(total_lengths, response_lengths, cp_rank=cp_rank, cp_size=cp_size)
        logits_TV = _packed_rows(logits, "logits", 1)
        if not logits_TV.is_floating_point():
            raise ValueError(f"logits must be a float tensor, got dtype {logits_TV.dtype}")
        _check_rows(logits_TV.shape[0], total_lengths, cp_size, "logits")
        tokens_T = _packed_rows(tokens, "tokens", 0)
        if tokens_T.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"tokens must be an integer tensor of ids, got dtype {tokens_T.dtype}")
        if tokens_T.shape[0] != sum(total_lengths):
            raise ValueError(
                f"tokens has {tokens_T.shape[0]} entries but total_lengths sum to "
                f"{sum(total_lengths)}"
            )
        # Row at response position p predicts response token p: tokens[s_i + L_i - R_i + p].
        index = []
        start = 0
        for length, response, sample_spans in zip(
            total_lengths, response_lengths, spans, strict=True
        ):
            first = start + length - response
            index += [(first + s.offset, first + s.offset + s.stop - s.start) for s in sample_spans]
            start += length
        flat_spans = [(s.start, s.stop) for sample_spans in spans for s in sample_spans]
        if index:
            targets_N = torch.cat([tokens_T[a:b] for a, b in index]).to(
                device=logits_TV.device, dtype=torch.int64
            )
        else:
            targets_N = torch.empty(0, dtype=torch.int64, device=logits_TV.device)
        vocab = logits_TV.shape[1]
        if targets_N.numel() and not 0 <= int(targets_N.min()) <= int(targets_N.max()) < vocab:
            raise ValueError(
                f"tokens predicted by the response rows must be ids in [0, V={vocab}), got "
                f"values in [{int(targets_N.min())}, {int(targets_N.max())}]"
            )
        chunk_rows = max(1, self.chunk_bytes // (2 * 4 * vocab))
        log_probs_N, entropy_N = _ChunkedLogProbs.apply(
            logits_TV, targets_N, flat_spans, self.temperature, with_entropy, chunk_rows
        )
        sizes = [sum(s.stop - s.start for s in sample_spans) for sample_spans in spans]
        return HeadOutput(
            log_probs=list(torch.split(log_probs_N, sizes)),
            entropy=list(torch.split(entropy_N, sizes)) if with_entropy else None,
            positions=None if cp_size == 1 else [_positions(s) for s in spans],
        )


class ValueHead:
    """Per-sample critic values at the response rows.

    The critic's output is used as is: this head has no temperature (nor any other
    parameter), so rollout temperature cannot leak into values.
    """

    def values(
        self,
        outputs: Tensor,
        total_lengths: Sequence[int],
        response_lengths: Sequence[int],
    ) -> list[Tensor]:
        """Values at the rows that predict each sample's response tokens.

        Args:
            outputs: Critic output [1, T, 1], [T, 1] or [T].
            total_lengths: L_i per sample.
            response_lengths: R_i per sample.

        Returns:
            One [R_i] tensor per sample (views of `outputs`, same dtype).

        Raises:
            ValueError: If shapes or lengths are inconsistent.
        """
        return self.local_values(outputs, total_lengths, response_lengths).rows

    def local_values(
        self,
        outputs: Tensor,
        total_lengths: Sequence[int],
        response_lengths: Sequence[int],
        *,
        cp_rank: int = 0,
        cp_size: int = 1,
    ) -> ResponseRows:
        """Like `values`, on one context-parallel rank's local stream.

        Args:
            outputs: This rank's local critic output [1, T, 1], [T, 1] or [T].
            total_lengths: L_i per sample (real lengths; see `response_spans`).
            response_lengths: R_i per sample.
            cp_rank: This rank's context-parallel rank.
            cp_size: Context-parallel world size.

        Returns:
            Local per-sample values and, under CP, their positions (see `assemble_cp`).

        Raises:
            ValueError: If shapes, lengths or the CP rank and size are inconsistent.
        """
        if outputs.dim() == 3 and outputs.shape[0] == 1 and outputs.shape[2] == 1:
            outputs_T = outputs.squeeze(0).squeeze(-1)
        elif outputs.dim() == 2 and outputs.shape[1] == 1:
            outputs_T = outputs.squeeze(-1)
        elif outputs.dim() == 1:
            outputs_T = outputs
        else:
            raise ValueError(
                f"outputs must be [1, T, 1], [T, 1] or [T], got shape {tuple(outputs.shape)}"
            )
        return select_response_rows(
            outputs_T, total_lengths, response_lengths, cp_rank=cp_rank, cp_size=cp_size
        )
