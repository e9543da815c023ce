"""The batch-invariant kernels of `rollout.true_on_policy`: a row's bits do not depend on its batch.

`ember_core.exact` promises that one token's numbers come out the same bits whether it is
computed alone (a decode step) or inside a large batch (the trainer's forward). These tests hold
each kernel to that promise against the same rows computed in a big batch, and also show that
the ordinary kernels on this machine do not keep it, which is what the padding and tiles are for.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from ember_core import exact
from ember_core.exact import ExactModeError, check_linear, key_span

DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(64, 96), (96, 256), (256, 512)]
"""[in, out] weight shapes; the last is large enough for the packed kernel."""


@pytest.fixture(autouse=True)
def _two_threads():
    """The thread count is one of the things a GEMM's blocking may read; fix it as runs do."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _randn(*shape: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(dtype)


# -- linear --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("n_in", "n_out"), SHAPES)
def test_linear_gives_every_row_the_same_bits_whatever_rows_come_with_it(dtype, n_in, n_out):
    g = torch.Generator().manual_seed(n_in * n_out)
    weight = _randn(n_out, n_in, dtype=dtype, generator=g)
    bias = _randn(n_out, dtype=dtype, generator=g)
    x = _randn(300, n_in, dtype=dtype, generator=g)
    full = exact.linear(x, weight, bias)
    assert full.shape == (300, n_out) and full.dtype == dtype
    for rows in range(1, 41):
        assert torch.equal(exact.linear(x[:rows], weight, bias), full[:rows]), rows
        # The same rows taken from anywhere in the batch, in another order.
        picked = torch.randperm(300, generator=g)[:rows]
        assert torch.equal(exact.linear(x[picked], weight, bias), full[picked]), rows


def test_linear_keeps_leading_dimensions_and_matches_f_linear_closely():
    g = torch.Generator().manual_seed(1)
    weight = _randn(96, 64, dtype=torch.float32, generator=g)
    x = _randn(2, 3, 64, dtype=torch.float32, generator=g)
    out = exact.linear(x, weight)
    assert out.shape == (2, 3, 96)
    # Same products, another summation order at most: fp32 rounding over 64 terms of size ~1.
    torch.testing.assert_close(out, F.linear(x, weight), rtol=0, atol=1e-5)


def test_plain_f_linear_on_a_few_rows_is_not_the_bits_of_the_big_batch():
    """The fact the padding to `ROW_TILE` rows is there for (fp32: the kernel's blocking and so
    the summation order follow the row count)."""
    differs = []
    for n_in, n_out in SHAPES:
        g = torch.Generator().manual_seed(n_in * n_out)
        weight = _randn(n_out, n_in, dtype=torch.float32, generator=g)
        x = _randn(300, n_in, dtype=torch.float32, generator=g)
        full = F.linear(x, weight)
        differs += [
            (n_in, n_out, rows)
            for rows in (1, 2, 3)
            if not torch.equal(F.linear(x[:rows], weight), full[:rows])
        ]
    if not differs:
        pytest.skip(
            "on this machine plain F.linear on 1-3 fp32 rows already gives the big batch's bits "
            "for these shapes; nothing to show"
        )
    assert differs


# -- rms_norm ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("x_dtype", "w_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),  # the trainer's fp32 weight, the engine's bf16 input
    ],
    ids=str,
)
def test_rms_norm_is_the_formula_with_the_weight_in_the_input_dtype(x_dtype, w_dtype):
    g = torch.Generator().manual_seed(2)
    x = (3 * torch.randn(5, 7, 48, generator=g)).to(x_dtype)
    weight = (1 + 0.3 * torch.randn(48, generator=g)).to(w_dtype)
    eps = 1e-6
    out = exact.rms_norm(x, weight, eps)
    assert out.dtype == x_dtype and out.shape == x.shape

    h = x.float()
    mean_square = (h * h).sum(-1, keepdim=True) / 48
    normed = (h * torch.rsqrt(mean_square + eps)).to(x_dtype)
    assert torch.equal(out, weight.to(x_dtype) * normed)

    # And the value it stands for, in float64: one rounding to the input dtype per step.
    h64 = x.double()
    expected = weight.double() * h64 / torch.sqrt(h64.pow(2).mean(-1, keepdim=True) + eps)
    tol = 1e-5 if x_dtype == torch.float32 else 3e-2  # 2 bf16 roundings of values ~1 (8 bits)
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


