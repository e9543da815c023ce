"""`ember train` on one GPU: Ray placement on a shared device, weight pushes, CI-mode checks.

The training rank and the rollout engine each take half of the GPU through Ray. One run is the
one-GPU example (the embedded engine on CUDA); the others take rollouts from SGLang serving the
suite's Megatron-exported model, with R3 and without it, ci_kl_checker asserting in CI mode.
How much R3 lowers the train/rollout log-prob gap is measured on identical rollouts in
test_rollout_sglang_gpu.py: two runs sample different tokens.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from gpu_support import colocated_sglang_run, served_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

NEEDS_SGLANG = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None,
    reason="needs the [sglang] extra (uv sync --extra sglang)",
)
SHORT = [
    "--set", "run.num_rollouts=2",
    "--set", "run.plot=false",
    "--set", "run.tensorboard=false",
]  # fmt: skip
ON_POLICY = 1e-8
"""ci_kl_checker's tolerance."""


def ember_train(config: str | Path, run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ember.cli", "train", str(config), *SHORT, *args]
        + ["--set", f"run.dir={run_dir}"],
        capture_output=True,
        text=True,
        timeout=1800,
    )


def records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_one_gpu_example(tmp_path):
    run_dir = tmp_path / "run"
    smaller = ["--set", "rollout.rollout_batch_size=16", "--set", "run.save_interval=0"]
    run = ember_train("moe_r3_1gpu", run_dir, *smaller)
    assert run.returncode == 0, run.stderr[-5000:]
    rollouts, steps = records(run_dir, "rollout"), records(run_dir, "train")
    assert [r["rollout_id"] for r in rollouts] == [0, 1]
    assert [s["rollout_id"] for s in steps] == [0] * 4 + [1] * 4
    for rollout in rollouts:
        assert rollout["rollout/replay_agreement"] == 1.0
        assert 0.0 <= rollout["rollout/rewards"] <= 1.0
    assert abs(steps[0]["train/ppo_kl"]) < ON_POLICY and abs(steps[4]["train/ppo_kl"]) < ON_POLICY


@NEEDS_SGLANG
@pytest.mark.parametrize(
    "plugins", [["r3_routing", "ci_kl_checker"], ["ci_kl_checker"]], ids=["r3", "no-r3"]
)
def test_sglang_rollouts_in_ci_mode(served_root, tmp_path, plugins):
    model = served_model(served_root, seed=0)
    config = colocated_sglang_run(model, tmp_path / "sglang-logs", plugins)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    run_dir = tmp_path / "run"

    run = ember_train(path, run_dir)
    assert run.returncode == 0, run.stderr[-5000:]  # the KL checker raises on a failed check
    rollouts, steps = records(run_dir, "rollout"), records(run_dir, "train")
    assert [r["rollout_id"] for r in rollouts] == [0, 1]
    assert [s["rollout_id"] for s in steps] == [0, 0, 1, 1]
    assert abs(steps[0]["train/ppo_kl"]) < ON_POLICY and abs(steps[2]["train/ppo_kl"]) < ON_POLICY
    # Rollout 1 was sampled with the weights pushed after rollout 0's two steps, which moved
    # the actor (KL to the initial weights well above 0.05^2 / 2): an engine left with stale
    # weights would miss the bound on the train/rollout gap.
    assert steps[2]["train/kl_loss"] > 0.01
    for rollout in rollouts:
        assert rollout["rollout/train_rollout_logprob_abs_diff"] < 0.05
    if "r3_routing" in plugins:
        for rollout in rollouts:
            assert 0.0 < rollout["rollout/routing_agreement"] <= 1.0
            assert rollout["rollout/replay_agreement"] == 1.0
    else:  # no experts asked for, none replayed; the stricter initial checks ran
        assert all("rollout/routing_agreement" not in r for r in rollouts)
        assert rollouts[0]["rollout/log_probs"] == rollouts[0]["rollout/ref_log_probs"]
        assert abs(steps[0]["train/kl_loss"]) < ON_POLICY
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("rollout_*")) == [
        "rollout_000000",
        "rollout_000001",
    ]
