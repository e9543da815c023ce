"""What `rollout.true_on_policy` costs and what it changes in learning, against the default mode.

    uv run python tools/bench_true_on_policy.py [CONFIG] [--rollouts N] [--seeds S ...]
                                                [--set key=value ...]

For each seed, `ember train CONFIG` runs N rollouts in the default mode and in the true
on-policy mode (`--set rollout.true_on_policy=true`), one after the other in fresh processes
(tools/bench_e2e.py's `measure`); every seed sets rollout.seed, train.seed and data.seed. It
prints, per mode, the mean over seeds of:

- seconds per iteration (`perf/iteration_time`, the first iteration left out as warm-up), of
  the rollout phase's generation (`perf/rollout_time_s`) and of training (`perf/train_time`),
  and the ratio of the mode's to the default's, per seed and of the means (target <= 1.3 on
  the real model's dense example, examples/smollm2-arith.yaml); and the response tokens
  generated per second, since the two modes sample different answers (lengths included) once
  their numbers part;
- learning: the mean reward of the first and the last 5 rollouts, and the largest
  |trainer - engine| log-prob the run saw (`rollout/train_rollout_logprob_max_abs_diff`, which
  is 0 in the mode), with every seed's figures beside the mean.
"""

from __future__ import annotations

import argparse
import statistics

from bench_e2e import mean, measure

MODES = {"default": [], "true on-policy": ["rollout.true_on_policy=true"]}
COST_TARGET = 1.3
WINDOW = 5
MISMATCH = "rollout/train_rollout_logprob_max_abs_diff"


def summary(records: list[dict]) -> dict[str, float]:
    rewards = [r["rollout/rewards"] for r in records]
    mismatch = [r[MISMATCH] for r in records if MISMATCH in r]
    tokens = [r["rollout/response_len_mean"] * r["rollout/num_samples"] for r in records[1:]]
    return {
        "s/iter": mean(records, "perf/iteration_time"),
        "generation s": mean(records, "perf/rollout_time_s"),
        "gen tokens/s": statistics.mean(tokens) / mean(records, "perf/rollout_time_s"),
        "train s": mean(records, "perf/train_time"),
        "reward first": statistics.mean(rewards[:WINDOW]),
        "reward last": statistics.mean(rewards[-WINDOW:]),
        "max |diff|": max(mismatch) if mismatch else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=None)
    parser.add_argument("--rollouts", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    if args.rollouts <= WINDOW:
        parser.error(f"--rollouts {args.rollouts}: more than {WINDOW}, to tell first from last")
    found: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for seed in args.seeds:
        seeded = [f"rollout.seed={seed}", f"train.seed={seed}", f"data.seed={seed}"]
        for mode, sets in MODES.items():
            records = measure(args.config, args.rollouts, [*args.set, *seeded, *sets])
            found[mode].append(summary(records))
            row = found[mode][-1]
            print(f"seed {seed}, {mode}: " + ", ".join(f"{k} {v:.4g}" for k, v in row.items()))
    config = args.config or "the default config"
    print(f"\n{config}, {args.rollouts} rollouts, seeds {args.seeds}: mean over seeds (per seed)")
    keys = list(found["default"][0])
    print(f"{'':<16}" + "".join(f"{k:>16}" for k in keys))
    for mode, rows in found.items():
        cells = [statistics.mean(r[k] for r in rows) for k in keys]
        print(f"{mode:<16}" + "".join(f"{c:>16.4g}" for c in cells))
        for k in keys:
            print(f"{'':<18}{k}: " + ", ".join(f"{r[k]:.4g}" for r in rows))
    base, exact = found["default"], found["true on-policy"]
    for key in ("s/iter", "generation s", "train s", "gen tokens/s"):
        ratio = statistics.mean(r[key] for r in exact) / statistics.mean(r[key] for r in base)
        per_seed = ", ".join(f"{e[key] / b[key]:.2f}" for e, b in zip(exact, base, strict=True))
        print(f"{key}: true on-policy / default = {ratio:.2f}x (per seed {per_seed})")
    ratio = statistics.mean(r["s/iter"] for r in exact) / statistics.mean(r["s/iter"] for r in base)
    verdict = "met" if ratio <= COST_TARGET else "NOT met"
    print(f"cost target <= {COST_TARGET}x seconds per iteration: {verdict}")


if __name__ == "__main__":
    main()