# -- attention -----------------------------------------------------------------------------------

BATCH, HEADS, KV_HEADS, LENGTH, DIM = 3, 6, 2, 150, 16


def _qkv(dtype: torch.dtype, *, dim_v: int = DIM, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    q = _randn(BATCH, HEADS, LENGTH, DIM, dtype=dtype, generator=g)
    k = _randn(BATCH, KV_HEADS, LENGTH, DIM, dtype=dtype, generator=g)
    v = _randn(BATCH, KV_HEADS, LENGTH, dim_v, dtype=dtype, generator=g)
    return q, k, v


def _full(q, k, v):
    """The training forward: whole sequences from entry 0, every position a query."""
    starts = torch.zeros(q.shape[0], dtype=torch.long)
    return exact.attention(q, k, v, key_starts=starts, scale=q.shape[-1] ** -0.5)


def _left_padded(k, v, positions, pad_extra, generator):
    """A decode cache: row b holds keys/values of positions [0, positions[b]] ending at the last
    entry, after left padding of random garbage (which must never be read)."""
    width = max(positions) + 1 + pad_extra
    k_c = torch.randn(k.shape[0], k.shape[1], width, k.shape[3], generator=generator).to(k.dtype)
    v_c = torch.randn(v.shape[0], v.shape[1], width, v.shape[3], generator=generator).to(v.dtype)
    starts = []
    for b, p in enumerate(positions):
        start = width - 1 - p
        k_c[b, :, start:] = k[b, :, : p + 1]
        v_c[b, :, start:] = v[b, :, : p + 1]
        starts.append(start)
    return k_c, v_c, torch.tensor(starts)


def _decodes(q, k, v, *, attend):
    """Every position of every row decoded once, rows at different positions and paddings in one
    call; returns pairs of (the call's output row, (b, position))."""
    g = torch.Generator().manual_seed(4)
    out = []
    for step in range(LENGTH):
        positions = [(step + 23 * b) % LENGTH for b in range(q.shape[0])]
        k_c, v_c, starts = _left_padded(k, v, positions, pad_extra=step % 5, generator=g)
        q_c = torch.stack([q[b, :, p] for b, p in enumerate(positions)])[:, :, None]
        dec = attend(q_c, k_c, v_c, starts)
        out += [(dec[b, :, 0], (b, p)) for b, p in enumerate(positions)]
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim_v", [DIM, 24], ids=["Dv=D", "Dv!=D"])
def test_a_decode_step_gives_the_full_forwards_bits_at_every_position(dtype, dim_v):
    q, k, v = _qkv(dtype, dim_v=dim_v)
    full = _full(q, k, v)
    assert full.shape == (BATCH, HEADS, LENGTH, dim_v) and full.dtype == dtype
    decoded = _decodes(
        q,
        k,
        v,
        attend=lambda q_c, k_c, v_c, starts: exact.attention(
            q_c, k_c, v_c, key_starts=starts, scale=DIM**-0.5
        ),
    )
    assert len({where for _, where in decoded}) == BATCH * LENGTH  # every position of every row
    for row, (b, p) in decoded:
        assert torch.equal(row, full[b, :, p]), (b, p)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_decode_step_with_more_heads_per_key_head_than_a_tile_gives_the_full_forwards_bits(
    dtype,
):
    """18 query heads share each key head: a decode step fills two tiles, the second padded."""
    g = torch.Generator().manual_seed(7)
    q = _randn(2, 36, 80, DIM, dtype=dtype, generator=g)
    k = _randn(2, 2, 80, DIM, dtype=dtype, generator=g)
    v = _randn(2, 2, 80, DIM, dtype=dtype, generator=g)
    full = _full(q, k, v)
    for position in (0, 40, 63, 64, 79):
        positions = torch.tensor([[position], [79 - position]])
        out = exact.attention(
            torch.stack([q[b, :, p] for b, p in enumerate(positions[:, 0].tolist())])[:, :, None],
            k,
            v,
            key_starts=torch.zeros(2, dtype=torch.long),
            scale=DIM**-0.5,
            positions=positions,
        )
        for b, p in enumerate(positions[:, 0].tolist()):
            assert torch.equal(out[b, :, 0], full[b, :, p]), (b, p)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ["one block", "blocks apart"])
