"""Seconds per RL iteration of a run, split into phases, and two side-by-side comparisons.

    uv run python tools/bench_e2e.py [CONFIG] [--rollouts N] [--set key=value ...]
                                     [--rows phases,engines,async]

Each measurement runs `ember train CONFIG` (default: the default CPU example) in a fresh process
for N rollouts and reads its `metrics.jsonl`; the first iteration, which pays for warm-up, is
left out of every mean. Rows:

- phases: per phase, the mean seconds per iteration, its share, and the first iteration, with
  rollout and training in turn (`rollout.async=false`).
- engines: the rollout phase (`perf/rollout_time`) of 2 embedded engines of 1 thread each vs 1
  engine of 2 threads (`engine.hf.num_threads`), the same config otherwise, with rollout and
  training in turn: in the overlapped default `perf/rollout_time` is only the time the loop
  waited for a rollout generated during training, not the rollout phase. Target <= 0.8.
- async: seconds per iteration (`perf/iteration_time`) with `rollout.async=true` vs without.
  Target <= 0.7.
- staleness: seconds per iteration for each `rollout.max_staleness` k of `--staleness` (default
  0, 1, 2, 4) with `--engines` embedded engines (default 2), and with partial rollouts
  (`rollout.partial_rollouts=true`) for every k >= 1, each as a ratio to k = 0. Every row
  averages the same iterations: those after the largest k (iterations up to k train on
  rollouts generated ahead during the first one), so no row gains from leaving out more of
  the early, slower iterations than another. Beside s/iter it prints the trainer's share
  (`perf/train_time`), the wait for a rollout, and the response tokens generated per
  iteration: the work itself changes with k, since each k learns along its own path.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

PHASES = {
    "rollout (waited)": "perf/rollout_time",
    "ref + old log-probs": "perf/log_probs_time",
    "training": "perf/train_time",
    "weight push": "perf/weight_push_time",
}
ROWS = ("phases", "engines", "async", "staleness")
ENGINES_TARGET = 0.8
ASYNC_TARGET = 0.7


def measure(config: str | None, rollouts: int, overrides: list[str]) -> list[dict]:
    """The rollout records of one `ember train` run in a fresh process (and a fresh Ray)."""
    with tempfile.TemporaryDirectory(prefix="ember-bench-") as tmp:
        sets = [
            f"run.num_rollouts={rollouts}",
            "run.save_interval=0",
            "run.plot=false",
            "run.tensorboard=false",
            *overrides,
            f"run.dir={tmp}/run",
        ]
        argv = [sys.executable, "-m", "ember.cli", "train", *([config] if config else [])]
        for item in sets:
            argv += ["--set", item]
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"bench_e2e: {' '.join(argv)} failed:\n{done.stderr[-3000:]}")
        lines = (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "rollout"]


def mean(records: list[dict], key: str, *, skip: int = 1) -> float:
    """Mean of `key` over the iterations after the first `skip` (warm-up)."""
    return statistics.mean(r[key] for r in (records[skip:] or records))


def staleness_table(run: Any, ks: list[int], engines: int, rollouts: int) -> None:
    """Seconds per iteration for each k, in turn and with partial rollouts, against k = 0."""
    skip = max(ks) + 1
    if rollouts <= skip:
        sys.exit(f"bench_e2e: --rollouts {rollouts} leaves no steady state for k = {max(ks)}")
    print(
        f"rollout.max_staleness with {engines} engines, {rollouts} rollouts each; means over "
        f"iterations {skip} .. {rollouts - 1} (the same for every k), ratio to the first row"
    )
    print(
        f"{'k':>3}{'partial':>9}{'s/iter':>9}{'ratio':>8}{'train':>8}{'waited':>9}"
        f"{'tokens':>8}{'staleness':>11}{'reward':>8}"
    )
    base = None
    for k in ks:
        for partial in (False, True) if k else (False,):
            records = run(
                f"rollout.max_staleness={k}",
                f"rollout.partial_rollouts={str(partial).lower()}",
                f"ray.num_engines={engines}",
            )
            per_iter = mean(records, "perf/iteration_time", skip=skip)
            base = per_iter if base is None else base
            tokens = statistics.mean(
                r["rollout/response_len_mean"] * r["rollout/num_samples"] for r in records[skip:]
            )
            print(
                f"{k:>3}{'yes' if partial else 'no':>9}{per_iter:>9.3f}{per_iter / base:>8.2f}"
                f"{mean(records, 'perf/train_time', skip=skip):>8.3f}"
                f"{mean(records, 'perf/rollout_time', skip=skip):>9.3f}{tokens:>8.0f}"
                f"{mean(records, 'rollout/staleness', skip=skip):>11.2f}"
                f"{records[-1]['rollout/rewards']:>8.3f}"
            )


def phases(name: str, records: list[dict]) -> None:
    first, rest = records[0], records[1:] or records
    samples = mean(records, "rollout/num_samples")
    resp_tokens = mean(records, "rollout/response_len_mean") * samples
    total = mean(records, "perf/iteration_time")
    print(
        f"{name}: {len(rest)} iterations measured (after 1 warm-up), "
        f"{samples:.0f} samples and {resp_tokens:.0f} response tokens per iteration"
    )
    print(f"{'phase':<22}{'s/iter':>9}{'share':>8}{'first':>9}")
    for label, key in PHASES.items():
        value = mean(records, key)
        print(f"{label:<22}{value:>9.3f}{value / total:>8.1%}{first[key]:>9.3f}")
    print(f"{'iteration':<22}{total:>9.3f}{1:>8.0%}{first['perf/iteration_time']:>9.3f}")
    generation = mean(records, "perf/rollout_time_s")
    print(f"rollout generation: {resp_tokens / generation:,.0f} response tokens/s")
    print(f"end to end: {resp_tokens / total:,.0f} response tokens/s, {1 / total:.2f} iterations/s")


def ratio_row(label: str, ours: float, theirs: float, unit: str, target: float) -> None:
    value = ours / theirs
    verdict = "met" if value <= target else "NOT met"
    print(f"{label}: {ours:.3f} vs {theirs:.3f} {unit} -> {value:.2f}x", end=" ")
    print(f"(target <= {target}: {verdict})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=None)
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--rows", default=",".join(ROWS), help=f"any of {', '.join(ROWS)}")
    parser.add_argument(
        "--staleness", default="0,1,2,4", help="staleness row: the max_staleness values"
    )
    parser.add_argument("--engines", type=int, default=2, help="staleness row: engines")
    args = parser.parse_args()
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        parser.error(f"--rows: unknown {unknown}; expected some of {', '.join(ROWS)}")
    name = args.config or "default"

    def run(*extra: str) -> list[dict]:
        return measure(args.config, args.rollouts, [*args.set, *extra])

    # Phases add up only when rollout and training take turns (the default overlaps them).
    sync = run("rollout.async=false") if "phases" in rows or "async" in rows else None
    if "phases" in rows:
        assert sync is not None
        phases(name, sync)
    if "engines" in rows:
        one = run("rollout.async=false", "ray.num_engines=1", "engine.hf.num_threads=2")
        two = run("rollout.async=false", "ray.num_engines=2", "engine.hf.num_threads=1")
        ratio_row(
            "rollout phase, 2 engines x 1 thread vs 1 engine x 2 threads",
            mean(two, "perf/rollout_time"),
            mean(one, "perf/rollout_time"),
            "s/iter",
            ENGINES_TARGET,
        )
    if "async" in rows:
        assert sync is not None
        overlapped = run("rollout.async=true")
        ratio_row(
            "iteration, rollout.async=true vs false",
            mean(overlapped, "perf/iteration_time"),
            mean(sync, "perf/iteration_time"),
            "s/iter",
            ASYNC_TARGET,
        )
        hidden = mean(sync, "perf/iteration_time") - mean(sync, "perf/rollout_time")
        print(
            f"  bound: hiding the whole sync rollout phase would give "
            f"{hidden / mean(sync, 'perf/iteration_time'):.2f}x (both sides share the cores)"
        )
        print(
            f"  async rollout waited {mean(overlapped, 'perf/rollout_time'):.3f} s/iter; "
            f"reward after {len(overlapped)} rollouts {overlapped[-1]['rollout/rewards']:.3f} "
            f"(sync {sync[-1]['rollout/rewards']:.3f})"
        )
    if "staleness" in rows:
        ks = [int(k) for k in args.staleness.split(",") if k.strip()]
        staleness_table(run, ks, args.engines, args.rollouts)


if __name__ == "__main__":
    main()
