"""Routed experts: SGLang's wire format, per-sample validation, compact storage."""

from __future__ import annotations

import base64
import struct

import pytest
import torch
from r3_samples import random_experts

from ember_core.config import from_dict
from ember_r3_routing import (
    R3RoutingConfig,
    compact_dtype,
    decode_routed_experts,
    validate_routed_experts,
)

WHERE = "sample 4 (group 1)"


def sglang_payload(ids: list[int]) -> str:
    """What SGLang's detokenizer sends: base64 of the flat little-endian int32 array."""
    return base64.b64encode(struct.pack(f"<{len(ids)}i", *ids)).decode("ascii")


def test_decode_reads_row_major_int32():
    # 2 positions x 2 layers x 2 ranks, in (position, layer, rank) order.
    ids = [3, 1, 0, 0, 5, 2, 0, 0]
    decoded = decode_routed_experts(
        sglang_payload(ids), num_positions=2, num_layers=2, topk=2, where=WHERE
    )
    assert decoded.dtype == torch.int32
    assert decoded.tolist() == [[[3, 1], [0, 0]], [[5, 2], [0, 0]]]


def test_decode_accepts_ids_above_the_uint8_range():
    decoded = decode_routed_experts(
        sglang_payload([300, 70000]), num_positions=1, num_layers=1, topk=2, where=WHERE
    )
    assert decoded.tolist() == [[[300, 70000]]]


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (
            sglang_payload(list(range(12))),
            r"sample 4 \(group 1\): routed experts hold 12 int32 values, expected \[len\(tokens\) "
            r"- 1, num_layers, topk\] = \[4, 2, 2\] = 16 int32 values",
        ),
        (base64.b64encode(b"\x01\x02\x03").decode(), r"hold 3 bytes, expected .*\[4, 2, 2\]"),
        ("not base64!", r"sample 4 \(group 1\): meta_info\['routed_experts'\] is not valid base64"),
        ([1, 2, 3], r"must be a base64 string, got list"),
    ],
)
def test_decode_errors_name_the_sample_and_the_expected_shape(payload, message):
    with pytest.raises(ValueError, match=message):
        decode_routed_experts(payload, num_positions=4, num_layers=2, topk=2, where=WHERE)


def test_valid_experts_are_stored_unchanged_in_uint8(shape):
    experts = random_experts(7, shape, torch.Generator().manual_seed(0))
    stored = validate_routed_experts(experts, shape, num_tokens=8, where=WHERE)
    assert stored.dtype == torch.uint8
    assert torch.equal(stored.to(torch.int32), experts)


def test_wide_expert_counts_keep_every_id():
    config = R3RoutingConfig(num_layers=1, num_experts=300, topk=2)
    experts = torch.tensor([[[299, 256]], [[0, 7]]], dtype=torch.int32)
    stored = validate_routed_experts(experts, config, num_tokens=3, where=WHERE)
    assert stored.dtype == torch.int16
    assert stored.tolist() == [[[299, 256]], [[0, 7]]]


@pytest.mark.parametrize(
    ("num_experts", "dtype"),
    [
        (2, torch.uint8),
        (256, torch.uint8),
        (257, torch.int16),
        (32768, torch.int16),
        (32769, torch.int32),
    ],
)
def test_compact_dtype_is_the_smallest_that_holds_every_id(num_experts, dtype):
    assert compact_dtype(num_experts) == dtype
    assert torch.tensor(num_experts - 1).to(dtype).item() == num_experts - 1


