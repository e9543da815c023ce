"""Tests for ember_core.heads: response slicing, chunked log-probs/entropy, CP, value head."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ember_core.heads import (
    HeadOutput,
    PolicyHead,
    RowSpan,
    ValueHead,
    assemble_cp,
    cp_padded_length,
    response_spans,
    select_response_rows,
    zigzag_split,
)

# Several samples, prompts and responses of different lengths (some not a multiple of 2 * cp).
TOTAL = [9, 14, 5, 11, 7]
RESPONSE = [4, 10, 1, 3, 6]
T = sum(TOTAL)
V = 37


def make_batch(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(T, V, generator=gen, dtype=torch.float64) * 3).to(dtype)
    tokens = torch.randint(0, V, (T,), generator=gen)
    return logits, tokens


def naive(logits, tokens, temperature):
    """Independent reference: full fp32 log_softmax of the scaled logits, then gathers."""
    log_p = torch.log_softmax(logits.float() / temperature, dim=-1)
    log_probs, entropy = [], []
    start = 0
    for length, resp in zip(TOTAL, RESPONSE, strict=True):
        rows = torch.arange(start + length - resp - 1, start + length - 1)
        log_probs.append(log_p[rows, tokens[rows + 1]])
        entropy.append(-(log_p[rows].exp() * log_p[rows]).sum(-1))
        start += length
    return log_probs, entropy


def weighted_loss(log_probs, entropy, seed=1):
    gen = torch.Generator().manual_seed(seed)
    loss = 0.0
    for lp, h in zip(log_probs, entropy, strict=True):
        loss = loss + (lp * torch.randn(lp.shape, generator=gen)).sum()
        loss = loss + (h * torch.randn(h.shape, generator=gen)).sum()
    return loss


def assert_close(actual, expected, rtol, atol):
    # torch.allclose, not torch.testing.assert_close: the latter's first call imports
    # torch.distributed and costs seconds.
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    diff = (actual.double() - expected.double()).abs()
    bound = atol + rtol * expected.double().abs()
    assert bool((diff <= bound).all()), f"max abs diff {diff.max().item():.3g}"


def assert_lists_close(actual, expected, rtol=1e-5, atol=1e-5):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        assert a.dtype == torch.float32
        assert_close(a, e, rtol, atol)


# --- response slicing ------------------------------------------------------------------------


def test_response_spans_by_hand():
    # Sample 0 spans [0, 5), response = tokens 3, 4 -> rows 2, 3. Sample 1 spans [5, 9),
    # response = tokens 6, 7, 8 -> rows 5, 6, 7.
    assert response_spans([5, 4], [2, 3]) == [[RowSpan(0, 2, 4, 0)], [RowSpan(1, 5, 8, 0)]]


def test_select_response_rows_accepts_batch_dim():
    rows = torch.arange(9.0).reshape(1, 9, 1)
    selected = select_response_rows(rows, [5, 4], [2, 3])
    assert selected.positions is None
    assert [r.flatten().tolist() for r in selected.rows] == [[2.0, 3.0], [5.0, 6.0, 7.0]]


def test_zigzag_split_by_hand():
    x = torch.arange(1, 9)  # one sample of 8 tokens, cp=2: chunks [1,2] [3,4] [5,6] [7,8]
    assert zigzag_split(x, [8], 2, 0).tolist() == [1, 2, 7, 8]
    assert zigzag_split(x, [8], 2, 1).tolist() == [3, 4, 5, 6]
    # Lengths 6 and 3 pad to 8 and 4 (zeros at the end of each sample).
    y = torch.arange(1, 10)
    assert cp_padded_length(6, 2) == 8 and cp_padded_length(3, 2) == 4
    assert zigzag_split(y, [6, 3], 2, 0).tolist() == [1, 2, 0, 0, 7, 0]
    assert zigzag_split(y, [6, 3], 2, 1).tolist() == [3, 4, 5, 6, 8, 9]
    assert zigzag_split(y, [6, 3], 1, 0) is y


def test_response_spans_cp_by_hand():
    # L=8, R=5, cp=2: window rows 2..6, chunks of 2. Rank 0 holds rows 0,1 | 6,7 -> local rows
    # 2 (row 6, response position 4). Rank 1 holds rows 2,3 | 4,5 -> positions 0..3.
    assert response_spans([8], [5], cp_rank=0, cp_size=2) == [[RowSpan(0, 2, 3, 4)]]
    assert response_spans([8], [5], cp_rank=1, cp_size=2) == [
        [RowSpan(0, 0, 2, 0), RowSpan(0, 2, 4, 2)]
    ]


# --- PolicyHead against the naive reference ---------------------------------------------------


@pytest.mark.parametrize("chunk_bytes", [1, 8 * 4 * V * 3, 1 << 30])  # 1 row, 3 rows, all rows
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_log_probs_and_entropy_match_naive_fp32(chunk_bytes, temperature):
    logits, tokens = make_batch()
    out = PolicyHead(temperature, chunk_bytes=chunk_bytes).log_probs(
        logits, tokens, TOTAL, RESPONSE, with_entropy=True
    )
    ref_lp, ref_h = naive(logits, tokens, temperature)
    assert [x.shape[0] for x in out.log_probs] == RESPONSE
    assert_lists_close(out.log_probs, ref_lp, rtol=1e-5, atol=1e-5)
    assert_lists_close(out.entropy, ref_h, rtol=1e-5, atol=1e-5)
    assert out.positions is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_logits_match_naive_on_the_same_values(dtype):
    logits, tokens = make_batch(dtype)
    out = PolicyHead(0.8, chunk_bytes=8 * 4 * V * 4).log_probs(
        logits.unsqueeze(0), tokens, TOTAL, RESPONSE, True
    )
    ref_lp, ref_h = naive(logits, tokens, 0.8)  # naive upcasts the same values to fp32
    assert_lists_close(out.log_probs, ref_lp, rtol=1e-5, atol=1e-5)
    assert_lists_close(out.entropy, ref_h, rtol=1e-5, atol=1e-5)


def test_without_entropy():
    logits, tokens = make_batch()
    out = PolicyHead(0.9).log_probs(logits, tokens, TOTAL, RESPONSE)
    assert isinstance(out, HeadOutput) and out.entropy is None
    assert_lists_close(out.log_probs, naive(logits, tokens, 0.9)[0], rtol=1e-5, atol=1e-5)


def test_temperature_is_applied():
    logits, tokens = make_batch()
    out = PolicyHead(0.5).log_probs(logits, tokens, TOTAL, RESPONSE, with_entropy=True)
    at_one_lp, at_one_h = naive(logits, tokens, 1.0)
    gap_lp = (torch.cat(out.log_probs) - torch.cat(at_one_lp)).abs().max()
    gap_h = (torch.cat(out.entropy) - torch.cat(at_one_h)).abs().max()
    assert gap_lp > 0.5 and gap_h > 0.1
    ref_lp, ref_h = naive(logits, tokens, 0.5)
    assert_lists_close(out.log_probs, ref_lp, rtol=1e-5, atol=1e-5)
    assert_lists_close(out.entropy, ref_h, rtol=1e-5, atol=1e-5)


def test_padded_vocab_view_of_logits():
    # Logits sliced out of a wider (padded-vocab) tensor are a non-contiguous view.
    logits, tokens = make_batch()
    wide = torch.cat([logits, torch.full((T, 5), 50.0)], dim=1)
    out = PolicyHead(1.3, chunk_bytes=1).log_probs(wide[:, :V], tokens, TOTAL, RESPONSE, True)
    ref_lp, ref_h = naive(logits, tokens, 1.3)
    assert_lists_close(out.log_probs, ref_lp, rtol=1e-5, atol=1e-5)
    assert_lists_close(out.entropy, ref_h, rtol=1e-5, atol=1e-5)


# --- gradients -------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_bytes", [1, 8 * 4 * V * 5, 1 << 30])
@pytest.mark.parametrize("terms", ["both", "log_probs", "entropy"])
def test_gradients_match_autograd_through_naive(chunk_bytes, terms):
    logits, tokens = make_batch()
    temperature = 0.7

    def loss_of(log_probs, entropy):
        zero = [x * 0 for x in log_probs]
        if terms == "log_probs":
            return weighted_loss(log_probs, zero)
        if terms == "entropy":
            return weighted_loss(zero, entropy)
        return weighted_loss(log_probs, entropy)

    x = logits.clone().unsqueeze(0).requires_grad_()
    out = PolicyHead(temperature, chunk_bytes=chunk_bytes).log_probs(
        x, tokens, TOTAL, RESPONSE, with_entropy=True
    )
    loss_of(out.log_probs, out.entropy).backward()

    x_ref = logits.clone().requires_grad_()
    loss_of(*naive(x_ref, tokens, temperature)).backward()

    assert x.grad.shape == (1, T, V)
    assert_close(x.grad[0], x_ref.grad, rtol=1e-5, atol=1e-6)
    assert x_ref.grad.abs().sum() > 1.0  # the check is not vacuous


@pytest.mark.parametrize("long_response", [False, True])
def test_short_and_long_spans_take_their_paths_and_agree_with_autograd(long_response):
    """Chunks of many short responses are gathered by one row index, chunks of long spans read
    slice by slice (heads._GATHER_BELOW); both give the naive head's values and gradients."""
    from ember_core import heads

    response = [2, 3, 1, 2] if not long_response else [40, 45]
    total = [r + 3 for r in response]
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(sum(total), 11, generator=gen, dtype=torch.float64).float()
    tokens = torch.randint(0, 11, (sum(total),), generator=gen)
    taken = []
    real = heads._row_index

    def spy(pieces, device):
        index = real(pieces, device)
        taken.append(index is not None)
        return index

    heads._row_index = spy
    try:
        x = logits.clone().requires_grad_()
        out = PolicyHead(0.9).log_probs(x, tokens, total, response, with_entropy=True)
        weighted_loss(out.log_probs, out.entropy).backward()
    finally:
        heads._row_index = real
    assert taken == [not long_response]  # the one chunk, planned once for forward and backward
    x_ref = logits.double().requires_grad_()
    ref_lp, ref_h, start = [], [], 0
    ref_log_p = torch.log_softmax(x_ref / 0.9, dim=-1)
    for length, resp in zip(total, response, strict=True):
        rows = torch.arange(start + length - resp - 1, start + length - 1)
        ref_lp.append(ref_log_p[rows, tokens[rows + 1]])
        ref_h.append(-(ref_log_p[rows].exp() * ref_log_p[rows]).sum(-1))
        start += length
    weighted_loss(ref_lp, ref_h).backward()
    for got, want in zip(out.log_probs, ref_lp, strict=True):
        assert_close(got, want.float().detach(), rtol=1e-5, atol=1e-5)
    assert_close(x.grad, x_ref.grad.float(), rtol=1e-4, atol=1e-6)