def test_a_decode_step_over_keys_at_their_positions_gives_the_full_forwards_bits(dtype, rows):
    """The engine's `PositionCache`: row b's key of position p at index p of a buffer longer
    than any row (the rest finite garbage), key starts 0, each query's position given. Rows in
    one key block read one view of the buffer, rows in different blocks their own copies."""
    q, k, v = _qkv(dtype)
    full = _full(q, k, v)
    g = torch.Generator().manual_seed(6)
    capacity = LENGTH + exact.KEY_BLOCK
    seen = set()
    for step in range(LENGTH):
        if rows == "one block":  # different positions, one block
            base = step // exact.KEY_BLOCK * exact.KEY_BLOCK
            positions = [
                min(base + (step + 5 * b) % exact.KEY_BLOCK, LENGTH - 1) for b in range(BATCH)
            ]
        else:
            positions = [(step + 23 * b) % LENGTH for b in range(BATCH)]
        k_c = torch.randn(BATCH, KV_HEADS, capacity, DIM, generator=g).to(dtype)
        v_c = torch.randn(BATCH, KV_HEADS, capacity, DIM, generator=g).to(dtype)
        for b, p in enumerate(positions):
            k_c[b, :, : p + 1] = k[b, :, : p + 1]
            v_c[b, :, : p + 1] = v[b, :, : p + 1]
        q_c = torch.stack([q[b, :, p] for b, p in enumerate(positions)])[:, :, None]
        out = exact.attention(
            q_c,
            k_c,
            v_c,
            key_starts=torch.zeros(BATCH, dtype=torch.long),
            scale=DIM**-0.5,
            positions=torch.tensor(positions)[:, None],
        )
        for b, p in enumerate(positions):
            assert torch.equal(out[b, :, 0], full[b, :, p]), (b, p)
            seen.add((b, p))
    assert len(seen) > BATCH * LENGTH // 2


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim_v", [DIM, 24], ids=["Dv=D", "Dv!=D"])
def test_a_left_padded_prefill_gives_the_full_forwards_bits_and_zeros_at_padding(dtype, dim_v):
    q, k, v = _qkv(dtype, dim_v=dim_v)
    full = _full(q, k, v)
    lengths = [LENGTH, 101, 5]  # the full row, one ending mid key block, one shorter than a block
    width = LENGTH + 2
    g = torch.Generator().manual_seed(5)
    q_p = torch.randn(BATCH, HEADS, width, DIM, generator=g).to(dtype)
    k_p = torch.randn(BATCH, KV_HEADS, width, DIM, generator=g).to(dtype)
    v_p = torch.randn(BATCH, KV_HEADS, width, dim_v, generator=g).to(dtype)
    starts = torch.tensor([width - n for n in lengths])
    for b, n in enumerate(lengths):
        q_p[b, :, width - n :] = q[b, :, :n]
        k_p[b, :, width - n :] = k[b, :, :n]
        v_p[b, :, width - n :] = v[b, :, :n]
    out = exact.attention(q_p, k_p, v_p, key_starts=starts, scale=DIM**-0.5)
    assert out.shape == (BATCH, HEADS, width, dim_v)
    for b, n in enumerate(lengths):
        assert torch.equal(out[b, :, width - n :], full[b, :, :n]), b
        assert not out[b, :, : width - n].any(), b


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim_v", [DIM, 24], ids=["Dv=D", "Dv!=D"])
def test_attention_is_causal_attention_up_to_rounding(dtype, dim_v):
    q, k, v = _qkv(dtype, dim_v=dim_v)
    ours = _full(q, k, v)
    reference = F.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=True, enable_gqa=True
    )
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    # fp32: sums of <= 80 terms of size ~1 (2^-24 each); bf16: the weights and the output are
    # rounded to 8 bits (~4e-3 relative) on values of size ~1.
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(ours.double(), reference, rtol=tol, atol=tol)
    torch.testing.assert_close(ours, sdpa, rtol=tol, atol=tol)


def test_key_span_grows_in_whole_blocks_past_the_query():
    b = exact.KEY_BLOCK
    assert [key_span(p) for p in (0, b - 1, b, 2 * b - 1, 2 * b)] == [b, b, 2 * b, 2 * b, 3 * b]
    positions = torch.arange(200)
    spans = key_span(positions)
    assert bool((spans > positions).all()) and bool((spans % exact.KEY_BLOCK == 0).all())


