"""Ember against TRL's GRPOTrainer on the same work: wall time, time to reward 0.9, s/rollout.

    uv run python tools/bench_peer.py [--task copy|reverse|sort]
        [--min-digits N] [--max-digits N] [--rollouts N] [--seeds S ...] [--only ember|trl]
        [--out DIR] [--set key=value ...]

TRL lives in the `peer` dependency group, which the default install leaves out; when it is
missing, the bench runs itself again through `uv run --group peer`, which installs it. Both
sides run one after the other, each as a command of its own: Ember as `uv run ember train
--set ...` (the default config plus the bench's overrides), TRL as a fresh
Python process driving `trl.GRPOTrainer`. Both start from the same weights (the `hf_init/`
that Ember exports at the start of its run; with `--only trl`, an export of the same initial
weights), the same toy tokenizer (saved in that directory), the same prompts
(`make_toy_prompts` of the same `data.toy` section) and the same reward (`toy_score`, called
from TRL's reward function). TRL's `GRPOConfig` is derived from the resolved Ember config; the
bench prints every setting's mapping before it runs, and says where a setting cannot be mapped
or where the two differ in detail. TRL gets its own CPU setup: no vLLM, `use_cpu`, fp32 (no
bf16 autocast), no gradient checkpointing (it only trades time for memory).

Ember runs twice: its default overlapped loop, and its in-turn loop (`rollout.async=false`,
which generates and then trains as TRL does; `--no-in-turn` skips it). The bench prints the
machine it ran on (processor, vector extensions, cores, load) before and after. Per side it
prints the whole command's wall time, the first rollout whose mean reward reaches 0.9 (its
index, and the seconds from the command's start to the end of that rollout's training), the
median seconds per rollout (from one rollout's end to the next), when rollout 0 was done
(start-up included) and the mean reward over the last 20 rollouts, then each Ember loop's ratio
to TRL. With several `--seeds` (each sets rollout.seed, train.seed and data.seed, so the initial
weights change with it) it prints mean +- standard deviation over seeds. The bench sets
`train.optimizer.lr_decay_steps` to rollouts x optimizer steps per rollout (800 for the default
200 x 4), so both schedules decay over the run, unless `--set` gives it. `ray.threads_per_actor`
also sets the TRL process's torch threads (unset: torch's default, one per core, as each Ember
actor gets while rollout and training take turns). Time the two on an otherwise idle machine:
when other processes hold the cores, torch's threads wait on each other (on a loaded 2-core
machine one fwd+bwd of the tiny model over 64 samples took 3 s with 2 threads, 0.05 s with 1).

Runs go to `--out` (default runs/bench_peer-<timestamp>): per task and seed, Ember's run
directory (`ember/`) and TRL's (`trl/`: its metrics in Ember's format, spec, checkpoints), each
with a `result.json`, and both commands' logs. `tools/bench_learning.py` runs the learning
comparison (several tasks x seeds) on the same code.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from machine import describe_machine  # noqa: E402

SIDES = ("ember", "trl")
"""The two sides every comparison runs (`tools/bench_learning.py` too)."""
IN_TURN = "ember_inturn"
"""Ember's in-turn loop (`rollout.async=false`: generate, then train, as TRL does), which
bench_peer runs beside its overlapped default unless `--no-in-turn`."""
IN_TURN_SETS = ("rollout.async=false",)
NAMES = {"ember": "Ember", IN_TURN: "Ember in turn", "trl": "TRL"}
THRESHOLDS = (0.5, 0.9)
"""Mean rewards whose first crossing is reported."""
LAST = 20
"""Rollouts at the end whose mean reward is reported."""
DROP_AFTER = 50
"""The largest fall below the running best is measured from this rollout on."""
RESULT = "result.json"


# --------------------------------------------------------------------------------------------
# Arguments and overrides
# --------------------------------------------------------------------------------------------


def build_parser(description: str = "") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description or __doc__.splitlines()[0])
    parser.add_argument("--task", choices=("copy", "reverse", "sort"), default=None)
    parser.add_argument("--min-digits", type=int, default=None)
    parser.add_argument("--max-digits", type=int, default=None)
    parser.add_argument("--rollouts", type=int, default=None, help="default: the config's")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, metavar="S")
    parser.add_argument("--only", choices=SIDES, default=None, help="run one side only")
    parser.add_argument(
        "--no-in-turn",
        dest="in_turn",
        action="store_false",
        help="skip Ember's in-turn loop (rollout.async=false), run beside the default otherwise",
    )
    parser.add_argument("--out", type=Path, default=None, help="output directory")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="Ember config override"
    )
    parser.add_argument("--trl-worker", metavar="SPEC", help=argparse.SUPPRESS)
    parser.add_argument("--export-init", metavar="DIR", help=argparse.SUPPRESS)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The bench's arguments, with the task, digits and rollouts defaulting to the config's."""
    args = build_parser().parse_args(argv)
    if args.trl_worker or args.export_init:
        return args
    base = load_run_config(args.set)
    toy = base.data.toy
    args.task = args.task or toy.task
    args.min_digits = toy.min_digits if args.min_digits is None else args.min_digits
    args.max_digits = toy.max_digits if args.max_digits is None else args.max_digits
    args.rollouts = base.run.num_rollouts if args.rollouts is None else args.rollouts
    if not 1 <= args.min_digits <= args.max_digits:
        raise SystemExit(f"digits {args.min_digits}-{args.max_digits}: expected 1 <= min <= max")
    if args.rollouts < 1:
        raise SystemExit(f"--rollouts {args.rollouts}: expected >= 1")
    if args.seeds is not None and len(set(args.seeds)) != len(args.seeds):
        raise SystemExit(f"--seeds {args.seeds}: each seed once")
    return args


