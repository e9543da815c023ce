"""Seconds per RL iteration of a run, split into rollout, log-probs, training and weight push.

    uv run python tools/bench_e2e.py [CONFIG] [--rollouts N] [--set key=value ...]

Runs the config (default: the default CPU example) through the real Ray driver for N rollouts
and prints, per phase, the mean seconds per iteration (the first iteration, which pays for
warm-up, is reported apart), its share of the iteration and tokens per second.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import ember  # noqa: F401  (sets Ray's environment before Ray is imported)
from ember.config import load_config
from ember.driver import Driver

PHASES = {
    "rollout": "perf/rollout_time",
    "ref + old log-probs": "perf/log_probs_time",
    "training": "perf/train_time",
    "weight push": "perf/weight_push_time",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=None)
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="ember-bench-") as tmp:
        overrides = [
            f"run.num_rollouts={args.rollouts}",
            "run.save_interval=0",
            "run.plot=false",
            "run.tensorboard=false",
            *args.set,
        ]
        config, _ = load_config(args.config, overrides=overrides)
        driver = Driver(config, Path(tmp))
        try:
            driver.run()
        finally:
            driver.shutdown()
        lines = (Path(tmp) / "metrics.jsonl").read_text().splitlines()
        rollouts = [r for r in map(json.loads, lines) if r["kind"] == "rollout"]

    first, rest = rollouts[0], rollouts[1:] or rollouts
    samples = statistics.mean(r["rollout/num_samples"] for r in rest)
    resp_tokens = statistics.mean(r["rollout/response_len_mean"] for r in rest) * samples
    total = statistics.mean(sum(r[k] for k in PHASES.values()) for r in rest)
    print(
        f"{config.run.name}: {len(rest)} iterations measured (after 1 warm-up), "
        f"{samples:.0f} samples and {resp_tokens:.0f} response tokens per iteration"
    )
    print(f"{'phase':<22}{'s/iter':>9}{'share':>8}{'first':>9}")
    for name, key in PHASES.items():
        mean = statistics.mean(r[key] for r in rest)
        print(f"{name:<22}{mean:>9.3f}{mean / total:>8.1%}{first[key]:>9.3f}")
    print(f"{'total':<22}{total:>9.3f}{1:>8.0%}")
    rollout_time = statistics.mean(r["perf/rollout_time"] for r in rest)
    print(f"rollout generation: {resp_tokens / rollout_time:,.0f} response tokens/s")
    print(f"end to end: {resp_tokens / total:,.0f} response tokens/s, {1 / total:.2f} iterations/s")


if __name__ == "__main__":
    main()
