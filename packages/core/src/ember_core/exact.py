"""Batch-invariant kernels shared by the rollout engine and the trainer (`rollout.true_on_policy`).

A decode step and a training forward compute the same token's numbers with differently shaped
products: the engine multiplies a few rows (one per sequence in the batch) with each weight and
one query with its cache, the trainer thousands of rows and whole causal blocks. CPU GEMM
kernels pick their blocking, and with it the order in which a dot product is summed, from the
shape, so the same row comes out a few ulps apart. The functions here fix every shape that
decides a reduction order, and both sides call them, so a token's numbers are the same bits
whichever batch it sits in:

- `linear`: never fewer than `ROW_TILE` rows (nor outputs) reach the GEMM (fewer are padded
  with zeros). Measured (torch 2.14): a row of a product with at least 16 rows is the same bits
  whatever the other rows are and wherever the row sits, in fp32 and bf16, with MKL's kernel
  and with oneDNN's packed one; below that fp32 rows differ (1-3, 5-7 and 9-11 rows on a 2-core
  AMD EPYC with 2 threads; a Xeon's equal only from 16 rows on). `check_linear` verifies this
  where a run starts.
- `attention`: the scores and the weighted sum of one query are products of exactly
  `ROW_TILE` query rows with the keys of its sequence up to a length that depends only on the
  query's position (`key_span`), masked past the query; the softmax runs over that same span.
  A decode step pads its query to a tile, a training forward cuts its queries into tiles. The
  trainer's copies of each block's keys and values per tile, kept for the backward, grow with
  the sequence's length times its spans: fine for RL answers of hundreds of tokens, heavy for
  thousands.
- `rms_norm`: one formula (transformers' RMSNorm: fp32 mean of squares, the normalised value
  cast back before the weight multiplies it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

ROW_TILE = 16
"""Rows per product: the fewest rows every GEMM of both sides sees."""

KEY_BLOCK = 4 * ROW_TILE
"""Attention spans grow in blocks of this many keys (a multiple of `ROW_TILE`, so that one
tile of consecutive query positions shares one span). Larger blocks score more masked keys;
smaller ones split a decode batch into more products (one per span its rows reach)."""


class ExactModeError(RuntimeError):
    """This machine's kernels do not give the same bits for a row whatever its batch."""


def key_span(position: torch.Tensor | int) -> torch.Tensor | int:
    """How many keys the query at 0-based `position` is scored against (the rest masked)."""
    return (position // KEY_BLOCK + 1) * KEY_BLOCK


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    cached: bool = True,
) -> torch.Tensor:
    """`F.linear` whose rows do not depend on how many rows come with them (differentiable).

    Fewer than `ROW_TILE` rows are padded with zero rows, and a weight of fewer than
    `ROW_TILE` outputs with zero outputs (a product with one output column is a matrix-vector
    product, whose sums follow the row count). fp32 weights on CPU of `PACK_MIN_INPUTS` inputs
    or more multiply through oneDNN's packed kernel, which is batch-invariant from `ROW_TILE` rows
    on too and spares a decode step the repacking every `F.linear` call does: packed once per
    weight version
    (`packed_weight`) where `cached`, else at every call. A caller whose weights change without
    torch's version counter seeing it (an optimizer that writes through `.data`, as
    megatron-core's setups can) passes `cached=False`.
    """
    rows = x.reshape(-1, x.shape[-1])
    num_rows, outputs = rows.shape[0], weight.shape[0]
    if num_rows < ROW_TILE:
        rows = torch.cat([rows, rows.new_zeros(ROW_TILE - num_rows, rows.shape[1])])
    if outputs < ROW_TILE:
        weight = torch.cat([weight, weight.new_zeros(ROW_TILE - outputs, weight.shape[1])])
        if bias is not None:
            bias = torch.cat([bias, bias.new_zeros(ROW_TILE - outputs)])
        out = F.linear(rows, weight, bias)
    elif _packs(weight, rows):
        # An inference tensor has no version counter to key a packing on.
        packed = packed_weight(weight) if cached and not weight.is_inference() else _pack(weight)
        out = _PackedProduct.apply(rows, weight, bias, packed)
    else:
        out = F.linear(rows, weight, bias)
    if num_rows < ROW_TILE or outputs < ROW_TILE:
        out = out[:num_rows, :outputs]
    return out.reshape(*x.shape[:-1], outputs)


