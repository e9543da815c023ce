"""`ember certify --layers`: the engine's decode path against the trainer's forward, op by op."""

from __future__ import annotations

import json

import pytest
import torch
from ember_runs import ember_command
from test_certify_rows import nothing_starts  # noqa: F401 (a fixture)

from ember.cli import USAGE_ERROR, main
from ember.layer_compare import (
    LAYERS_FILE,
    compare_traces,
    first_difference,
    layers_table,
    one_sided,
)
from ember_rollout.layer_trace import FINAL_OPS, LAYER_OPS


def test_ops_are_compared_bitwise_and_by_magnitude_in_forward_order():
    hidden = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    nudged = hidden.clone()
    nudged[2, 1] += 2**-20 * 8  # one element of one position
    ours = {
        (1, "layer"): hidden,
        (0, "attention"): nudged,
        (0, "input_norm"): hidden,
        (0, "experts"): torch.tensor([[1, 3], [2, 0], [5, 4]]),
    }
    theirs = {
        (1, "layer"): hidden.clone(),
        (0, "attention"): hidden,
        (0, "input_norm"): hidden.clone(),
        (0, "experts"): torch.tensor([[1, 3], [0, 2], [4, 6]]),  # the same sets but the last
    }
    diffs = compare_traces(
        [ours], [theirs], [[-1.0, -2.0]], [torch.tensor([-1.0, -2.5])], num_layers=2
    )
    assert [(d.layer, d.op) for d in diffs] == [
        (0, "input_norm"), (0, "attention"), (0, "experts"), (1, "layer"), (2, "log_probs"),
    ]  # fmt: skip
    got = {d.op: (d.equal, d.positions, d.max_abs) for d in diffs}
    assert got["input_norm"] == (3, 3, 0.0)
    assert got["attention"] == (2, 3, 8 * 2**-20)
    assert got["experts"] == (2, 3, None)
    assert got["log_probs"] == (1, 2, 0.5)
    first = first_difference(diffs)
    assert (first.layer, first.op) == (0, "attention")
    table = layers_table(diffs, num_layers=2)
    assert "first difference: layer 0, attention" in table
    assert table.splitlines()[-2].startswith("final  log_probs")

    same = compare_traces([ours], [dict(ours)], [[-1.0]], [torch.tensor([-1.0])], num_layers=2)
    assert first_difference(same) is None
    assert layers_table(same, num_layers=2).endswith("every op is bitwise equal on both sides")


def test_other_dtypes_are_never_bitwise_equal_and_say_so_and_positions_must_agree():
    a = torch.ones(2, 3)
    [diff] = compare_traces([{(0, "mlp"): a}], [{(0, "mlp"): a.double()}], [], [], num_layers=1)
    assert (diff.equal, diff.max_abs, diff.dtypes) == (0, 0.0, "float32 vs float64")
    assert "(dtypes differ: float32 vs float64)" in layers_table([diff], num_layers=1)
    with pytest.raises(ValueError, match="sample 0: mlp of layer 0 covers 2 positions in the "):
        compare_traces([{(0, "mlp"): a}], [{(0, "mlp"): a[:1]}], [], [], num_layers=1)


def test_values_that_are_not_finite_and_ops_of_one_side_are_shown():
    a = torch.ones(2, 3)
    b = a.clone()
    b[1, 2] = float("nan")
    [diff] = compare_traces([{(0, "mlp"): b}], [{(0, "mlp"): a}], [], [], num_layers=1)
    assert diff.max_abs == float("inf") and diff.equal == 1
    ours = [{(0, "mlp"): a, (0, "attention_core"): a}]
    theirs = [{(0, "mlp"): a, (1, "router_logits"): a}]
    unmatched = one_sided(ours, theirs)
    assert unmatched == ["engine: layer 0 attention_core", "trainer: layer 1 router_logits"]
    diffs = compare_traces(ours, theirs, [], [], num_layers=2)
    assert [d.op for d in diffs] == ["mlp"]
    table = layers_table(diffs, num_layers=2, unmatched=unmatched)
    assert "recorded by one side only: engine: layer 0 attention_core; trainer: layer 1" in table


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--layers", "--set", "engine.kind=sglang"], "engine.kind=hf"),
        (["--layers", "--set", "train.parallel.expert_parallel=2"], "expert_parallel=2"),
        (["--samples", "3"], "--samples"),
        (["--layers", "--samples", "0"], "--samples"),
        (["--layers", "--matrix"], "--matrix"),
        (["--layers", "--plant", "temperature"], "--plant"),
        (["--layers", "--set", "ray.data_parallel=2"], "ray.data_parallel=2"),
    ],
)
def test_what_the_comparison_cannot_do_is_one_line_before_anything_starts(
    argv,
    named,
    capsys,
    nothing_starts,  # noqa: F811
):
    assert main(["certify", *argv]) == USAGE_ERROR
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = err.splitlines()
    assert line.startswith("ember certify: error: ") and named in line


@pytest.mark.slow
def test_the_default_run_names_the_first_op_where_engine_and_trainer_part(tmp_path):
    run = ember_command(
        [
            "certify", "--layers", "--samples", "3",
            "--set", "rollout.rollout_batch_size=2", "--set", f"run.dir={tmp_path}",
        ],
        timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    document = json.loads((tmp_path / LAYERS_FILE).read_text())
    assert document["setup"]["samples"] == 3
    ops = {(op["layer"], op["op"]): op for op in document["ops"]}
    layers = document["setup"]["num_layers"]
    # Every op of every layer on both sides (the default model is MoE in every layer).
    assert document["one_sided"] == []
    assert set(ops) == {(layer, op) for layer in range(layers) for op in LAYER_OPS} | {
        (layers, op) for op in (*FINAL_OPS, "log_probs")
    }
    # The engine decodes every sample of rollout 0 again, in the rollout's batches: what the
    # rollout reported, bit for bit, so the engine's side of the table is the rollout's.
    again = document["redecode_vs_rollout"]
    assert again["positions"] > document["setup"]["response_tokens"]  # all 8 samples
    assert again["equal"] == again["positions"] and again["max_abs"] == 0.0
    assert "the engine's decode again against rollout 0's log-probs" in run.stdout
    # Both sides start from the same embedding, normed alike to within float32 rounding (bit for
    # bit on an AMD EPYC; two RMSNorm kernels need not agree to the bit on every processor); the
    # float32 figures stay small.
    assert ops[(0, "input_norm")]["max_abs"] < 1e-5
    assert ops[(0, "input_norm")]["positions"] == document["setup"]["positions"]
    assert all(op["max_abs"] is None or op["max_abs"] < 1e-4 for op in document["ops"])
    assert ops[(layers, "log_probs")]["positions"] == document["setup"]["response_tokens"]
    first = document["first_difference"]
    assert first is not None  # the default mode is not batch-invariant
    where = f"layer {first['layer']}, {first['op']}"
    assert f"first difference: {where}" in run.stdout