def test_gradient_of_log_probs_only_head_output():
    logits, tokens = make_batch()
    x = logits.clone().requires_grad_()
    out = PolicyHead(1.2, chunk_bytes=1).log_probs(x, tokens, TOTAL, RESPONSE)
    sum(lp.sum() for lp in out.log_probs).backward()
    x_ref = logits.clone().requires_grad_()
    sum(lp.sum() for lp in naive(x_ref, tokens, 1.2)[0]).backward()
    assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)


def test_bf16_gradient_matches_fp32_reference_rounded():
    logits, tokens = make_batch(torch.bfloat16)
    x = logits.clone().requires_grad_()
    out = PolicyHead(0.7, chunk_bytes=1).log_probs(x, tokens, TOTAL, RESPONSE, True)
    weighted_loss(out.log_probs, out.entropy).backward()
    x_ref = logits.float().requires_grad_()
    weighted_loss(*naive(x_ref, tokens, 0.7)).backward()
    assert x.grad.dtype == torch.bfloat16
    assert_close(x.grad, x_ref.grad.bfloat16(), rtol=1e-2, atol=1e-5)


class _AllocationLog(TorchDispatchMode):
    """Records the shape and dtype of every op output that is a new tensor (not an alias)."""

    def __init__(self):
        super().__init__()
        self.allocations = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(result)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.allocations.append((func, t.numel(), t.dtype))
        return result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_full_size_temporary_in_forward_or_backward(dtype):
    logits, tokens = make_batch(dtype)
    chunk_rows = 4
    x = logits.clone().unsqueeze(0).requires_grad_()
    head = PolicyHead(0.7, chunk_bytes=chunk_rows * 2 * 4 * V)
    with _AllocationLog() as forward:
        out = head.log_probs(x, tokens, TOTAL, RESPONSE, with_entropy=True)
        loss = weighted_loss(out.log_probs, out.entropy)
    with _AllocationLog() as backward:
        loss.backward()
    assert max(n for _, n, _ in forward.allocations) <= chunk_rows * V
    big = [(f, n, d) for f, n, d in backward.allocations if n > chunk_rows * V]
    # The only full-size tensor in backward is the gradient itself, in the logits' dtype.
    assert [(n, d) for _, n, d in big] == [(T * V, dtype)], big
    assert x.grad.shape == (1, T, V)


