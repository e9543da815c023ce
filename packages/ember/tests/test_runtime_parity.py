"""The same run in one process and under Ray writes the same metrics: the runtime changes how a
call reaches an actor (`ember.calls`), never what the actors compute.

Twenty rollouts of the default run on both loops (overlapped, in turn) and under R3 with the
CI checks, each in-process (the default) and under a local Ray (`ray.enabled=true`); every
record of `metrics.jsonl` must be equal, key by key, but for timings (`perf/*`, the record's
wall time).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ember_runs import ember_command

pytestmark = pytest.mark.slow

ROLLOUTS = 20
TIMING_KEYS = {"time"}


def train(run_dir: Path, *args: str) -> str:
    """`ember train` with `args` for ROLLOUTS rollouts; returns its output. The in-process run
    is called in this process (`ember_runs`), the Ray one starts as a command of its own."""
    run = ember_command(
        [
            "train", *args,
            "--set", f"run.num_rollouts={ROLLOUTS}",
            "--set", "run.plot=false", "--set", "run.tensorboard=false",
            "--set", "run.save_interval=0", "--set", f"run.dir={run_dir}",
        ],
        timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stderr + run.stdout


def metrics(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [
        {k: v for k, v in r.items() if k not in TIMING_KEYS and not k.startswith("perf/")}
        for r in records
    ]


@pytest.mark.parametrize(
    "args",
    [
        (),
        ("--set", "rollout.async=false"),
        ("--plugins", "r3_routing,ci_kl_checker", "--set", "ci.test=true"),
    ],
    ids=["overlapped", "in-turn", "r3-ci"],
)
def test_in_process_and_ray_runs_write_the_same_metrics(tmp_path, args):
    local_out = train(tmp_path / "local", *args)
    ray_out = train(tmp_path / "ray", *args, "--set", "ray.enabled=true")
    assert "actors: in-process (ray.enabled=auto" in local_out
    assert "actors: ray (ray.enabled=true)" in ray_out
    local, under_ray = metrics(tmp_path / "local"), metrics(tmp_path / "ray")
    assert [r["kind"] for r in local].count("rollout") == ROLLOUTS
    assert len(local) == len(under_ray)
    for mine, theirs in zip(local, under_ray, strict=True):
        assert mine == theirs, {
            k: (mine.get(k), theirs.get(k)) for k in mine.keys() | theirs.keys()
            if mine.get(k) != theirs.get(k)
        }  # fmt: skip
