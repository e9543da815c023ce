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
- `attention`: a query is scored against the keys of its sequence up to a length that
  depends only on its position (`key_span`), masked past it, and the softmax runs over that
  same span; the scores and the weighted sum are products of the query rows with that span.
  A training forward multiplies the `group` heads of a key head at a block's `KEY_BLOCK`
  positions at once, a decode step its query's `group` heads padded to a multiple of
  `ROW_TILE` rows: the same key spans, at least `ROW_TILE` rows, so the same bits by the
  GEMM's row-invariance (checked once per head layout where a run starts). The engine keeps
  its keys at their positions (`ember_rollout.true_on_policy.PositionCache`), so a decode
  step reads them as one view.
- `rms_norm`: one formula (transformers' RMSNorm: fp32 mean of squares, the normalised value
  cast back before the weight multiplies it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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
        inputs = (rows, weight) if bias is None else (rows, weight, bias)
        if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
            out = _PackedProduct.apply(rows, weight, bias, packed)
        else:  # the engine's decode: no graph to record
            out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
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
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_starts: torch.Tensor,
    scale: float,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention whose every query is reduced the same way in decode and in training.

    Sequence b's keys start at `key_starts[b]` along W (left padding before it; 0 for keys
    stored at their positions), so its key of position p sits at `key_starts[b] + p`. The query
    at position p is scored against the keys of positions [0, `key_span`(p)), those past p
    masked. Queries at a negative position (padding) come out zero. What the masked places
    hold never reaches the result (their scores are -inf, their weights exactly 0), as long as
    it is finite.

    Args:
        q: Queries [B, H, Q, D].
        k: Keys [B, Hkv, W, D] (H a multiple of Hkv: each group of H / Hkv consecutive heads
            shares a key head).
        v: Values [B, Hkv, W, Dv].
        key_starts: [B] where each sequence's first key sits along W.
        scale: Multiplies the scores before the softmax.
        positions: The queries' positions [B, Q]; by default the queries are the last Q
            entries along W (position `w - key_starts[b]` for entry w).

    Returns:
        [B, H, Q, Dv] in the queries' dtype.
    """
    batch, num_q, width = q.shape[0], q.shape[2], k.shape[2]
    device = q.device
    starts = key_starts.to(device=device, dtype=torch.long)
    _check_attention(q, k, v)
    if positions is None:
        if num_q == width and not bool(starts.any()):
            return _whole(q, k, v, scale)  # a training forward
        positions = torch.arange(width - num_q, width, device=device) - starts[:, None]
    positions = positions.to(device=device, dtype=torch.long).expand(batch, num_q)
    keys = _Keys(k, v, starts)
    if num_q == 1:  # a decode step
        return _decode(q, keys, positions[:, 0], scale)
    out = q.new_zeros(*q.shape[:3], v.shape[-1])
    blocks = torch.where(positions >= 0, positions // KEY_BLOCK, -1)
    for block in blocks.unique().tolist():
        if block >= 0:
            _attend_block(q, keys, positions, blocks, block, scale, out)
    return out


def _whole(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """`attention` of whole sequences, every entry a query at its position (a training
    forward): per key block, the `group` heads of a key head at its `KEY_BLOCK` positions make
    one product of `group * KEY_BLOCK` rows, sliced from q without gathers."""
    batch, heads, width, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    out = []
    for lo in range(0, width, KEY_BLOCK):
        span, hi = key_span(lo), min(lo + KEY_BLOCK, width)
        q_b = q[:, :, lo:hi]
        if hi - lo < KEY_BLOCK:  # the last block's positions past the end: zero queries
            q_b = F.pad(q_b, (0, 0, 0, KEY_BLOCK - (hi - lo)))
        k_b, v_b = k[:, :, :span], v[:, :, :span]
        if span > width:  # keys past the end: masked for every query
            k_b, v_b = (F.pad(t, (0, 0, 0, span - width)) for t in (k_b, v_b))
        at = torch.arange(lo, lo + KEY_BLOCK, device=q.device)
        masked = (torch.arange(span, device=q.device) > at[:, None]).repeat(group, 1)
        rows = q_b.reshape(batch, kv_heads, group * KEY_BLOCK, dim)
        ctx = _products(rows, k_b, v_b, masked, scale)
        out.append(ctx.view(batch, heads, KEY_BLOCK, -1)[:, :, : hi - lo])
    return torch.cat(out, 2)


class _Keys:
    """The keys and values of `attention`, read span by span."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor):
        self.k, self.v, self.starts = k, v, starts
        self.aligned = not bool(starts.any())  # keys at their positions: slices, not gathers

    def span(self, seqs: torch.Tensor | None, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [n, Hkv, span, D] of sequences `seqs` (None: all) at positions
        [0, span); past the cache's end, whatever finite value is at hand (masked)."""
        return self._span(self.k, seqs, span), self._span(self.v, seqs, span)

    def _span(self, x: torch.Tensor, seqs: torch.Tensor | None, span: int) -> torch.Tensor:
        batch, kv_heads, width, dim = x.shape
        if self.aligned:
            taken = x[:, :, :span] if seqs is None else x[seqs, :, :span]
            if span > width:
                taken = torch.cat([taken, taken.new_zeros(*taken.shape[:2], span - width, dim)], 2)
            return taken
        # One gather of whole rows: row (b, h, start_b + p) of the flattened cache.
        if seqs is None:
            seqs = torch.arange(batch, device=x.device)
        at = (self.starts[seqs, None] + torch.arange(span, device=x.device)).clamp(max=width - 1)
        heads = torch.arange(kv_heads, device=x.device)
        rows = (seqs[:, None, None] * kv_heads + heads[:, None]) * width + at[:, None]
        return (
            x.reshape(-1, dim).index_select(0, rows.view(-1)).view(len(seqs), kv_heads, span, dim)
        )


def _decode(q: torch.Tensor, keys: _Keys, positions: torch.Tensor, scale: float) -> torch.Tensor:
    """`attention` of one query per sequence [B, H, 1, D]: the `group` heads that share a key
    head fill tiles of `ROW_TILE` rows, the last one zero-padded."""
    batch, heads, _, dim = q.shape
    kv_heads = keys.k.shape[1]
    group = heads // kv_heads
    tile_rows = -(-group // ROW_TILE) * ROW_TILE
    out = q.new_zeros(batch, heads, 1, keys.v.shape[-1])
    blocks = torch.where(positions >= 0, positions // KEY_BLOCK, -1)
    present = blocks.unique().tolist()
    for block in present:
        if block < 0:
            continue
        span = key_span(block * KEY_BLOCK)
        seqs = None if len(present) == 1 else (blocks == block).nonzero().squeeze(1)
        k_b, v_b = keys.span(seqs, span)
        rows = q[:, :, 0] if seqs is None else q[seqs, :, 0]  # [n, H, D]
        n = rows.shape[0]
        q_t = q.new_zeros(n, kv_heads, tile_rows, dim)
        q_t[:, :, :group] = rows.view(n, kv_heads, group, dim)
        pos = positions if seqs is None else positions[seqs]
        masked = torch.arange(span, device=q.device) > pos[:, None]  # [n, span]
        ctx = _products(q_t, k_b, v_b, masked[:, None, None, :], scale)  # [n, Hkv, tile_rows, Dv]
        ctx = ctx[:, :, :group].reshape(n, heads, 1, -1)
        if seqs is None:
            out = ctx
        else:
            out[seqs] = ctx
    return out


def _attend_block(
    q: torch.Tensor,
    keys: _Keys,
    positions: torch.Tensor,
    blocks: torch.Tensor,
    block: int,
    scale: float,
    out: torch.Tensor,
) -> None:
    """`attention` of the queries in key block `block`, written into `out`: laid out as
    `_whole` lays out a block (the `group` heads of a key head at the block's `KEY_BLOCK`
    positions, one product of `group * KEY_BLOCK` rows), the positions no query holds zero."""
    heads, dim = q.shape[1], q.shape[3]
    kv_heads = keys.k.shape[1]
    group, device = heads // kv_heads, q.device
    span = key_span(block * KEY_BLOCK)
    rows_b, rows_q = (blocks == block).nonzero(as_tuple=True)  # this block's queries
    seqs, seq_of = rows_b.unique(return_inverse=True)
    k_b, v_b = keys.span(None if len(seqs) == q.shape[0] else seqs, span)
    pos = positions[rows_b, rows_q]
    picked = q[rows_b, :, rows_q]  # [n, H, D]
    where = torch.arange(group, device=device) * KEY_BLOCK + (pos - block * KEY_BLOCK)[:, None]
    q_t = q.new_zeros(len(seqs), kv_heads, group * KEY_BLOCK, dim)
    pos_t = positions.new_full((len(seqs), kv_heads, group * KEY_BLOCK), span)
    q_t[seq_of[:, None], :, where] = picked.view(-1, kv_heads, group, dim).transpose(1, 2)
    pos_t[seq_of[:, None], :, where] = pos[:, None, None]
    masked = torch.arange(span, device=device) > pos_t[..., None]
    ctx = _products(q_t, k_b, v_b, masked, scale)  # [n, Hkv, group * KEY_BLOCK, Dv]
    back = ctx[seq_of[:, None], :, where]  # [n, group, Hkv, Dv]
    out[rows_b, :, rows_q] = back.transpose(1, 2).reshape(len(rows_b), heads, -1)


def _products(
    rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: torch.Tensor, scale: float
) -> torch.Tensor:
    """Softmax attention of query rows [n, Hkv, R, D] (R a multiple of `ROW_TILE`) over the
    keys and values [n, Hkv, span, D] of their sequence, one product per key head; `masked`
    (broadcast to [n, Hkv, R, span]) marks the keys a row does not see."""
    scores = torch.matmul(rows, k.transpose(2, 3)).float() * scale
    weights = scores.masked_fill_(masked, float("-inf")).softmax(-1).to(rows.dtype)
    return torch.matmul(weights, v)


_ATTENTION_CHECKED: set[tuple] = set()


def _check_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Once per head layout, dtype and device: check that a decode step gives each query the
    bits the forward of its whole sequence gives it. The two multiply by the same key spans, but
    with other numbers of query rows (a decode step's padded group of heads, a forward's
    `group * KEY_BLOCK` rows), which the GEMM's row-invariance from `ROW_TILE` rows on makes
    equal (as `check_linear` checks for the linear layers).

    Raises:
        ExactModeError: A position whose decode step differs, named.
    """
    heads, kv_heads, dim, dim_v = q.shape[1], k.shape[1], q.shape[3], v.shape[3]
    key = (heads, kv_heads, dim, dim_v, q.dtype, q.device)
    if key in _ATTENTION_CHECKED:
        return
    _ATTENTION_CHECKED.add(key)  # the check's own calls below skip it
    try:
        _check_decode_against_forward(heads, kv_heads, dim, dim_v, q.dtype, q.device)
    except ExactModeError:
        _ATTENTION_CHECKED.discard(key)  # refused again at the next call
        raise


def _check_decode_against_forward(
    heads: int, kv_heads: int, dim: int, dim_v: int, dtype: torch.dtype, device: torch.device
) -> None:
    """Two sequences of eight key blocks: the forward over views in megatron-core's layout
    ([s, b, h, d] permuted), decode steps over keys at their positions in a longer buffer (the
    engine's `PositionCache`), the two rows at mirrored positions (in one block or in two)."""
    generator = torch.Generator().manual_seed(0)
    width = 8 * KEY_BLOCK
    zeros = torch.zeros(2, dtype=torch.long, device=device)

    def draw(num_heads: int, head_dim: int) -> torch.Tensor:
        drawn = torch.randn(width, 2, num_heads, head_dim, generator=generator)
        return drawn.to(dtype=dtype, device=device).permute(1, 2, 0, 3)

    q_r, k_r, v_r = draw(heads, dim), draw(kv_heads, dim), draw(kv_heads, dim_v)
    k_c = k_r.new_zeros(2, kv_heads, width + KEY_BLOCK, dim)
    v_c = v_r.new_zeros(2, kv_heads, width + KEY_BLOCK, dim_v)
    k_c[:, :, :width], v_c[:, :, :width] = k_r, v_r
    ends = [p for lo in range(0, width, KEY_BLOCK) for p in (lo, lo + KEY_BLOCK - 1)]
    with torch.no_grad():
        full = attention(q_r, k_r, v_r, key_starts=zeros, scale=dim**-0.5)
        for p in sorted({*range(2 * KEY_BLOCK + 1), *ends}):
            at = [p, width - 1 - p]
            span = key_span(max(at))
            step = attention(
                torch.stack([q_r[0, :, at[0]], q_r[1, :, at[1]]])[:, :, None],
                k_c[:, :, :span],
                v_c[:, :, :span],
                key_starts=zeros,
                scale=dim**-0.5,
                positions=torch.tensor(at, device=device)[:, None],
            )
            for row, position in enumerate(at):
                if not torch.equal(step[row, :, 0], full[row, :, position]):
                    raise ExactModeError(
                        f"rollout.true_on_policy: on this machine a decode step's attention at "
                        f"position {position} ({heads} heads over {kv_heads} key heads of {dim}, "
                        f"{dtype} on {device}) is not the bits of the whole sequence's forward; "
                        "its batched matrix products are not row-invariant"
                    )


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
    inputs: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Routed SwiGLU experts, summed per token in ascending expert order (differentiable).

    Args:
        x: Tokens [T, H].
        ids: Each token's experts [T, k] (any order).
        weights: Their weights [T, k]; cast to x's dtype before they multiply.
        gate_up: Per expert, the [2F, H] weight of its gate (first F rows) and up projections.
        down: Per expert, the [H, F] weight of its down projection.
        cached: As `linear`'s.
        inputs: Applied to each product's input, row by row (`engine.quantization`'s FP8
            activations, `ember_core.quant.fake_quantize_activation`); None: none.
    """
    out = torch.zeros_like(x)
    feed = inputs or (lambda rows: rows)
    for expert in ids.unique().tolist():
        tokens, slots = (ids == expert).nonzero(as_tuple=True)
        gate, up = linear(feed(x[tokens]), gate_up[expert], cached=cached).chunk(2, dim=-1)
        y = linear(feed(F.silu(gate) * up), down[expert], cached=cached)
        out = out.index_add(0, tokens, y * weights[tokens, slots, None].to(y.dtype))
    return out