# --- context parallelism ---------------------------------------------------------------------


@pytest.mark.parametrize("cp_size", [2, 4])
def test_cp_zigzag_reassembles_to_the_cp1_result(cp_size):
    logits, tokens = make_batch(seed=3)
    head = PolicyHead(0.8, chunk_bytes=8 * 4 * V * 3)
    full = head.log_probs(logits, tokens, TOTAL, RESPONSE, with_entropy=True)

    locals_, outputs = [], []
    for rank in range(cp_size):
        local = zigzag_split(logits, TOTAL, cp_size, rank).requires_grad_()
        expected_rows = sum(cp_padded_length(n, cp_size) for n in TOTAL) // cp_size
        assert local.shape == (expected_rows, V)
        out = head.log_probs(
            local, tokens, TOTAL, RESPONSE, with_entropy=True, cp_rank=rank, cp_size=cp_size
        )
        locals_.append(local)
        outputs.append(out)
    # A rank can hold no response row of a sample (sample 2 has one response row).
    assert any(o.log_probs[2].numel() == 0 for o in outputs)
    positions = [o.positions for o in outputs]
    log_probs = assemble_cp([o.log_probs for o in outputs], positions, RESPONSE)
    entropy = assemble_cp([o.entropy for o in outputs], positions, RESPONSE)
    for got, want in zip(log_probs + entropy, full.log_probs + full.entropy, strict=True):
        assert torch.equal(got, want)  # row by row the same arithmetic: bitwise equal

    # Gradients flow back to each rank's local logits as the zigzag split of the full gradient.
    weighted_loss(log_probs, entropy).backward()
    x = logits.clone().requires_grad_()
    full = head.log_probs(x, tokens, TOTAL, RESPONSE, with_entropy=True)
    weighted_loss(full.log_probs, full.entropy).backward()
    for rank, local in enumerate(locals_):
        want = zigzag_split(x.grad, TOTAL, cp_size, rank)
        assert_close(local.grad, want, rtol=1e-5, atol=1e-6)