def test_an_ordinary_sdpa_decode_is_not_the_full_forwards_bits():
    """What the tiles are for: SDPA's decode (one query against its keys) and its causal
    forward reduce differently, so their fp32 bits disagree somewhere."""
    q, k, v = _qkv(torch.float32)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def sdpa_decode(q_c, k_c, v_c, starts):
        rows = [
            F.scaled_dot_product_attention(
                q_c[b : b + 1], k_c[b : b + 1, :, s:], v_c[b : b + 1, :, s:], enable_gqa=True
            )
            for b, s in enumerate(starts.tolist())
        ]
        return torch.cat(rows)

    differ = [
        (b, p)
        for row, (b, p) in _decodes(q, k, v, attend=sdpa_decode)
        if not torch.equal(row, full[b, :, p])
    ]
    if not differ:
        pytest.skip(
            "on this machine SDPA's fp32 decode already gives its causal forward's bits at "
            "every position; nothing to show"
        )
    assert differ


# -- check_linear --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_check_linear_passes_on_this_machine(dtype):
    check_linear({(64, 96), (96, 256), (17, 33)}, dtype, torch.device("cpu"))


def test_check_linear_names_the_shape_when_the_kernel_is_not_batch_invariant(monkeypatch):
    def drifting(x, weight, bias=None):
        # Off by an amount that depends on how many rows came along: not batch-invariant.
        out = F.linear(x, weight, bias)
        return out + 1e-3 * x.reshape(-1, x.shape[-1]).shape[0]

    monkeypatch.setattr(exact, "linear", drifting)
    with pytest.raises(ExactModeError) as info:
        check_linear({(96, 256)}, torch.float32, torch.device("cpu"))
    message = str(info.value)
    assert "rollout.true_on_policy" in message
    assert "[256, 96]" in message and "torch.float32" in message, message


def test_attention_checks_once_per_head_layout_that_a_decode_step_is_the_forwards_bits(
    monkeypatch,
):
    """The first attention of a head layout checks decode steps against the whole sequence's
    forward: a decode that drifts by one ulp fails it, naming the position and the layout; a
    layout already checked is not checked again."""
    monkeypatch.setattr(exact, "_ATTENTION_CHECKED", set())
    q, k, v = _qkv(torch.float32)
    exact.attention(q, k, v, key_starts=torch.zeros(BATCH, dtype=torch.long), scale=0.25)
    assert exact._ATTENTION_CHECKED == {(HEADS, KV_HEADS, DIM, DIM, torch.float32, q.device)}

    decode = exact._decode

    def drifting(*args):
        out = decode(*args)
        return torch.nextafter(out, torch.full_like(out, float("inf")))

    monkeypatch.setattr(exact, "_decode", drifting)
    exact.attention(q, k, v, key_starts=torch.zeros(BATCH, dtype=torch.long), scale=0.25)
    monkeypatch.setattr(exact, "_ATTENTION_CHECKED", set())
    with pytest.raises(ExactModeError) as info:
        exact.attention(q, k, v, key_starts=torch.zeros(BATCH, dtype=torch.long), scale=0.25)
    message = str(info.value)
    assert "at position 0 (6 heads over 2 key heads of 16, torch.float32" in message, message