def _broken(shape: R3RoutingConfig, edit) -> torch.Tensor:
    experts = random_experts(5, shape, torch.Generator().manual_seed(1))
    edit(experts)
    return experts


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda s: torch.zeros(5, 3, dtype=torch.int32),
            r"shape \[5, 3\], expected \[len\(tokens\) - 1, num_layers, topk\] = \[5, 3, 2\]",
        ),
        (lambda s: torch.zeros(5, 4, 2, dtype=torch.int32), r"shape \[5, 4, 2\], expected"),
        (lambda s: torch.zeros(5, 3, 1, dtype=torch.int32), r"shape \[5, 3, 1\], expected"),
        (lambda s: torch.zeros(6, 3, 2, dtype=torch.int32), r"shape \[6, 3, 2\], expected"),
        (lambda s: torch.zeros(5, 3, 2), r"must be integer ids, got torch.float32"),
        (
            lambda s: _broken(s, lambda e: e[3, 2].copy_(torch.tensor([1, 6]))),
            r"sample 4 \(group 1\): position 3, layer 2 routes to experts \[1, 6\]; expected ids "
            r"in \[0, num_experts=6\)",
        ),
        (
            lambda s: _broken(s, lambda e: e[0, 0].copy_(torch.tensor([-1, 2]))),
            r"position 0, layer 0 routes to experts \[-1, 2\]",
        ),
        (
            lambda s: _broken(s, lambda e: e[2, 1].copy_(torch.tensor([0, 3]))),
            r"layer 1 is dense \(r3_routing.dense_layers\) but position 2 carries expert ids "
            r"\[0, 3\]; expected zeros",
        ),
        (
            lambda s: _broken(s, lambda e: e[:, 2].zero_()),
            r"MoE layer\(s\) \[2\] hold only zeros over all 5 positions",
        ),
        (
            lambda s: _broken(s, lambda e: e[4, 0].copy_(torch.tensor([5, 5]))),
            r"position 4, layer 0 routes to experts \[5, 5\]; expected 2 distinct experts",
        ),
    ],
)
def test_invalid_experts_name_the_sample_and_what_was_expected(shape, make, message):
    with pytest.raises(ValueError, match=message) as info:
        validate_routed_experts(make(shape), shape, num_tokens=6, where=WHERE)
    assert str(info.value).startswith(WHERE)


def test_a_zero_row_in_a_moe_layer_is_a_repeated_expert(shape):
    experts = random_experts(5, shape, torch.Generator().manual_seed(2))
    experts[1, 0] = 0
    with pytest.raises(ValueError, match=r"position 1, layer 0 routes to experts \[0, 0\]"):
        validate_routed_experts(experts, shape, num_tokens=6, where=WHERE)


def test_top1_routing_may_pick_expert_zero_but_not_everywhere():
    config = R3RoutingConfig(num_layers=1, num_experts=4, topk=1)
    ok = torch.tensor([[[0]], [[3]], [[0]]], dtype=torch.int32)
    assert validate_routed_experts(ok, config, num_tokens=4, where=WHERE).tolist() == ok.tolist()
    with pytest.raises(ValueError, match=r"MoE layer\(s\) \[0\] hold only zeros"):
        validate_routed_experts(
            torch.zeros(3, 1, 1, dtype=torch.int32), config, num_tokens=4, where=WHERE
        )


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"num_layers": -1}, r"r3_routing\.num_layers=-1: expected an integer >= 1"),
        ({"num_experts": 4, "topk": 5}, r"r3_routing\.topk=5: expected 1 <= topk <= num_experts=4"),
        (
            {"num_layers": 2, "dense_layers": [2]},
            r"expected indices in \[0, num_layers=2\), got \[2\]",
        ),
        ({"num_layers": 2, "dense_layers": [0, 1]}, r"every layer is dense"),
        ({"dense_layers": [1, 1]}, r"expected each layer at most once"),
        ({"topk": "two"}, r"r3_routing\.topk: expected an integer, got 'two'"),
    ],
)
def test_config_validation_names_the_key_and_value(data, message):
    with pytest.raises(ValueError, match=message):
        from_dict(R3RoutingConfig, data, prefix="r3_routing")


def test_config_parses_overrides_and_lists_moe_layers():
    config = from_dict(
        R3RoutingConfig,
        {"num_layers": "4", "num_experts": "300", "topk": "8", "dense_layers": "0,3"},
        prefix="r3_routing",
    )
    assert config.moe_layers == [1, 2]
    assert config.expert_dtype == torch.int16
    assert R3RoutingConfig().moe_layers == []  # valid until configure requires the shape
    with pytest.raises(ValueError, match=r"r3_routing.num_experts, r3_routing.topk: not set"):
        R3RoutingConfig(num_layers=2).require_shape()