def set_args(sets: Sequence[str]) -> list[str]:
    """`--set` arguments for each override."""
    return [arg for s in sets for arg in ("--set", s)]


def load_run_config(overrides: Sequence[str]) -> Any:
    from ember.config import load_config

    config, _ = load_config(None, overrides=list(overrides))
    return config


def ember_overrides(
    task: str,
    min_digits: int,
    max_digits: int,
    rollouts: int,
    seed: int | None,
    user_sets: Sequence[str],
) -> list[str]:
    """The `--set` list of one Ember run: task, length, schedule horizon and seeds, then the
    user's own overrides (which win)."""
    steps = load_run_config(user_sets).train.num_steps_per_rollout
    sets = [
        f"data.toy.task={task}",
        f"data.toy.min_digits={min_digits}",
        f"data.toy.max_digits={max_digits}",
        f"run.num_rollouts={rollouts}",
    ]
    if not any(s.split("=", 1)[0].strip() == "train.optimizer.lr_decay_steps" for s in user_sets):
        sets.append(f"train.optimizer.lr_decay_steps={rollouts * steps}")
    if seed is not None:
        sets += [f"rollout.seed={seed}", f"train.seed={seed}", f"data.seed={seed}"]
    return [*sets, *user_sets]


# --------------------------------------------------------------------------------------------
# The hyper-parameter mapping
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One line of the mapping: an Ember setting, the TRL setting standing for it, and how the
    two differ ("" when they mean the same)."""

    ember: str
    ember_value: Any
    trl: str
    trl_value: Any
    note: str = ""


@dataclass
class PeerMapping:
    rows: list[Row]
    kwargs: dict[str, Any]
    """GRPOConfig keyword arguments (output_dir excluded)."""
    steps_per_rollout: int
    """Optimizer steps per rollout (TRL's global steps per generation)."""
    threads: int | None = None
    """torch threads of the TRL process; None keeps torch's default (one per core)."""


NOTES = {
    "generation_batch_size": "rollout_batch_size x n_samples_per_prompt; TRL derives it",
    "per_device_train_batch_size": "Ember's None: one micro-batch per mini-batch",
    "steps_per_generation": "micro-batches per rollout: one optimizer step per mini-batch",
    "top_k": "TRL's 0 keeps every token",
    "scale_rewards": "both divide by the unbiased group std, + 1e-6 in Ember, + 1e-4 in TRL",
    "beta": "no KL in either loss; Ember still runs the reference forward for its logged KL, "
    "TRL loads no reference at beta 0",
    "entropy_coef": "TRL's bonus is the token mean over the micro-batch; Ember reduces the "
    "entropy like the loss (per-sample mean)",
    "loss_type": "grpo: mean over each sample's tokens, then over samples (bnpo: over tokens)",
    "cosine_warmup_with_min_lr": "same warm-up (step s: lr*(s+1)/warmup); TRL's cosine decay "
    "runs one step ahead",
    "constant_with_warmup": "TRL warms up from lr 0 (lr*s/warmup)",
    "linear": "TRL warms up from lr 0 and decays to 0, not to min_lr",
    "max_steps": "rollouts x optimizer steps per rollout; TRL's schedule decays over it",
    "(max_steps)": "differs: Ember decays over lr_decay_steps, TRL over max_steps",
    "bf16": "fp32 weights and math on both sides",
    "model": "Ember's export of its initial weights (and toy tokenizer), loaded in fp32",
    "use_vllm": "TRL generates with transformers' generate() on the policy it trains",
    "train_dataset": "make_toy_prompts of the same data.toy section",
    "seed": "same initial weights (hf_init); the sampling and shuffling streams differ",
    "reward_funcs": "Ember's own toy_score; stopped = the completion ends with EOS",
    "report_to": "Ember writes metrics.jsonl, TensorBoard events and plots; TRL its log only",
    "gradient_checkpointing": "TRL's default is on, which trades time for memory",
    "disable_dropout": "the model has no dropout anyway",
    "logging_steps": "one log line per rollout, as Ember",
    "(torch threads)": "None: each Ember actor gets every core while training and rollout take "
    "turns; TRL's one process keeps torch's default (every core)",
}
"""How a TRL setting differs from the Ember setting it stands for (where it does)."""

UNMAPPED = {
    "train.max_tokens_per_micro_batch": "TRL batches by sample count only",
    "algorithm.whiten_advantages": "TRL has no batch whitening",
    "algorithm.eps_clip_c": "TRL has no dual clip",
    "train.optimizer.min_lr": "TRL's schedule for this decay style has no floor",
    "algorithm.kl_coef": "TRL has no KL penalty in the reward",
    "algorithm.kl_loss_type": "TRL's KL is k3 (Ember's low_var_kl, unclamped)",
    "algorithm.use_tis": "TRL corrects only vLLM samples; here it samples with the policy",
    "algorithm.use_rollout_log_probs": "TRL computes the old log-probs with a forward of the "
    "policy; Ember takes them from its engine (the same in fp32, ~1e-9 apart)",
    "engine.hf.dtype": "TRL samples with the policy it trains, in its dtype (exactly on-policy)",
    "ray.data_parallel": "TRL runs in one process here",
    "rollout.async": "TRL generates and trains in turn",
    "group_sampling.dynamic_filter": "TRL keeps every group",
    "plugins": "no TRL counterpart",
}
"""Ember settings without a TRL counterpart, and why; listed when the config uses them."""


def trl_mapping(config: Any, *, seed: int | None = None) -> PeerMapping:
    """The GRPOConfig equivalent of a resolved Ember run config, line by line.

    Raises:
        ValueError: The config asks for something the comparison cannot hold (another
            estimator, another task or reward, a batch that does not split evenly), naming it.
    """
    rows: list[Row] = []
    kwargs: dict[str, Any] = {}

    def add(ember, ember_value, trl, trl_value, note=False, *, kwarg=True):
        text = NOTES.get(trl_value if trl == "lr_scheduler_type" else trl, "") if note else ""
        rows.append(Row(ember, ember_value, trl, trl_value, text))
        if kwarg:
            kwargs[trl] = trl_value

    def unmapped(ember, ember_value, used):
        if used:
            rows.append(Row(ember, ember_value, "-", "-", UNMAPPED[ember]))

    roll, alg, train, opt = config.rollout, config.algorithm, config.train, config.train.optimizer
    if alg.advantage_estimator != "grpo":
        raise ValueError(
            f"algorithm.advantage_estimator={alg.advantage_estimator!r}: the peer bench compares "
            "GRPO only (TRL's GRPOTrainer)"
        )
    if config.data.prompt_data is not None or config.reward.reward_fn != "toy":
        raise ValueError(
            "data.prompt_data, reward.reward_fn: the peer bench runs the toy task and reward "
            f"(got {config.data.prompt_data!r}, {config.reward.reward_fn!r})"
        )
    group, prompts = roll.n_samples_per_prompt, roll.rollout_batch_size
    samples, steps = prompts * group, train.num_steps_per_rollout
    if samples % steps:
        raise ValueError(
            f"train.num_steps_per_rollout={steps}: must divide the {samples} samples of a rollout"
        )
    mini = samples // steps
    micro = train.micro_batch_size or mini
    if mini % micro:
        raise ValueError(f"train.micro_batch_size={micro}: must divide the mini-batch of {mini}")
    accum, rollouts = mini // micro, config.run.num_rollouts
    beta = alg.kl_loss_coef if alg.use_kl_loss else 0.0
    schedule = {
        "cosine": "cosine_warmup_with_min_lr",
        "constant": "constant_with_warmup",
        "linear": "linear",
    }[opt.lr_decay_style]
    aux = train.model_overrides.get("moe_aux_loss_coeff", 0.0)
    run = config.run

    add("rollout.n_samples_per_prompt", group, "num_generations", group)
    add("rollout.rollout_batch_size", prompts, "generation_batch_size", samples, True, kwarg=False)
    mbs = train.micro_batch_size
    add("train.micro_batch_size", mbs, "per_device_train_batch_size", micro, mbs is None)
    add("(micro-batches per step)", accum, "gradient_accumulation_steps", accum)
    add("train.num_steps_per_rollout", steps, "steps_per_generation", steps * accum, True)
    add("(passes over a rollout)", 1, "num_iterations", 1)
    unmapped("train.max_tokens_per_micro_batch", train.max_tokens_per_micro_batch,
             train.max_tokens_per_micro_batch is not None)  # fmt: skip
    add("run.num_rollouts", rollouts, "max_steps", rollouts * steps, True)
    add("rollout.temperature", roll.temperature, "temperature", roll.temperature)
    add("rollout.top_p", roll.top_p, "top_p", roll.top_p)
    add("rollout.top_k", roll.top_k, "top_k", max(roll.top_k, 0), roll.top_k < 0)
    add("rollout.max_response_len", roll.max_response_len, "max_completion_length",
        roll.max_response_len)  # fmt: skip
    add("algorithm.advantage_estimator", "grpo", "(GRPOTrainer)", "grpo", kwarg=False)
    add("algorithm.normalize_group_std", alg.normalize_group_std, "scale_rewards",
        "group" if alg.normalize_group_std else "none", alg.normalize_group_std)  # fmt: skip
    unmapped("algorithm.whiten_advantages", True, alg.whiten_advantages)
    add("algorithm.eps_clip", alg.eps_clip, "epsilon", alg.eps_clip)
    add("algorithm.eps_clip_high", alg.eps_clip_high, "epsilon_high",
        alg.eps_clip if alg.eps_clip_high is None else alg.eps_clip_high)  # fmt: skip
    unmapped("algorithm.eps_clip_c", alg.eps_clip_c, alg.eps_clip_c is not None)
    add("algorithm.use_kl_loss, kl_loss_coef", f"{alg.use_kl_loss}, {alg.kl_loss_coef}", "beta",
        beta, alg.use_kl_loss and beta == 0.0)  # fmt: skip
    unmapped("algorithm.kl_loss_type", alg.kl_loss_type, bool(beta))
    unmapped("algorithm.kl_coef", alg.kl_coef, bool(alg.kl_coef))
    add("algorithm.entropy_coef", alg.entropy_coef, "entropy_coef", alg.entropy_coef,
        bool(alg.entropy_coef) and alg.loss_reduction == "sample")  # fmt: skip
    add("algorithm.loss_reduction", alg.loss_reduction, "loss_type",
        {"sample": "grpo", "token": "bnpo"}[alg.loss_reduction], True)  # fmt: skip
    unmapped("algorithm.use_tis", True, alg.use_tis)
    unmapped("algorithm.use_rollout_log_probs", True, alg.use_rollout_log_probs)
    add("train.optimizer.lr", opt.lr, "learning_rate", opt.lr)
    add("train.optimizer.lr_warmup_steps", opt.lr_warmup_steps, "warmup_steps", opt.lr_warmup_steps)
    add("train.optimizer.lr_decay_style", opt.lr_decay_style, "lr_scheduler_type", schedule, True)
    if schedule == "cosine_warmup_with_min_lr":
        add("train.optimizer.min_lr", opt.min_lr, "lr_scheduler_kwargs", {"min_lr": opt.min_lr})
    else:
        unmapped("train.optimizer.min_lr", opt.min_lr, bool(opt.min_lr))
    if opt.lr_decay_style != "constant":
        add("train.optimizer.lr_decay_steps", opt.lr_decay_steps, "(max_steps)", rollouts * steps,
            opt.lr_decay_steps != rollouts * steps, kwarg=False)  # fmt: skip
    add("train.optimizer.weight_decay", opt.weight_decay, "weight_decay", opt.weight_decay)
    add("train.optimizer.adam_beta1", opt.adam_beta1, "adam_beta1", opt.adam_beta1)
    add("train.optimizer.adam_beta2", opt.adam_beta2, "adam_beta2", opt.adam_beta2)
    add("train.optimizer.adam_eps", opt.adam_eps, "adam_epsilon", opt.adam_eps)
    add("(torch AdamW on CPU)", "adamw", "optim", "adamw_torch")
    add("train.optimizer.clip_grad", opt.clip_grad, "max_grad_norm", opt.clip_grad)
    add("train.dtype", train.dtype, "bf16", train.dtype == "bfloat16", train.dtype == "float32")
    add("train.model (+ model_overrides)", train.model, "model", "<run>/hf_init", True, kwarg=False)
    kwargs["model_init_kwargs"] = {"dtype": "float32"}
    add("train.model_overrides.moe_aux_loss_coeff", aux, "router_aux_loss_coef", aux)
    add("engine.kind", config.engine.kind, "use_vllm", False, True)
    if config.engine.kind == "hf" and config.engine.hf.dtype == train.dtype:
        # Both sample from the weights they train, in the dtype they train them in.
        add("engine.hf.dtype", config.engine.hf.dtype, "(samples with)", train.dtype, kwarg=False)
    else:
        unmapped("engine.hf.dtype", config.engine.hf.dtype, config.engine.kind == "hf")
    add("data.toy", _toy_text(config.data.toy), "train_dataset", "same", True, kwarg=False)
    add("data.shuffle", config.data.shuffle, "shuffle_dataset", config.data.shuffle)
    add("rollout.seed, train.seed, data.seed", f"{roll.seed}, {train.seed}, {config.data.seed}",
        "seed", roll.seed if seed is None else seed, True)  # fmt: skip
    add("reward.reward_fn", "toy", "reward_funcs", "toy_score", True, kwarg=False)
    if run.save_interval:
        add("run.save_interval", run.save_interval, "save_steps", run.save_interval * steps)
        add("run.keep_checkpoints", run.keep_checkpoints, "save_total_limit", run.keep_checkpoints)
        kwargs["save_strategy"] = "steps"
    else:
        add("run.save_interval", 0, "save_strategy", "no")
    add("run.tensorboard, run.plot", f"{run.tensorboard}, {run.plot}", "report_to", "none", True)
    unmapped("ray.data_parallel", config.ray.data_parallel, config.ray.data_parallel > 1)
    threads = config.ray.threads_per_actor
    add("ray.threads_per_actor", threads, "(torch threads)", threads, threads is None, kwarg=False)
    unmapped("rollout.async", True, bool(getattr(roll, "async_", False)))
    unmapped("group_sampling.dynamic_filter", True, config.group_sampling.dynamic_filter)
    unmapped("plugins", ",".join(config.plugins), bool(config.plugins))
    for field, value in (("use_cpu", True), ("gradient_checkpointing", False),
                         ("disable_dropout", True), ("logging_steps", steps),
                         ("dataloader_num_workers", 0)):  # fmt: skip
        add("-", "-", field, value, True)
    return PeerMapping(rows=rows, kwargs=kwargs, steps_per_rollout=steps, threads=threads)


def _toy_text(toy: Any) -> str:
    return f"{toy.task} {toy.min_digits}-{toy.max_digits} digits, {toy.num_prompts} prompts"


def format_mapping(mapping: PeerMapping) -> str:
    header = ("Ember key", "value", "TRL GRPOConfig", "value", "note")
    table = [header] + [
        (r.ember, _show(r.ember_value), r.trl, _show(r.trl_value), r.note) for r in mapping.rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(4)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths, strict=True)) + "  " + row[4]
        for row in table
    ).rstrip()


