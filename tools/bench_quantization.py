"""What low-precision rollout weights cost in learning, against the full-precision engine.

    uv run python tools/bench_quantization.py [CONFIG] [--rollouts N] [--seeds S ...]
                                              [--modes M ...] [--set key=value ...]

For each seed, `ember train CONFIG` runs N rollouts in each mode, one after the other in fresh
processes (tools/bench_e2e.py's `measure`); every seed sets rollout.seed, train.seed and
data.seed. The modes (`--modes`, default all, in this order):

- full: the config as it is (the engine serves the trainer's weights);
- fp8+tis: `engine.quantization=fp8_block` with token TIS against the engine's log-probs
  (`algorithm.off_policy_correction=tis`, verl's recipe for FP8 rollout);
- int4+qat: `engine.quantization=int4_w4a16` with `train.qat=true` (the config's correction);
- int4+tis: `engine.quantization=int4_w4a16` with token TIS and no QAT.

Pass the group size the model needs with `--set engine.quantization_group_size=...` (64 for
SmolLM2, whose 576-wide layers 128 does not divide). It prints, per mode and seed as each run
ends, then per mode as the mean over seeds: the mean reward of the last 10 rollouts and its
ratio to the full-precision engine's (target >= 0.95 for fp8+tis and int4+qat), the first 10's,
the engine-vs-trainer log-prob mismatch where the run logs it
(`rollout/train_rollout_logprob_abs_diff`, the mean per token), the bytes of a weight push
(`perf/weight_push_bytes`) and seconds per iteration.
"""

from __future__ import annotations

import argparse
import math
import statistics

from bench_e2e import mean, measure

MODES = {
    "full": [],
    "fp8+tis": ["engine.quantization=fp8_block", "algorithm.off_policy_correction=tis"],
    "int4+qat": ["engine.quantization=int4_w4a16", "train.qat=true"],
    "int4+tis": ["engine.quantization=int4_w4a16", "algorithm.off_policy_correction=tis"],
}
TARGETS = {"fp8+tis": 0.95, "int4+qat": 0.95}
"""Modes whose last-10 reward must reach this share of the full-precision engine's."""
WINDOW = 10
MISMATCH = "rollout/train_rollout_logprob_abs_diff"


def summary(records: list[dict]) -> dict[str, float]:
    rewards = [r["rollout/rewards"] for r in records]
    mismatch = [r[MISMATCH] for r in records if MISMATCH in r]
    pushed = [r["perf/weight_push_bytes"] for r in records if "perf/weight_push_bytes" in r]
    return {
        "reward last": statistics.mean(rewards[-WINDOW:]),
        "reward first": statistics.mean(rewards[:WINDOW]),
        "mismatch": statistics.mean(mismatch) if mismatch else math.nan,
        "push MB": pushed[-1] / 1e6 if pushed else math.nan,
        "s/iter": mean(records, "perf/iteration_time"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=None)
    parser.add_argument("--rollouts", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    if args.rollouts < WINDOW:
        parser.error(f"--rollouts {args.rollouts}: at least {WINDOW}, for the last-{WINDOW} mean")
    found: dict[str, list[dict[str, float]]] = {mode: [] for mode in args.modes}
    for seed in args.seeds:
        seeded = [f"rollout.seed={seed}", f"train.seed={seed}", f"data.seed={seed}"]
        for mode in args.modes:
            records = measure(args.config, args.rollouts, [*args.set, *seeded, *MODES[mode]])
            found[mode].append(summary(records))
            row = found[mode][-1]
            print(f"seed {seed}, {mode}: " + ", ".join(f"{k} {v:.4g}" for k, v in row.items()))
    config = args.config or "the default config"
    print(f"\n{config}, {args.rollouts} rollouts, seeds {args.seeds}: mean over seeds (per seed)")
    keys = list(next(iter(found.values()))[0])
    print(f"{'':<10}" + "".join(f"{k:>14}" for k in keys))
    for mode, rows in found.items():
        cells = [statistics.mean(r[k] for r in rows) for k in keys]
        print(f"{mode:<10}" + "".join(f"{c:>14.4g}" for c in cells))
        for k in keys:
            print(f"{'':<12}{k}: " + ", ".join(f"{r[k]:.4g}" for r in rows))
    if "full" not in found:
        return
    base = statistics.mean(r["reward last"] for r in found["full"])
    for mode, rows in found.items():
        if mode == "full":
            continue
        ratio = statistics.mean(r["reward last"] for r in rows) / base
        per_seed = ", ".join(
            f"{r['reward last'] / b['reward last']:.2f}"
            for r, b in zip(rows, found["full"], strict=True)
        )
        target = TARGETS.get(mode)
        verdict = "" if target is None else (" (met)" if ratio >= target else " (NOT met)")
        bar = f", target >= {target}" if target else ""
        print(
            f"last-{WINDOW} reward, {mode} / full: {ratio:.3f}{bar}{verdict} (per seed {per_seed})"
        )


if __name__ == "__main__":
    main()
