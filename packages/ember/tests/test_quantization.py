"""Low-precision rollout weights end to end (`engine.quantization`, `train.qat`): the default
run with each scheme, with and without QAT, and the settings refused before anything starts."""

from __future__ import annotations

import json

import pytest
from ember_runs import ember_command

from ember.cli import USAGE_ERROR, main

GROUP = ["--set", "engine.quantization_group_size=32"]
"""The default model's key/value projections have 32 outputs: FP8 blocks of 32 fit it."""


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        (
            ["engine.quantization=fp4"],
            "engine.quantization='fp4': expected one of fp8_block, int4_w4a16, or null",
        ),
        (
            ["engine.quantization=fp8_block", "engine.quantization_group_size=48"],
            "engine.quantization=fp8_block: model.layers.0.self_attn.o_proj.weight: fp8_block "
            "group size 48 does not divide its output size 64 (shape (64, 64)); set "
            "engine.quantization_group_size to a divisor such as 32",
        ),
        (
            ["engine.quantization=int4_w4a16"],  # the default group size: 128 > 64 inputs
            "int4_w4a16 group size 128 does not divide its input size 64",
        ),
        (["engine.quantization_group_size=12"], "engine.quantization_group_size=12: expected"),
        (["train.qat=true"], "train.qat=true with engine.quantization=null"),
        (
            ["engine.quantization=int4_w4a16", "engine.quantization_group_size=32",
             "rollout.true_on_policy=true"],
            "engine.quantization=int4_w4a16 with rollout.true_on_policy=true and train.qat=false",
        ),
        (
            ["engine.quantization=int4_w4a16", "engine.quantization_group_size=32",
             "engine.quantization_targets=experts", "train.model=tiny-dense"],
            "engine.quantization_targets=experts: the model has no routed experts",
        ),
        (
            ["engine.quantization=fp8_block", "engine.quantization_group_size=32",
             "train.qat=true", "train.parallel.tensor_parallel=2",
             "train.model_overrides.vocab_size=18"],
            "train.qat=true with train.parallel.tensor_parallel=2",
        ),
    ],
)  # fmt: skip
def test_bad_settings_are_one_line_before_anything_starts(sets, expected, capsys, nothing_starts):
    argv = ["train"] + [arg for s in sets for arg in ("--set", s)]
    assert main(argv) == USAGE_ERROR
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert expected in err


MODES = {
    "full": [],
    "fp8": ["engine.quantization=fp8_block"],
    "fp8+qat": ["engine.quantization=fp8_block", "train.qat=true"],
    "int4": ["engine.quantization=int4_w4a16"],
    "int4+qat": ["engine.quantization=int4_w4a16", "train.qat=true"],
    "int4 by disk": ["engine.quantization=int4_w4a16", "weights.transport=disk"],
}


@pytest.mark.slow
def test_the_default_run_with_each_scheme_with_and_without_qat(tmp_path):
    """Two rollouts each, in turn, the trainer scoring the old policy itself, so that rollout 0
    measures the engine against the trainer on the same weights."""
    first = {}
    for mode, sets in MODES.items():
        run_dir = tmp_path / mode
        argv = ["train", *GROUP, "--set", f"run.dir={run_dir}"]
        for s in [
            *sets, "run.num_rollouts=2", "rollout.rollout_batch_size=8", "rollout.async=false",
            "algorithm.use_rollout_log_probs=false", "run.plot=false", "run.tensorboard=false",
        ]:  # fmt: skip
            argv += ["--set", s]
        done = ember_command(argv, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        rollouts = [r for r in map(json.loads, lines) if r["kind"] == "rollout"]
        assert [r["rollout_id"] for r in rollouts] == [0, 1]
        first[mode] = rollouts[0]
    mismatch = {m: r["rollout/train_rollout_logprob_abs_diff"] for m, r in first.items()}
    pushed = {m: r["perf/weight_push_bytes"] for m, r in first.items()}
    # Without QAT the trainer computes with the full-precision weights the engine does not
    # serve; with it, with the served ones: back to the full-precision engine's agreement.
    assert mismatch["full"] < 1e-5
    assert mismatch["fp8"] > 1e-3 and mismatch["int4"] > 1e-3, mismatch
    assert mismatch["int4+qat"] < max(2 * mismatch["full"], 1e-5), mismatch
    # FP8 quantizes activations too: a last-bit difference between the engine's decode and
    # the trainer's forward can round one a whole FP8 step apart (docs/low-precision.md), so
    # QAT brings the mismatch down, not always to the full-precision engine's.
    assert mismatch["fp8+qat"] < mismatch["fp8"] / 10, mismatch
    # FP8 is a quarter of fp32's bytes, INT4 an eighth, plus scales and what stays in fp32
    # (embeddings, norms, routers, the output layer).
    assert pushed["fp8"] == pushed["fp8+qat"] < 0.4 * pushed["full"]
    assert pushed["int4"] == pushed["int4+qat"] < 0.7 * pushed["fp8"]
    # A disk push exports the same quantized tensors (in a safetensors file): the same numbers.
    assert mismatch["int4 by disk"] == mismatch["int4"]
    assert pushed["int4"] < pushed["int4 by disk"] < 1.5 * pushed["int4"]