def test_the_exact_kernels_import_without_transformers_or_megatron():
    import subprocess

    code = (
        "import sys, ember_core.exact; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'megatron')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- packed weights -------------------------------------------------------------------------------


def test_the_packed_product_differentiates_as_f_linear():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, 256, generator=g, requires_grad=True)
    weight = torch.randn(512, 256, generator=g, requires_grad=True)  # packed
    bias = torch.randn(512, generator=g, requires_grad=True)
    upstream = torch.randn(40, 512, generator=g)
    grads = []
    for fn in (exact.linear, F.linear):
        out = fn(x, weight, bias)
        grads.append(torch.autograd.grad(out, (x, weight, bias), upstream))
    for ours, theirs in zip(*grads, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_a_packed_weight_is_packed_again_after_each_write():
    g = torch.Generator().manual_seed(6)
    weight = torch.randn(512, 256, generator=g)  # large enough to be packed
    assert weight.shape[1] >= exact.PACK_MIN_INPUTS
    x = torch.randn(20, 256, generator=g)
    first = exact.linear(x, weight)
    assert exact.packed_weight(weight) is exact.packed_weight(weight)  # kept while unchanged
    with torch.no_grad():
        weight.mul_(2)  # in place: the version counter moves
    torch.testing.assert_close(exact.linear(x, weight), 2 * first)
    weight.data = torch.randn(512, 256, generator=g)  # another storage
    assert torch.equal(exact.linear(x, weight), exact.linear(x, weight.clone()))
    view = torch.randn(4, 512, 256, generator=g)[1]  # a fused experts tensor's expert
    before = exact.linear(x, view)
    with torch.no_grad():
        view.add_(1)
    assert not torch.equal(exact.linear(x, view), before)
    # A write through `.data` escapes the counter: callers whose weights change that way pack
    # at every call, which sees it.
    weight.data.add_(1)
    assert torch.equal(exact.linear(x, weight, cached=False), exact.linear(x, weight.clone()))


def test_a_weight_made_in_inference_mode_is_packed_for_the_call():
    g = torch.Generator().manual_seed(7)
    base = torch.randn(512, 256, generator=g).bfloat16()
    x = torch.randn(20, 256, generator=g)
    with torch.inference_mode():  # the engine's decode: a router's fp32 copy of a bf16 weight
        out = exact.linear(x, base.float())
    assert torch.equal(out, exact.linear(x, base.float().clone()))


# -- routing and experts ------------------------------------------------------------------------


def test_softmax_routing_picks_the_top_k_and_weighs_them_renormalised_or_not():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.5], [3.0, 0.0, 0.5, 0.2]])
    ids = exact.route(logits, 2, score="softmax", norm_topk_prob=True)
    assert ids.tolist() == [[1, 3], [0, 2]]
    probs = logits.softmax(-1)
    weights = exact.route_weights(logits, ids, score="softmax", norm_topk_prob=False, scaling=1.0)
    assert torch.equal(weights, probs.gather(1, ids))
    normed = exact.route_weights(logits, ids, score="softmax", norm_topk_prob=True, scaling=1.0)
    torch.testing.assert_close(normed.sum(-1), torch.ones(2))


def test_sigmoid_routing_chooses_with_the_bias_among_the_best_groups_and_weighs_without_it():
    logits = torch.tensor([[2.0, 1.9, -3.0, 0.0, 1.0, -1.0, 0.5, 0.4]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0])
    # Groups of 2: without a limit expert 7 (biased) and expert 0 win.
    assert sorted(exact.route(logits, 2, score="sigmoid", norm_topk_prob=True, expert_bias=bias)
                  .tolist()[0]) == [0, 7]  # fmt: skip
    # One of four groups kept, each scored by its two best experts: {0, 1}.
    limited = exact.route(
        logits, 2, score="sigmoid", norm_topk_prob=True, num_groups=4, group_topk=1
    )
    assert sorted(limited.tolist()[0]) == [0, 1]
    ids = torch.tensor([[0, 7]])
    weights = exact.route_weights(logits, ids, score="sigmoid", norm_topk_prob=True, scaling=2.5)
    expected = logits.sigmoid().gather(1, ids)
    torch.testing.assert_close(weights, 2.5 * expected / (expected.sum() + 1e-20))


def test_experts_sum_each_tokens_experts_as_a_loop_over_them_would():
    g = torch.Generator().manual_seed(8)
    tokens, hidden, ffn, num = 21, 32, 24, 4
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.stack([torch.randperm(num, generator=g)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=g)
    gate_up = [torch.randn(2 * ffn, hidden, generator=g) for _ in range(num)]
    down = [torch.randn(hidden, ffn, generator=g) for _ in range(num)]
    out = exact.experts(x, ids, weights, gate_up, down)
    expected = torch.zeros_like(x)
    for t in range(tokens):
        for slot in range(2):
            e = int(ids[t, slot])
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            expected[t] += weights[t, slot] * (down[e] @ (F.silu(gate) * up))
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    # One token alone gets the bits it gets among all (its experts' products are padded).
    alone = exact.experts(x[5:6], ids[5:6], weights[5:6], gate_up, down)
    assert torch.equal(alone[0], out[5])