def _show(value: Any) -> str:
    return "None" if value is None else str(value)


# --------------------------------------------------------------------------------------------
# Summaries (pure: records in, figures out)
# --------------------------------------------------------------------------------------------


def rollout_records(
    metrics: Sequence[dict[str, Any]], start: float
) -> list[tuple[int, float, float]]:
    """(rollout id, seconds from `start` to the record, mean reward) of each rollout record."""
    out = [
        (int(m["rollout_id"]), float(m["time"]) - start, float(m["rollout/rewards"]))
        for m in metrics
        if m.get("kind") == "rollout"
    ]
    return sorted(out)


def summarize(records: Sequence[Sequence[float]], wall_s: float | None) -> dict[str, Any]:
    """The figures of one run from its (rollout id, seconds since start, mean reward) records."""
    if not records:
        raise ValueError("no rollout records: the run finished no rollout")
    ids = [int(r[0]) for r in records]
    times = [float(r[1]) for r in records]
    rewards = [float(r[2]) for r in records]
    reach: dict[str, tuple[int, float] | None] = {}
    for threshold in THRESHOLDS:
        hit = next((i for i, r in enumerate(rewards) if r >= threshold), None)
        reach[str(threshold)] = None if hit is None else (ids[hit], times[hit])
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    best, drop = -math.inf, 0.0
    for rid, reward in zip(ids, rewards, strict=True):
        if rid >= DROP_AFTER and best > -math.inf:
            drop = max(drop, best - reward)
        best = max(best, reward)
    return {
        "rollouts": len(records),
        "wall_s": wall_s,
        "first_done_s": times[0],
        "median_s_per_rollout": statistics.median(gaps) if gaps else None,
        "last_reward": statistics.fmean(rewards[-LAST:]),
        "reach": reach,
        "max_drop": drop if ids[-1] >= DROP_AFTER else None,
    }