def test_assemble_cp_rejects_missing_positions():
    pieces = [[torch.ones(2)], [torch.ones(1)]]
    positions = [[torch.tensor([0, 1])], [torch.tensor([1])]]
    with pytest.raises(ValueError, match=r"response_lengths\[0\]=3"):
        assemble_cp(pieces, positions, [3])


# --- ValueHead -------------------------------------------------------------------------------


def test_value_head_regression_no_temperature():
    values = ValueHead().values(torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 4, 1), [4], [2])
    assert len(values) == 1
    assert_close(values[0], torch.tensor([2.0, 3.0]), rtol=0, atol=0)


def test_value_head_has_no_temperature():
    assert "temperature" not in inspect.signature(ValueHead).parameters
    assert not hasattr(ValueHead(), "temperature")
    with pytest.raises(TypeError):
        ValueHead(temperature=0.5)


@pytest.mark.parametrize("shape", [(1, T, 1), (T, 1), (T,)])
def test_value_head_shapes_use_the_policy_rows(shape):
    outputs = torch.arange(T, dtype=torch.float32).reshape(shape)
    values = ValueHead().values(outputs, TOTAL, RESPONSE)
    start = 0
    for length, resp, v in zip(TOTAL, RESPONSE, values, strict=True):
        assert v.tolist() == list(range(start + length - resp - 1, start + length - 1))
        start += length


