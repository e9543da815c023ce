"""Sample validation and packing into a thd stream."""

from __future__ import annotations

import math

import pytest
import torch

from ember_core.types import Sample, SampleStatus, pack_samples


def make(tokens, response_length, **kw):
    return Sample(tokens=list(tokens), response_length=response_length, **kw)


def test_pack_concatenates_samples_with_offsets_and_masks():
    a = make([5, 6, 7, 8], 2, loss_mask=[1, 0])
    b = make([9, 10, 11], 1)
    batch = pack_samples([a, b])
    assert batch.tokens.tolist() == [5, 6, 7, 8, 9, 10, 11]
    assert batch.cu_seqlens.tolist() == [0, 4, 7]
    assert batch.cu_seqlens.dtype == torch.int32
    assert batch.total_lengths == [4, 3] and batch.response_lengths == [2, 1]
    assert [m.tolist() for m in batch.loss_masks] == [[1.0, 0.0], [1.0]]
    assert batch.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert batch.num_tokens == batch.padded_length == 7
    assert batch.num_samples == 2


def test_pack_pads_the_stream_end_as_its_own_segment():
    batch = pack_samples([make([1, 2, 3], 1), make([4, 5], 1)], pad_multiple=4, pad_token_id=99)
    assert batch.tokens.tolist() == [1, 2, 3, 4, 5, 99, 99, 99]
    assert batch.cu_seqlens.tolist() == [0, 3, 5, 8]
    assert batch.position_ids.tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    assert batch.num_tokens == 5 and batch.padded_length == 8
    assert batch.total_lengths == [3, 2]


def test_pack_exact_multiple_adds_no_padding():
    batch = pack_samples([make([1, 2, 3, 4], 2)], pad_multiple=4)
    assert batch.cu_seqlens.tolist() == [0, 4]


def test_sample_defaults():
    s = make([1, 2, 3], 2)
    assert s.status is SampleStatus.PENDING
    assert s.prompt_length == 1 and s.total_length == 3
    assert s.effective_loss_mask() == [1, 1]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tokens": [1, 2], "response_length": 2}, r"sample 3 .*response_length=2"),
        ({"tokens": [1, 2], "response_length": 0}, r"response_length=0"),
        ({"tokens": [1, 2, 3], "response_length": 1, "loss_mask": [1, 1]}, r"loss_mask has 2"),
        ({"tokens": [1, 2, 3], "response_length": 1, "loss_mask": [2]}, r"loss_mask entries"),
        (
            {"tokens": [1, 2, 3], "response_length": 2, "rollout_log_probs": [0.0]},
            r"rollout_log_probs has 1 entries, expected response_length=2",
        ),
        ({"tokens": [1, 2, 3], "response_length": 1, "reward": math.nan}, r"reward=nan"),
        (
            {
                "tokens": [1, 2, 3],
                "response_length": 1,
                "rollout_routed_experts": torch.zeros(3, 2, 2, dtype=torch.int32),
            },
            r"shape \(3, 2, 2\), expected \[len\(tokens\) - 1 = 2",
        ),
        (
            {
                "tokens": [1, 2, 3],
                "response_length": 1,
                "rollout_routed_experts": torch.zeros(2, 2, 2),
            },
            r"integer expert ids",
        ),
    ],
)
def test_bad_samples_name_the_sample_and_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Sample(index=3, **kwargs)


def test_pack_rejects_empty_and_bad_multiple():
    with pytest.raises(ValueError, match="samples is empty"):
        pack_samples([])
    with pytest.raises(ValueError, match="pad_multiple=0"):
        pack_samples([make([1, 2], 1)], pad_multiple=0)


def test_pack_revalidates_samples_mutated_after_creation():
    s = make([1, 2, 3], 1)
    s.reward = float("inf")
    with pytest.raises(ValueError, match="reward=inf"):
        pack_samples([s])
