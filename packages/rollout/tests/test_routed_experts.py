"""SGLang's routed-experts wire format: base64 of little-endian int32, row-major."""

from __future__ import annotations

import base64
import struct

import numpy as np
import pytest
import torch

from ember_rollout.routing import decode_routed_experts, encode_routed_experts


def test_encoding_is_base64_of_row_major_little_endian_int32():
    experts = torch.tensor([[[1, 2]], [[300, 4]]])  # [2 positions, 1 layer, topk 2]
    expected = base64.b64encode(struct.pack("<4i", 1, 2, 300, 4)).decode()
    assert encode_routed_experts(experts) == expected


def test_round_trip_matches_numpy_reference():
    experts = torch.randint(0, 128, (9, 4, 8), generator=torch.Generator().manual_seed(0))
    encoded = encode_routed_experts(experts)
    reference = np.frombuffer(base64.b64decode(encoded), dtype=np.int32).reshape(-1, 4, 8)
    assert np.array_equal(reference, experts.numpy())
    decoded = decode_routed_experts(encoded, num_tokens=10, num_layers=4, topk=8, where="s")
    assert decoded.dtype == torch.int32 and torch.equal(decoded, experts.int())


def test_wrong_size_names_the_sample_and_both_sizes():
    encoded = encode_routed_experts(torch.zeros(5, 2, 2, dtype=torch.int32))
    with pytest.raises(
        ValueError, match=r"sample 3 \(group 1\): routed experts hold 20 ids .*= 24"
    ):
        decode_routed_experts(
            encoded, num_tokens=7, num_layers=2, topk=2, where="sample 3 (group 1)"
        )


def test_not_base64_or_not_a_string_is_a_clear_error():
    with pytest.raises(ValueError, match="sample 0: .*not valid base64"):
        decode_routed_experts("***", num_tokens=2, num_layers=1, topk=1, where="sample 0")
    with pytest.raises(ValueError, match="sample 0: .*must be a base64 string, got list"):
        decode_routed_experts([1, 2], num_tokens=2, num_layers=1, topk=1, where="sample 0")
    with pytest.raises(ValueError, match="not a whole number of int32"):
        decode_routed_experts(
            base64.b64encode(b"abc").decode(), num_tokens=2, num_layers=1, topk=1, where="s"
        )


def test_narrow_wire_dtype_from_meta_info():
    ids = np.array([3, 1, 2, 0], dtype=np.uint16)
    encoded = base64.b64encode(ids.tobytes()).decode()
    decoded = decode_routed_experts(
        encoded, num_tokens=3, num_layers=1, topk=2, where="s", wire_dtype="uint16"
    )
    assert decoded.tolist() == [[[3, 1]], [[2, 0]]]
    with pytest.raises(ValueError, match=r"routed_experts_dtype'\]='float'"):
        decode_routed_experts(
            encoded, num_tokens=3, num_layers=1, topk=2, where="s", wire_dtype="float"
        )


def test_encode_rejects_bad_shapes():
    with pytest.raises(ValueError, match="must be"):
        encode_routed_experts(torch.zeros(3, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="integer ids"):
        encode_routed_experts(torch.zeros(3, 2, 1))
