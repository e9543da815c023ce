"""Temperature / top-k / top-p filtering and seeded sampling, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from ember_rollout.token_sampling import filtered_log_probs, sample_tokens

# probs 0.4, 0.3, 0.2, 0.1 at temperature 1 (tokens in a shuffled order)
LOGITS = torch.log(torch.tensor([[0.2, 0.4, 0.1, 0.3]]))


def kept(log_probs):
    return [i for i, v in enumerate(log_probs[0].tolist()) if v != float("-inf")]


def test_no_filter_is_log_softmax_of_scaled_logits():
    out = filtered_log_probs(LOGITS, 0.5)
    expected = torch.log_softmax(LOGITS / 0.5, dim=-1)
    assert torch.allclose(out, expected)
    # Hand check: temperature 0.5 squares the probabilities before renormalising.
    assert out[0, 1].item() == pytest.approx(math.log(0.16 / 0.30))


def test_top_k_keeps_k_most_likely_and_renormalises():
    out = filtered_log_probs(LOGITS, 1.0, top_k=2)
    assert kept(out) == [1, 3]
    assert out[0, 1].item() == pytest.approx(math.log(0.4 / 0.7))
    assert out[0, 3].item() == pytest.approx(math.log(0.3 / 0.7))


def test_top_p_keeps_smallest_set_reaching_p():
    # mass before each token in rank order: 0, 0.4, 0.7, 0.9
    assert kept(filtered_log_probs(LOGITS, 1.0, top_p=0.39)) == [1]
    assert kept(filtered_log_probs(LOGITS, 1.0, top_p=0.41)) == [1, 3]
    assert kept(filtered_log_probs(LOGITS, 1.0, top_p=0.75)) == [0, 1, 3]
    out = filtered_log_probs(LOGITS, 1.0, top_p=0.75)
    assert out[0, 0].item() == pytest.approx(math.log(0.2 / 0.9))
    # The most likely token survives any top_p.
    assert kept(filtered_log_probs(LOGITS, 1.0, top_p=1e-6)) == [1]


def test_top_k_and_top_p_intersect_and_apply_per_row():
    rows = LOGITS.repeat(3, 1)
    out = filtered_log_probs(
        rows,
        torch.tensor([1.0, 1.0, 1.0]),
        top_k=torch.tensor([3, -1, 1]),
        top_p=torch.tensor([0.5, 0.75, 1.0]),
    )
    assert [kept(out[i : i + 1]) for i in range(3)] == [[1, 3], [0, 1, 3], [1]]
    assert torch.allclose(out.exp().sum(-1), torch.ones(3))


def test_top_k_ties_broken_by_token_id():
    out = filtered_log_probs(torch.zeros(1, 5), 1.0, top_k=2)
    assert kept(out) == [0, 1]


def test_sampling_reproducible_per_generator_and_never_picks_removed_tokens():
    log_probs = filtered_log_probs(LOGITS.repeat(2, 1), 1.0, top_k=2)
    gens = [torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)]
    draws = torch.stack([sample_tokens(log_probs, gens) for _ in range(400)])
    assert set(draws.flatten().tolist()) <= {1, 3}
    again_gens = [torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)]
    again = torch.stack([sample_tokens(log_probs, again_gens) for _ in range(400)])
    assert torch.equal(draws, again)
    # Frequencies follow the renormalised distribution (0.571 for token 1); 800 draws.
    share = (draws == 1).float().mean().item()
    assert abs(share - 4 / 7) < 0.06


def test_sample_tokens_needs_one_generator_per_row():
    with pytest.raises(ValueError, match="1 generators for 2 rows"):
        sample_tokens(torch.zeros(2, 3), [torch.Generator()])