def spread(values: Sequence[float | None]) -> tuple[float | None, float | None, int]:
    """Mean and sample standard deviation of the values that exist, and how many exist."""
    have = [float(v) for v in values if v is not None]
    if not have:
        return None, None, 0
    return statistics.fmean(have), statistics.stdev(have) if len(have) > 1 else 0.0, len(have)


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def fmt(values: Sequence[float | None], digits: int) -> str:
    mean, std, n = spread(values)
    if mean is None:
        return f"- (0/{len(values)})"
    text = f"{mean:.{digits}f}" if len(values) == 1 else f"{mean:.{digits}f} +- {std:.{digits}f}"
    return text if n == len(values) else f"{text} ({n}/{len(values)})"


def reach_of(summary: dict[str, Any], threshold: float, part: int) -> float | None:
    hit = summary["reach"][str(threshold)]
    return None if hit is None else hit[part]


PEER_ROWS = (
    ("whole command, wall (s)", lambda s: s["wall_s"], 1),
    ("first rollout with reward >= 0.9", lambda s: reach_of(s, 0.9, 0), 1),
    ("  ... its end, s after start", lambda s: reach_of(s, 0.9, 1), 1),
    ("median seconds per rollout", lambda s: s["median_s_per_rollout"], 3),
    ("rollout 0 done, s after start", lambda s: s["first_done_s"], 1),
    (f"mean reward, last {LAST} rollouts", lambda s: s["last_reward"], 3),
)