def test_value_head_cp_reassembles():
    outputs = torch.randn(T, 1)
    full = ValueHead().values(outputs, TOTAL, RESPONSE)
    parts = [
        ValueHead().local_values(
            zigzag_split(outputs, TOTAL, 4, rank), TOTAL, RESPONSE, cp_rank=rank, cp_size=4
        )
        for rank in range(4)
    ]
    merged = assemble_cp([p.rows for p in parts], [p.positions for p in parts], RESPONSE)
    for got, want in zip(merged, full, strict=True):
        assert torch.equal(got, want)


# --- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, math.nan, math.inf, -math.inf])
def test_bad_temperature_raises(bad):
    with pytest.raises(ValueError, match=rf"temperature.*{bad!r}"):
        PolicyHead(bad)


def test_good_temperature_accepts_ints():
    assert PolicyHead(2).temperature == 2.0


@pytest.mark.parametrize(
    ("total", "response", "match"),
    [
        ([9, 14, 5, 11, 8], RESPONSE, r"total_lengths sum to 47.*T=46"),
        ([9, 14, 5, 11], RESPONSE, r"4 and 5 entries"),
        (TOTAL, [4, 14, 1, 3, 6], r"sample 1: response_lengths\[1\]=14.*total_lengths\[1\]=14"),
        (TOTAL, [4, 10, 0, 3, 6], r"sample 2: response_lengths\[2\]=0"),
    ],
)
def test_bad_lengths_raise(total, response, match):
    logits, tokens = make_batch()
    with pytest.raises(ValueError, match=match):
        PolicyHead(1.0).log_probs(logits, tokens, total, response)
    with pytest.raises(ValueError, match=match):
        ValueHead().values(torch.zeros(T, 1), total, response)


def test_bad_tokens_raise():
    logits, tokens = make_batch()
    with pytest.raises(ValueError, match=r"tokens has 45 entries.*46"):
        PolicyHead(1.0).log_probs(logits, tokens[:-1], TOTAL, RESPONSE)
    with pytest.raises(ValueError, match=r"tokens.*integer"):
        PolicyHead(1.0).log_probs(logits, tokens.float(), TOTAL, RESPONSE)
    too_big = tokens.clone()
    too_big[-1] = V
    with pytest.raises(ValueError, match=rf"V={V}"):
        PolicyHead(1.0).log_probs(logits, too_big, TOTAL, RESPONSE)


@pytest.mark.parametrize("shape", [(T * V,), (2, T, V), (1, 1, T, V)])
def test_bad_logits_rank_raises(shape):
    logits = torch.zeros(shape)
    tokens = torch.zeros(T, dtype=torch.long)
    with pytest.raises(ValueError, match=r"logits must be \[T, V\].*" + str(shape[0])):
        PolicyHead(1.0).log_probs(logits, tokens, TOTAL, RESPONSE)


def test_bad_value_outputs_and_cp_args_raise():
    with pytest.raises(ValueError, match=r"outputs must be.*\(1, 46, 2\)"):
        ValueHead().values(torch.zeros(1, T, 2), TOTAL, RESPONSE)
    with pytest.raises(ValueError, match=r"cp_rank.*cp_size=2.*2"):
        response_spans(TOTAL, RESPONSE, cp_rank=2, cp_size=2)
    with pytest.raises(ValueError, match=r"total_lengths sum to 46.*2-way"):
        PolicyHead(1.0).log_probs(torch.zeros(T, V), torch.zeros(T, dtype=torch.long),
                                  TOTAL, RESPONSE, cp_rank=0, cp_size=2)  # fmt: skip