PACK_MIN_INPUTS = 256
"""fp32 CPU weights of at least this many inputs (columns) go through oneDNN's packed kernel,
narrower ones through `F.linear` (MKL), on both sides alike. The choice depends on the inputs
alone, so the trainer's fused QKV and gate/up weights take the kernel the engine's separate
ones take (their columns are the same dot products). oneDNN's call costs more than a small
weight's repacking saves (as `ember_rollout.packed_linear` measured for the engine's default
kernels): the tiny presets (64 wide) stay on MKL, SmolLM2 (576) is packed."""


def _packs(weight: torch.Tensor, rows: torch.Tensor) -> bool:
    return (
        weight.dtype == torch.float32
        and rows.dtype == torch.float32
        and weight.device.type == "cpu"
        and weight.shape[1] >= PACK_MIN_INPUTS
        and _PACKING
    )


_PACKING = torch.backends.mkldnn.is_available() and hasattr(
    torch.ops.mkldnn, "_reorder_linear_weight"
)
_PACKED: dict[tuple, tuple[StorageWeakRef, int, torch.Tensor]] = {}
_sweep_at = 4096
"""Entries at which the next miss drops those of freed storages (then twice what is left)."""


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's packed copy of an fp32 CPU `weight` [out, in], made again after a write to it.

    Kept per place in memory (storage, offset, shape, strides) with the version counter torch
    bumps on every in-place write to the tensor or a view of it (`copy_` of a weight load,
    an optimizer's in-place update of the parameter itself); a storage that was freed, or a
    place now holding another tensor, is packed anew. A write through `.data` (another tensor
    object on the same storage) bumps no counter the packing sees: weights written that way
    go through `linear(..., cached=False)`.
    """
    global _sweep_at
    storage = weight.untyped_storage()
    key = (storage._cdata, weight.storage_offset(), tuple(weight.shape), weight.stride())
    found = _PACKED.get(key)
    if found is not None and not found[0].expired() and found[1] == weight._version:
        return found[2]
    if len(_PACKED) >= _sweep_at:  # entries of freed storages: drop them
        for stale in [k for k, v in _PACKED.items() if v[0].expired()]:
            del _PACKED[stale]
        _sweep_at = max(4096, 2 * len(_PACKED))
    packed = _pack(weight)
    _PACKED[key] = (StorageWeakRef(storage), weight._version, packed)
    return packed


def forget_packed() -> None:
    """Drop every packed copy (`packed_weight`): for an owner of weights that change without
    bumping their version counters, before the next products with them."""
    _PACKED.clear()


def _pack(weight: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 4 * ROW_TILE)


class _PackedProduct(torch.autograd.Function):
    """rows @ weight.T (+ bias) through a packed weight; gradients by plain matrix products."""

    @staticmethod
    def forward(ctx, rows, weight, bias, packed):  # type: ignore[override]
        ctx.save_for_backward(rows, weight)
        ctx.with_bias = bias is not None
        return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        rows, weight = ctx.saved_tensors
        grad_rows = grad @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad.t() @ rows if ctx.needs_input_grad[1] else None
        grad_bias = grad.sum(0) if ctx.with_bias and ctx.needs_input_grad[2] else None
        return grad_rows, grad_weight, grad_bias, None


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
    those past it masked. Queries before the start (padding) come out zero. What the masked
    places hold never reaches the result (their scores are -inf, their weights exactly 0), as
    long as it is finite.

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
    aligned = bool((starts == 0).all())  # keys at their positions: slices, not gathers
    for block in blocks.unique().tolist():
        if block < 0:
            continue
        span = key_span(block * KEY_BLOCK)
        rows_b, rows_q = (blocks == block).nonzero(as_tuple=True)  # this block's queries
        seqs, seq_of = rows_b.unique(return_inverse=True)
        keys, values = _span(k, seqs, starts, span, aligned), _span(v, seqs, starts, span, aligned)
        pos = positions[rows_b, rows_q]
        picked = q[rows_b, :, rows_q]  # [n, H, D]
        if num_q == 1:
            # A decode step, one query per sequence: its key head's `group` heads share a tile.
            tile_rows, where = group, None
            rows = picked.view(len(seqs), kv_heads, group, dim)
            rows_pos = pos[:, None, None].expand(-1, kv_heads, group)
        else:
            # A tile holds one head's queries at ROW_TILE consecutive positions.
            tile_rows = group * KEY_BLOCK
            where = (
                torch.arange(group, device=device) * KEY_BLOCK + (pos - block * KEY_BLOCK)[:, None]
            )
            rows = q.new_zeros(len(seqs), kv_heads, tile_rows, dim)
            rows_pos = positions.new_zeros(len(seqs), kv_heads, tile_rows)
            rows[seq_of[:, None], :, where] = picked.view(-1, kv_heads, group, dim).transpose(1, 2)
            rows_pos[seq_of[:, None], :, where] = pos[:, None, None]
        tiles = -(-tile_rows // ROW_TILE)
        q_t = q.new_zeros(len(seqs), kv_heads, tiles * ROW_TILE, dim)
        q_t[:, :, :tile_rows] = rows
        pos_t = positions.new_zeros(len(seqs), kv_heads, tiles * ROW_TILE)
        pos_t[:, :, :tile_rows] = rows_pos
        k_t = keys[:, :, None].expand(-1, -1, tiles, -1, -1).reshape(-1, span, dim)
        v_t = values[:, :, None].expand(-1, -1, tiles, -1, -1).reshape(-1, span, dim_v)
        scores = torch.bmm(q_t.view(-1, ROW_TILE, dim), k_t.transpose(1, 2)).float() * scale
        allowed = torch.arange(span, device=device) <= pos_t.view(-1, ROW_TILE, 1)
        weights = scores.masked_fill_(~allowed, float("-inf")).softmax(-1).to(q.dtype)
        ctx = torch.bmm(weights, v_t).view(len(seqs), kv_heads, -1, dim_v)
        if where is None:
            out[rows_b, :, rows_q] = ctx[:, :, :tile_rows].reshape(len(seqs), heads, dim_v)
        else:
            back = ctx[seq_of[:, None], :, where]  # [n, group, Hkv, Dv]
            out[rows_b, :, rows_q] = back.transpose(1, 2).reshape(-1, heads, dim_v)
    return out


def _span(
    x: torch.Tensor, seqs: torch.Tensor, starts: torch.Tensor, span: int, aligned: bool
) -> torch.Tensor:
    """[n, Hkv, span, D]: the keys (or values) of `seqs` at positions [0, span); past the
    cache's end, whatever finite value is at hand (those places are masked)."""
    width = x.shape[2]
    if aligned:
        taken = x[seqs, :, : min(span, width)]
        if span > width:
            taken = torch.cat(
                [taken, taken.new_zeros(*taken.shape[:2], span - width, x.shape[3])], 2
            )
        return taken.contiguous()
    idx = (starts[seqs, None] + torch.arange(span, device=x.device)).clamp(max=width - 1)
    return x[seqs[:, None], :, idx].permute(0, 2, 1, 3).contiguous()


def check_linear(shapes: set[tuple[int, int]], dtype: torch.dtype, device: torch.device) -> None:
    """Check that `linear` gives each row the same bits whatever rows come with it, for the
    [in, out] weight shapes a model uses: every row count up to a tile and some above, the
    first and the last rows of a larger batch, the batch shuffled, and half the weight's
    outputs against the same columns of the whole. Raise `ExactModeError` naming the first
    shape and row count that differ. Attention's batched products are not checked here (their
    shapes are fixed by the tiles); engine and trainer must run on the same kind of device and
    processor, which neither side can see from its own process."""
    generator = torch.Generator().manual_seed(0)
    for n_in, n_out in sorted(shapes):
        weight = torch.randn(n_out, n_in, generator=generator).to(dtype=dtype, device=device)
        x = torch.randn(3 * ROW_TILE, n_in, generator=generator).to(dtype=dtype, device=device)
        full = linear(x, weight)
        shuffle = torch.randperm(len(x), generator=generator).to(device)
        checks = [(len(x), torch.equal(linear(x[shuffle], weight), full[shuffle]))]
        # A fused weight's slice against the separate weight (the trainer's fused QKV and
        # gate/up products, the engine's separate ones): the same columns, the same bits.
        half = max(n_out // 2, 1)
        checks.append((len(x), torch.equal(linear(x, weight[:half].clone()), full[:, :half])))
        for rows in (*range(1, ROW_TILE + 2), 2 * ROW_TILE - 1, 2 * ROW_TILE + 1):
            checks.append((rows, torch.equal(linear(x[:rows], weight), full[:rows])))
            checks.append((rows, torch.equal(linear(x[-rows:], weight), full[-rows:])))
        for rows, same in checks:
            if not same:
                raise ExactModeError(
                    f"rollout.true_on_policy: on this machine {rows} rows times a "
                    f"[{n_out}, {n_in}] {dtype} weight on {device} are not the same bits as "
                    f"those rows among {len(x)}; its matrix products are not batch-invariant"
                )


def route(
    logits: torch.Tensor,
    topk: int,
    *,
    score: str,
    norm_topk_prob: bool,
    scaling: float = 1.0,
    expert_bias: torch.Tensor | None = None,
    num_groups: int = 0,
    group_topk: int = 0,
) -> torch.Tensor:
    """The experts a router picks from its fp32 `logits` [T, E]: ids [T, topk].

    "softmax": the top-k of the softmax. "sigmoid": the top-k of sigmoid(logits) + `expert_bias`
    among the best `group_topk` of `num_groups` groups (each scored by its two best experts),
    as DeepSeek-V3 and GLM-4.5 route. `norm_topk_prob` and `scaling` only weigh (`route_weights`).
    """
    if score == "softmax":
        return torch.topk(logits.softmax(-1), topk, dim=-1).indices
    choice = logits.sigmoid()
    if expert_bias is not None:
        choice = choice + expert_bias.float()
    if num_groups and group_topk:
        tokens, experts = choice.shape
        grouped = choice.view(tokens, num_groups, experts // num_groups)
        best = torch.topk(grouped.topk(2, dim=-1).values.sum(-1), group_topk, dim=-1).indices
        keep = torch.zeros(tokens, num_groups, dtype=torch.bool, device=logits.device)
        keep.scatter_(1, best, True)
        keep = keep[:, :, None].expand_as(grouped).reshape(tokens, experts)
        choice = choice.masked_fill(~keep, float("-inf"))
    return torch.topk(choice, topk, dim=-1).indices


def route_weights(
    logits: torch.Tensor, ids: torch.Tensor, *, score: str, norm_topk_prob: bool, scaling: float
) -> torch.Tensor:
    """The weights [T, k] (fp32) of experts `ids` from the router's fp32 `logits` [T, E]: the
    softmax (or sigmoid) at the ids, renormalised over them under `norm_topk_prob` (the sigmoid's
    with 1e-20 in the sum), times `scaling`. The same for chosen and replayed ids."""
    if score == "softmax":
        weights = logits.softmax(-1).gather(1, ids)
        if norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
    else:
        weights = logits.sigmoid().gather(1, ids)
        if norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling if scaling != 1.0 else weights


def experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: Sequence[torch.Tensor],
    down: Sequence[torch.Tensor],
    *,
    cached: bool = True,
) -> torch.Tensor:
    """Routed SwiGLU experts, summed per token in ascending expert order (differentiable).

    Args:
        x: Tokens [T, H].
        ids: Each token's experts [T, k] (any order).
        weights: Their weights [T, k]; cast to x's dtype before they multiply.
        gate_up: Per expert, the [2F, H] weight of its gate (first F rows) and up projections.
        down: Per expert, the [H, F] weight of its down projection.
        cached: As `linear`'s.
    """
    out = torch.zeros_like(x)
    for expert in ids.unique().tolist():
        tokens, slots = (ids == expert).nonzero(as_tuple=True)
        gate, up = linear(x[tokens], gate_up[expert], cached=cached).chunk(2, dim=-1)
        y = linear(F.silu(gate) * up, down[expert], cached=cached)
        out = out.index_add(0, tokens, y * weights[tokens, slots, None].to(y.dtype))
    return out