def peer_table(summaries: dict[str, list[dict[str, Any]]]) -> str:
    """Each side's figures (mean +- std over seeds) and, with TRL there, each Ember loop's
    ratio to TRL of the means."""
    sides = [s for s in ("ember", IN_TURN, "trl") if summaries.get(s)]
    against = [s for s in sides if s != "trl"] if "trl" in sides else []
    ratio_names = {"ember": "Ember/TRL", IN_TURN: "in turn/TRL"}
    lines = [
        f"{'':<34}"
        + "".join(f"{NAMES[s]:>22}" for s in sides)
        + "".join(f"{ratio_names[s]:>13}" for s in against)
    ]
    for label, get, digits in PEER_ROWS:
        values = {s: [get(x) for x in summaries[s]] for s in sides}
        line = f"{label:<34}" + "".join(f"{fmt(values[s], digits):>22}" for s in sides)
        trl = spread(values["trl"])[0] if against else None
        line += "".join(f"{ratio(spread(values[s])[0], trl):>13}" for s in against)
        lines.append(line)
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Running the two sides
# --------------------------------------------------------------------------------------------


def task_dir(out: Path, task: str, min_digits: int, max_digits: int, seed: int | None) -> Path:
    return (
        out
        / f"{task}-{min_digits}-{max_digits}"
        / ("seed-config" if seed is None else f"seed{seed}")
    )


