"""Dumped rollouts read back as the samples that were written, and bad dumps get one line."""

from __future__ import annotations

import json

import pytest
import torch

from ember.dumps import read_dump, write_dump
from ember_core.types import Sample, SampleStatus


def _samples() -> list[Sample]:
    experts = torch.tensor([[[0, 1]], [[2, 3]], [[1, 0]], [[3, 2]]], dtype=torch.int32)
    return [
        Sample(
            tokens=[3, 4, 5, 6, 7],
            response_length=2,
            index=0,
            group_index=0,
            prompt="copy 34 =",
            response="67",
            label="34",
            reward=0.5,
            loss_mask=[1, 0],
            rollout_log_probs=[-0.25, -1.5],
            rollout_routed_experts=experts,
            status=SampleStatus.COMPLETED,
            weight_version="-1",
            weight_versions=[(0, "-1"), (1, "0")],
        ),
        Sample(tokens=[3, 4, 9], response_length=1, index=1, reward=0.0, weight_version="0"),
    ]


def test_a_dump_reads_back_as_the_samples_written(tmp_path):
    path = tmp_path / "rollouts" / "000003.jsonl"
    written = _samples()
    write_dump(path, written)
    read = read_dump(path)
    for got, want in zip(read, written, strict=True):
        if want.rollout_routed_experts is None:
            assert got.rollout_routed_experts is None
        else:
            assert torch.equal(got.rollout_routed_experts, want.rollout_routed_experts)
        got.rollout_routed_experts = want.rollout_routed_experts = None
        want.loss_mask = want.effective_loss_mask()
        assert got == want


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda rows: ["{not json"], r"000000.jsonl:1: malformed JSON"),
        (lambda rows: [json.dumps([1])], r"000000.jsonl:1: expected a JSON object, got list"),
        (
            lambda rows: [
                json.dumps({k: v for k, v in json.loads(rows[0]).items() if k != "tokens"})
            ],
            r"000000.jsonl:1: no 'tokens' key",
        ),
        (
            lambda rows: [rows[0], json.dumps({**json.loads(rows[1]), "response_length": 9})],
            r"000000.jsonl:2: ",
        ),
        (lambda rows: [""], r"000000.jsonl: no samples in the dumped rollout"),
    ],
)
def test_a_bad_dump_names_its_file_and_line(tmp_path, edit, message):
    path = tmp_path / "000000.jsonl"
    write_dump(path, _samples())
    path.write_text("\n".join(edit(path.read_text().splitlines())) + "\n")
    with pytest.raises(ValueError, match=message) as info:
        read_dump(path)
    assert "\n" not in str(info.value)
