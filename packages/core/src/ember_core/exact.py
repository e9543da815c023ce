"""Batch-invariant kernels shared by the rollout engine and the trainer (`rollout.true_on_policy`).

A decode step and a training forward compute the same token's numbers with differently shaped
products: the engine multiplies a few rows (one per sequence in the batch) with each weight and
one query with its cache, the trainer thousands of rows and whole causal blocks. CPU GEMM
kernels pick their blocking, and with it the order in which a dot product is summed, from the
shape, so the same row comes out a few ulps apart. The functions here fix every shape that
decides a reduction order, and both sides call them, so a token's numbers are the same bits
whichever batch it sits in:

- `linear`: never fewer than `ROW_TILE` rows reach the GEMM (fewer are padded with zeros).
  Measured (torch 2.14, fp32 and bf16): a row of a product with at least 16 rows is the same
  bits whatever the other rows are and wherever the row sits; below that (1-11 rows on a 2-core
  AMD EPYC, 1-8 on a Xeon) it is not. `check_linear` verifies this where a run starts.
- `attention`: the scores and the weighted sum of one query are products of exactly
  `ROW_TILE` query rows with the keys of its sequence up to a length that depends only on the
  query's position (`key_span`), masked past the query; the softmax runs over that same span.
  A decode step pads its query to a tile, a training forward cuts its queries into tiles.
- `rms_norm`: one formula (transformers' RMSNorm: fp32 mean of squares, the normalised value
  cast back before the weight multiplies it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_TILE = 16
"""Rows per product: the fewest rows every GEMM of both sides sees."""

KEY_BLOCK = ROW_TILE
"""Attention spans grow in blocks of this many keys (a multiple of `ROW_TILE`, so that one
tile of consecutive query positions shares one span)."""


class ExactModeError(RuntimeError):
    """This machine's kernels do not give the same bits for a row whatever its batch."""