def read_metrics_file(run_dir: Path) -> list[dict[str, Any]]:
    """The records of `run_dir/metrics.jsonl` (Ember's format; the TRL worker writes it too)."""
    from ember.metrics import read_metrics

    return list(read_metrics(run_dir))


def _run(cmd: list[str], log: Path) -> tuple[float, float]:
    """Run `cmd` with its output in `log`; returns (start time, wall seconds)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as handle:
        start = time.time()
        code = subprocess.call(cmd, stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT)
        wall = time.time() - start
    if code != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-30:])
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed (exit {code}); {log} ends with:\n{tail}")
    return start, wall


def run_ember(where: Path, sets: list[str], side: str = "ember") -> dict[str, Any]:
    """One Ember run in `where/<side>`: the default loop, or with `side` IN_TURN the in-turn
    loop (`IN_TURN_SETS` on top of `sets`)."""
    run_dir = where / side
    extra = list(IN_TURN_SETS) if side == IN_TURN else []
    cmd = ["uv", "run", "ember", "train", *set_args([*sets, *extra, f"run.dir={run_dir}"])]
    start, wall = _run(cmd, where / f"{side}.log")
    records = rollout_records(read_metrics_file(run_dir), start)
    return save_result(run_dir, side, sets, cmd, wall, records)


def run_trl(where: Path, sets: list[str], seed: int | None) -> dict[str, Any]:
    config = load_run_config(sets)
    mapping = trl_mapping(config, seed=seed)
    init = where / "ember" / "hf_init"
    if not (init / "config.json").is_file() or not (init / "tokenizer_config.json").is_file():
        init = where / "init"
        if not (init / "tokenizer_config.json").is_file():
            print(f"  exporting Ember's initial weights to {init}", flush=True)
            cmd = [sys.executable, __file__, "--export-init", str(init), *set_args(sets)]
            _run(cmd, where / "export.log")
    trl_dir = where / "trl"
    trl_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "model": str(init),
        "dir": str(trl_dir),
        "toy": dataclasses.asdict(config.data.toy),
        "steps_per_rollout": mapping.steps_per_rollout,
        "threads": mapping.threads,
        "grpo": {**mapping.kwargs, "output_dir": str(trl_dir / "trl_output")},
    }
    (trl_dir / "spec.json").write_text(json.dumps(spec, indent=2))
    cmd = [sys.executable, __file__, "--trl-worker", str(trl_dir / "spec.json")]
    start, wall = _run(cmd, where / "trl.log")
    records = rollout_records(read_metrics_file(trl_dir), start)
    return save_result(trl_dir, "trl", sets, cmd, wall, records)


def save_result(directory: Path, side: str, sets: list[str], cmd: list[str], wall: float,
                records: list) -> dict[str, Any]:  # fmt: skip
    """Write one finished run's figures: its Ember overrides, command, wall time and records."""
    result = {"side": side, "sets": sets, "command": cmd, "wall_s": wall, "records": records}
    (directory / RESULT).write_text(json.dumps(result))
    return result


def load_result(directory: Path, sets: list[str] | None = None) -> dict[str, Any] | None:
    """A finished run's figures, if there are some (and, given `sets`, for those overrides)."""
    path = directory / RESULT
    if not path.is_file():
        return None
    result = json.loads(path.read_text())
    return result if sets is None or result.get("sets") == list(sets) else None


REEXEC_ENV = "EMBER_BENCH_PEER_GROUP"
"""Set when the bench re-ran itself with the `peer` group, so it does so at most once."""


def require_trl() -> None:
    """Make sure TRL can be imported: without it, run this command again through
    `uv run --group peer` (once), or say how to install it."""
    if importlib.util.find_spec("trl") is not None:
        return
    uv = shutil.which("uv")
    if uv is not None and not os.environ.get(REEXEC_ENV):
        print("TRL is not installed here: running again with `uv run --group peer`", flush=True)
        argv = [uv, "run", "--group", "peer", "python", *sys.argv]
        os.execve(uv, argv, {**os.environ, REEXEC_ENV: "1"})
    raise SystemExit(
        "TRL is not installed here: it lives in the `peer` dependency group, run "
        "`uv run --group peer python tools/...`"
    )


def run_pair(
    where: Path,
    sets: list[str],
    seed: int | None,
    only: str | None,
    *,
    reuse: bool = False,
    in_turn: bool = False,
) -> dict[str, dict[str, Any]]:
    """Ember (and with `in_turn` its in-turn loop), then TRL, on the same work in `where`
    (results already there are kept when `reuse`); returns each side's summary."""
    out = {}
    sides = ("ember", IN_TURN, "trl") if in_turn else SIDES
    for side in sides:
        if only not in (None, "ember" if side == IN_TURN else side):
            continue
        directory = where / side
        result = load_result(directory, sets) if reuse else None
        if result is None:
            print(f"  {NAMES[side]}: running ({where})", flush=True)
            shutil.rmtree(directory, ignore_errors=True)  # Ember appends to a metrics file
            if side == "trl":
                result = run_trl(where, sets, seed)
            else:
                result = run_ember(where, sets, side)
        else:
            print(f"  {side}: kept ({directory / RESULT})", flush=True)
        out[side] = summarize(result["records"], result["wall_s"])
    return out


# --------------------------------------------------------------------------------------------
# The two helper processes: TRL's training and the export of Ember's initial weights
# --------------------------------------------------------------------------------------------