def key_span(position: torch.Tensor | int) -> torch.Tensor | int:
    """How many keys the query at 0-based `position` is scored against (the rest masked)."""
    return (position // KEY_BLOCK + 1) * KEY_BLOCK


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` whose rows do not depend on how many rows come with them (differentiable)."""
    rows = x.reshape(-1, x.shape[-1])
    short = ROW_TILE - rows.shape[0]
    if short > 0:
        rows = torch.cat([rows, rows.new_zeros(short, rows.shape[1])])
    out = F.linear(rows, weight, bias)
    if short > 0:
        out = out[: ROW_TILE - short]
    return out.reshape(*x.shape[:-1], weight.shape[0])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, as transformers' Llama/Qwen/Mixtral/DeepSeek norms; the
    weight multiplies in the input's dtype (the engine's copy of a weight the trainer keeps in
    fp32 is rounded to the model's dtype)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(x.dtype) * h.to(x.dtype)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, key_starts: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention whose every query is reduced the same way in decode and in training.

    The Q queries are the last Q entries of the W along the keys; sequence b starts at
    `key_starts[b]` (left padding before it), so the query at entry w sits at position
    `w - key_starts[b]` and is scored against the keys of positions [0, `key_span`(position)),
    those past it masked. Queries before the start (padding) come out zero.

    Args:
        q: Queries [B, H, Q, D].
        k: Keys [B, Hkv, W, D] (H a multiple of Hkv: each group of H / Hkv consecutive heads
            shares a key head).
        v: Values [B, Hkv, W, Dv].
        key_starts: [B] where each sequence's first token sits along W.
        scale: Multiplies the scores before the softmax.

    Returns:
        [B, H, Q, Dv] in the queries' dtype.
    """
    batch, heads, num_q, dim = q.shape
    kv_heads, width, dim_v = k.shape[1], k.shape[2], v.shape[-1]
    group, device = heads // kv_heads, q.device
    starts = key_starts.to(device=device, dtype=torch.long)
    positions = torch.arange(width - num_q, width, device=device) - starts[:, None]  # [B, Q]
    out = q.new_zeros(batch, heads, num_q, dim_v)
    blocks = torch.where(positions >= 0, positions // KEY_BLOCK, -1)
    for block in blocks.unique().tolist():
        if block < 0:
            continue
        span = (block + 1) * KEY_BLOCK
        rows_b, rows_q = (blocks == block).nonzero(as_tuple=True)  # this block's queries
        seqs, seq_of = rows_b.unique(return_inverse=True)
        # Keys of each sequence at positions [0, span); zeros past the cache's end.
        idx = starts[seqs, None] + torch.arange(span, device=device)
        inside = (idx < width)[:, None, :, None]
        idx = idx.clamp(max=width - 1)
        keys = k[seqs[:, None], :, idx].permute(0, 2, 1, 3) * inside
        values = v[seqs[:, None], :, idx].permute(0, 2, 1, 3) * inside
        pos = positions[rows_b, rows_q]
        picked = q[rows_b, :, rows_q]  # [n, H, D]
        if num_q == 1:
            # A decode step, one query per sequence: its key head's `group` heads fill a tile.
            rows = picked.reshape(len(seqs), kv_heads, group, dim)
            rows_pos = pos[:, None, None].expand(-1, kv_heads, group)
            where = None
        else:
            # A tile holds one head's queries at the block's KEY_BLOCK positions.
            rows = q.new_zeros(len(seqs), kv_heads, group * KEY_BLOCK, dim)
            rows_pos = positions.new_zeros(len(seqs), kv_heads, group * KEY_BLOCK)
            where = (
                torch.arange(group, device=device) * KEY_BLOCK + (pos - block * KEY_BLOCK)[:, None]
            )
            rows[seq_of[:, None], :, where] = picked.reshape(-1, kv_heads, group, dim).transpose(
                1, 2
            )
            rows_pos[seq_of[:, None], :, where] = pos[:, None, None]
        used = rows.shape[2]
        tiles = -(-used // ROW_TILE)
        if tiles * ROW_TILE > used:
            fill = tiles * ROW_TILE - used
            rows = torch.cat([rows, rows.new_zeros(*rows.shape[:2], fill, dim)], dim=2)
            rows_pos = torch.cat([rows_pos, rows_pos.new_zeros(*rows_pos.shape[:2], fill)], dim=2)
        q_t = rows.reshape(-1, ROW_TILE, dim)
        k_t = keys[:, :, None].expand(-1, -1, tiles, -1, -1).reshape(-1, span, dim)
        v_t = values[:, :, None].expand(-1, -1, tiles, -1, -1).reshape(-1, span, dim_v)
        scores = torch.bmm(q_t.contiguous(), k_t.transpose(1, 2)).float() * scale
        allowed = torch.arange(span, device=device) <= rows_pos.reshape(-1, ROW_TILE, 1)
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1).to(q.dtype)
        ctx = torch.bmm(weights, v_t.contiguous()).reshape(len(seqs), kv_heads, -1, dim_v)
        if where is None:
            out[rows_b, :, rows_q] = ctx[:, :, :used].reshape(len(seqs), heads, dim_v)
        else:
            back = ctx[seq_of[:, None], :, where]  # [n, group, Hkv, Dv]
            out[rows_b, :, rows_q] = back.transpose(1, 2).reshape(-1, heads, dim_v)
    return out


def check_linear(shapes: set[tuple[int, int]], dtype: torch.dtype, device: torch.device) -> None:
    """Check that `linear` gives each row the same bits alone as in a large batch, for the
    [in, out] weight shapes a model uses; raise `ExactModeError` naming the first that does not.
    """
    generator = torch.Generator().manual_seed(0)
    for n_in, n_out in sorted(shapes):
        weight = torch.randn(n_out, n_in, generator=generator).to(dtype=dtype, device=device)
        x = torch.randn(200, n_in, generator=generator).to(dtype=dtype, device=device)
        full = linear(x, weight)
        for rows in (1, 3, ROW_TILE, ROW_TILE + 1, 2 * ROW_TILE + 5):
            if not torch.equal(linear(x[-rows:], weight), full[-rows:]):
                raise ExactModeError(
                    f"rollout.true_on_policy: on this machine a {rows}-row product with a "
                    f"[{n_out}, {n_in}] {dtype} weight on {device} is not the same bits as the "
                    "same rows in a 200-row batch; the kernels are not batch-invariant here"
                )