def make_toy_reward(eos_token_id: int, sink: list[float] | None = None):
    """TRL's reward function for the toy task: Ember's `toy_score` on each completion, which
    counts as stopped when it ends with EOS. Appends each call's mean (one call per rollout)
    to `sink`."""
    from ember_rollout.toy_task import toy_score

    def toy(completions, completion_ids, label, **_):
        scores = [
            toy_score(text, str(answer), stopped=bool(ids) and ids[-1] == eos_token_id)
            for text, ids, answer in zip(completions, completion_ids, label, strict=True)
        ]
        if sink is not None:
            sink.append(statistics.fmean(scores))
        return scores

    return toy


def trl_worker(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    if spec["threads"]:
        import torch

        torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from ember_rollout.config import ToyTaskConfig
    from ember_rollout.toy_task import make_toy_prompts

    steps = spec["steps_per_rollout"]
    metrics = (Path(spec["dir"]) / "metrics.jsonl").open("w")
    rewards: list[float] = []

    class RolloutClock(TrainerCallback):
        """One Ember-shaped record at the end of each rollout's last optimizer step."""

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % steps == 0:
                rid = state.global_step // steps - 1
                record = {
                    "kind": "rollout",
                    "rollout_id": rid,
                    "step": rid,
                    "time": time.time(),
                    "rollout/rewards": rewards[rid],
                }
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()

    tokenizer = AutoTokenizer.from_pretrained(spec["model"], padding_side="left")
    args = GRPOConfig(**spec["grpo"])
    expected = spec["grpo"]["per_device_train_batch_size"] * spec["grpo"]["steps_per_generation"]
    assert args.generation_batch_size == expected, (args.generation_batch_size, expected)
    dataset = Dataset.from_list(make_toy_prompts(ToyTaskConfig(**spec["toy"])))
    trainer = GRPOTrainer(
        model=spec["model"],
        reward_funcs=make_toy_reward(tokenizer.eos_token_id, rewards),
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[RolloutClock()],
    )
    trainer.train()
    metrics.close()


def export_init(path: str, sets: list[str]) -> None:
    """Write the initial weights an Ember run with these overrides starts from, as its driver
    does (the actor's export plus the tokenizer), without running it."""
    from ember.config import load_config
    from ember_megatron_backend.parallel import init_distributed
    from ember_megatron_backend.worker import MegatronWorker
    from ember_rollout.tokenizer import save_tokenizer_for_model

    config, plugins = load_config(None, overrides=sets)
    init_distributed(config.train.parallel)
    worker = MegatronWorker(config.train, config.algorithm, config.rollout, plugins)
    worker.export_hf(Path(path))
    save_tokenizer_for_model(config.data.tokenizer_path, path)


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    args = parse_args(argv)
    if args.trl_worker:
        trl_worker(args.trl_worker)
        return {}
    if args.export_init:
        export_init(args.export_init, args.set)
        return {}
    if args.only != "ember":
        require_trl()
    out = args.out or ROOT / "runs" / f"bench_peer-{time.strftime('%Y%m%d-%H%M%S')}"
    seeds = args.seeds or [None]
    first = ember_overrides(
        args.task, args.min_digits, args.max_digits, args.rollouts, seeds[0], args.set
    )
    print(f"machine: {describe_machine()}")
    print(
        f"task {args.task}, {args.min_digits}-{args.max_digits} digits, {args.rollouts} "
        f"rollouts, seeds {args.seeds or 'of the config'}; output in {out}"
    )
    print(f"Ember: uv run ember train {' '.join('--set ' + s for s in first)}")
    print(format_mapping(trl_mapping(load_run_config(first), seed=seeds[0])))
    summaries: dict[str, list[dict[str, Any]]] = {s: [] for s in SIDES}
    for seed in seeds:
        sets = ember_overrides(
            args.task, args.min_digits, args.max_digits, args.rollouts, seed, args.set
        )
        where = task_dir(out, args.task, args.min_digits, args.max_digits, seed)
        for side, summary in run_pair(where, sets, seed, args.only, in_turn=args.in_turn).items():
            summaries.setdefault(side, []).append(summary)
    print()
    print(
        f"{args.task} {args.min_digits}-{args.max_digits} digits, {args.rollouts} rollouts, "
        f"{len(seeds)} seed(s) ({' '.join(map(str, args.seeds)) if args.seeds else 'config'}):"
    )
    print(peer_table(summaries))
    print(f"machine at the end: {describe_machine()}")
    return summaries


if __name__ == "__main__":
    main()
