"""Ember against TRL's GRPOTrainer on the same work: wall time, time to a reward, s/rollout.

    uv run python tools/bench_peer.py [--task copy|reverse|sort|shift]
        [--min-digits N] [--max-digits N] [--rollouts N] [--seeds S ...] [--only ember|trl]
        [--out DIR] [--set key=value ...]
    uv run python tools/bench_peer.py --config CONFIG [--rollouts N] [--seeds S ...] ...
    either: [--thresholds T ...] [--first N] [--last N] [--no-in-turn] [--ray] [--keep]

TRL lives in the `peer` dependency group, which the default install leaves out; when it is
missing, the bench runs itself again through `uv run --group peer`, which installs it. Both
sides run one after the other, each as a command of its own: Ember as `uv run ember train
[CONFIG] --set ...` (the default config, or `--config`, plus the bench's overrides), TRL as a
fresh Python process driving `trl.GRPOTrainer`. TRL's `GRPOConfig`, dataset and reward are
derived from the resolved Ember config; the bench prints every setting's mapping before it
runs, and says where a setting cannot be mapped or where the two differ in detail (Ember's
per-sample token mean, `algorithm.loss_reduction=sample`, is TRL's `loss_type=grpo`; a constant
rate after Ember's warm-up is TRL's `cosine_warmup_with_min_lr` with `min_lr_rate` 1, whose
warm-up is Ember's, where `constant_with_warmup` would start from 0). TRL gets its own CPU
setup: no vLLM, `use_cpu`, fp32 (no bf16 autocast), no gradient checkpointing (it only trades
time for memory).

Two kinds of work:

- The toy task (default; `--task`, `--min-digits`, `--max-digits` pick it): a model from random
  initialisation. Both start from the same weights (the `hf_init/` that Ember exports at the
  start of its run; with `--only trl`, an export of the same initial weights) and the same toy
  tokenizer (saved in that directory).
- Any run config (`--config examples/smollm2-arith.yaml`): with `train.hf_load` (and no
  `train.model_overrides`), TRL loads that same checkpoint directory and its tokenizer (or
  `data.tokenizer_path`), in fp32; otherwise Ember's export, as above. Its prompts
  are `data.prompt_data`'s, one row per line: chat messages become TRL's conversational
  `prompt` column, so TRL formats them with the same tokenizer's chat template (the TRL process
  checks the token ids against Ember's own encoding), and the label is a column. The bench turns
  the config's evaluations off (`run.eval_interval=0`, unless `--set` gives it): TRL runs none.

On both, TRL's reward function calls Ember's own (`reward.reward_fn`, through Ember's scorer,
on each completion with its label; a completion stopped when it ends with a stop id), and the
same prompts come from the same file or `data.toy` section (each side shuffles them with its own
stream).

Ember runs twice: its default overlapped loop, and its in-turn loop (`rollout.async=false`,
which generates and then trains as TRL does; `--no-in-turn` skips it, and so does a config
that is in turn already). Both run as the config says (`ray.enabled`: by default in one
process where every role fits one); `--ray` adds a third run, the default loop with every role
a Ray actor (`ray.enabled=true`), to compare the two runtimes on the same work. The bench
prints the machine it ran on (processor, vector extensions, cores, load) before and after.
Per side it prints the whole command's wall time;
for each threshold, the first rollout whose mean reward reaches it (its index, and the seconds
from the command's start to the end of that rollout's training); the median seconds per rollout
(from one rollout's end to the next) and the mean response length in tokens (generation's work
follows it: each side's own sampling sets it); when rollout 0 was done (start-up included); the mean
reward over the first `--first` (10) and the last `--last` rollouts; and the peak RSS of the
command's processes (sampled every second from the bench's own process: for Ember the driver,
Ray's processes and the actors; for TRL its process; on both the math reward's verifier), summed
over them (shared pages count once per process) and of the largest one; then each Ember loop's
ratio to TRL. Thresholds (`--thresholds`) are mean rewards (`0.9`) or a gain over the mean of
the first rollouts (`+0.25`); the toy task's default is 0.5 and 0.9 with `--last 20`, prompt
data's +0.25 with `--last 10` (a pretrained model starts where it is). With several `--seeds`
(each sets rollout.seed, train.seed and data.seed, so the toy task's initial weights change
with it) it prints mean +- standard deviation over seeds. For a decaying schedule the bench
sets `train.optimizer.lr_decay_steps` to rollouts x optimizer steps per rollout (800 for the
default 200 x 4), so both schedules decay over the run, unless `--set` gives it.
`ray.threads_per_actor` also sets the TRL process's torch threads (unset: torch's default, one
per core, as each Ember actor gets while rollout and training take turns). Time the two on an
otherwise idle machine: when other processes hold the cores, torch's threads wait on each
other (on a loaded 2-core machine one fwd+bwd of the tiny model over 64 samples took 3 s with 2
threads, 0.05 s with 1).

Runs go to `--out` (default runs/bench_peer-<timestamp>): per task (`copy-3-3`, or the config's
file name) and seed, Ember's run directory (`ember/`) and TRL's (`trl/`: its metrics in Ember's
format, spec, checkpoints), each with a `result.json` (records, wall time, memory), and both
commands' logs. With `--keep`, a run already in `--out` with the same config and overrides is
not run again: its `result.json` goes into the table, so a long comparison can be run a side or
a seed at a time (`--only`, `--seeds`) and printed whole at the end. The bench draws every
side's mean reward per rollout, each seed and their mean, in `<out>/<work>/curves.png`.
`tools/bench_learning.py` runs the learning comparison (several toy tasks x seeds) on the same
code.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from machine import describe_machine  # noqa: E402
from peer_figures import (  # noqa: E402
    FIRST,
    LAST,
    LAST_PROMPT_DATA,
    NAMES,
    RELATIVE_THRESHOLDS,
    THRESHOLDS,
    parse_threshold,
    peer_rows,
    peer_table,
    plot_curves,
    response_tokens,
    rollout_records,
    summarize,
    watch_command,
)

SIDES = ("ember", "trl")
"""The two sides every comparison runs (`tools/bench_learning.py` too)."""
IN_TURN = "ember_inturn"
"""Ember's in-turn loop (`rollout.async=false`: generate, then train, as TRL does), which
bench_peer runs beside its overlapped default unless `--no-in-turn`."""
IN_TURN_SETS = ("rollout.async=false",)
ON_RAY = "ember_ray"
"""The side of Ember's default loop with every role a Ray actor (`--ray`)."""
ON_RAY_SETS = ("ray.enabled=true",)
RESULT = "result.json"


# --------------------------------------------------------------------------------------------
# Arguments and overrides
# --------------------------------------------------------------------------------------------


def build_parser(description: str = "") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description or __doc__.splitlines()[0])
    parser.add_argument("--task", choices=("copy", "reverse", "sort", "shift"),
                        default=None)  # fmt: skip
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
    parser.add_argument(
        "--ray",
        action="store_true",
        help="also run Ember's default loop with every role a Ray actor (ray.enabled=true), "
        "beside the default (in one process where the run fits one)",
    )
    parser.add_argument("--out", type=Path, default=None, help="output directory")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="Ember config override"
    )
    parser.add_argument("--trl-worker", metavar="SPEC", help=argparse.SUPPRESS)
    parser.add_argument("--export-init", metavar="DIR", help=argparse.SUPPRESS)
    return parser


def _threshold(text: str):
    try:
        return parse_threshold(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The bench's arguments: the toy task, digits and rollouts default to the config's, the
    thresholds and the last-N window to the kind of work's (toy task or prompt data)."""
    parser = build_parser()
    parser.add_argument(
        "--config", default=None, help="an Ember run config (its prompts, reward and settings)"
    )
    parser.add_argument("--thresholds", type=_threshold, nargs="+", default=None, metavar="T",
                        help="mean rewards (0.9) or gains over the first mean (+0.25)")  # fmt: skip
    parser.add_argument("--first", type=int, default=FIRST, metavar="N",
                        help=f"rollouts of the first mean reward (default {FIRST})")  # fmt: skip
    parser.add_argument("--keep", action="store_true",
                        help="keep the runs already in --out with the same overrides")  # fmt: skip
    parser.add_argument("--last", type=int, default=None, metavar="N",
                        help=f"rollouts of the last mean reward ({LAST}; {LAST_PROMPT_DATA} on "
                        "prompt data)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.trl_worker or args.export_init:
        return args
    if args.config is not None:
        given = [f for f in ("task", "min_digits", "max_digits") if getattr(args, f) is not None]
        if given:
            parser.error(f"--{given[0].replace('_', '-')}: the toy task's; --config runs the "
                         "config's own work")  # fmt: skip
        args.config = config_argument(args.config)
    try:
        base = load_run_config(args.set, args.config)
    except ValueError as exc:
        parser.error(str(exc))
    toy = base.data.toy
    if args.config is None or base.data.prompt_data is None:
        args.task = args.task or toy.task
        args.min_digits = toy.min_digits if args.min_digits is None else args.min_digits
        args.max_digits = toy.max_digits if args.max_digits is None else args.max_digits
    prompt_data = base.data.prompt_data is not None
    args.rollouts = base.run.num_rollouts if args.rollouts is None else args.rollouts
    if args.thresholds is None:
        args.thresholds = list(RELATIVE_THRESHOLDS if prompt_data else THRESHOLDS)
    if args.last is None:
        args.last = LAST_PROMPT_DATA if prompt_data else LAST
    if args.task is not None and not 1 <= args.min_digits <= args.max_digits:
        raise SystemExit(f"digits {args.min_digits}-{args.max_digits}: expected 1 <= min <= max")
    for flag in ("rollouts", "first", "last"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag} {getattr(args, flag)}: expected >= 1")
    if args.seeds is not None and len(set(args.seeds)) != len(args.seeds):
        raise SystemExit(f"--seeds {args.seeds}: each seed once")
    if args.config is None:
        args.work = f"{args.task}-{args.min_digits}-{args.max_digits}"
        args.title = f"task {args.task}, {args.min_digits}-{args.max_digits} digits"
    else:
        args.work = Path(args.config).stem
        data = base.data.prompt_data or f"the toy task {toy.task} {toy.min_digits}-{toy.max_digits}"
        args.title = f"{args.config}: {data}, reward {base.reward.reward_fn}"
    return args


def config_argument(text: str) -> str:
    """A `--config` file as the commands (run from the repository root) read it: relative to
    the root when it lies below it; an example's name stays as it is."""
    path = Path(text).resolve()
    if not path.is_file():
        return text
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def set_args(sets: Sequence[str]) -> list[str]:
    """`--set` arguments for each override."""
    return [arg for s in sets for arg in ("--set", s)]


def load_run_config(overrides: Sequence[str], config: str | None = None) -> Any:
    """The resolved Ember run config: `config` (None: the default one) with the overrides."""
    from ember.config import load_config

    run_config, _ = load_config(config, overrides=list(overrides))
    return run_config


def ember_overrides(
    task: str | None,
    min_digits: int | None,
    max_digits: int | None,
    rollouts: int,
    seed: int | None,
    user_sets: Sequence[str],
    *,
    config: str | None = None,
) -> list[str]:
    """The `--set` list of one Ember run of `config` (None: the default one): the toy task and
    its length (`task` None: the config's own work), the run's length, the schedule's horizon,
    no evaluation and the seeds, then the user's own overrides (which win)."""
    base = load_run_config(user_sets, config)
    steps = base.train.num_steps_per_rollout
    own = {s.split("=", 1)[0].strip() for s in user_sets}
    sets = []
    if task is not None:
        sets += [
            f"data.toy.task={task}",
            f"data.toy.min_digits={min_digits}",
            f"data.toy.max_digits={max_digits}",
        ]
    sets.append(f"run.num_rollouts={rollouts}")
    decays = base.train.optimizer.lr_decay_style != "constant"
    if decays and "train.optimizer.lr_decay_steps" not in own:
        sets.append(f"train.optimizer.lr_decay_steps={rollouts * steps}")
    if base.run.eval_interval and "run.eval_interval" not in own:
        sets.append("run.eval_interval=0")  # TRL evaluates nothing here
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
    "shuffle": "TRL always shuffles a rollout's samples before it splits them into steps; Ember "
    "with false keeps arrival order (whole prompt groups per step)",
    "top_k": "TRL's 0 keeps every token",
    "scale_rewards": "both divide by the unbiased group std, + 1e-6 in Ember, + 1e-4 in TRL",
    "beta": "no KL in either loss; Ember still runs the reference forward for its logged KL, "
    "TRL loads no reference at beta 0",
    "entropy_coef": "TRL's bonus is the token mean over the micro-batch; Ember reduces the "
    "entropy like the loss (per-sample mean)",
    "loss_type": "grpo: mean over each sample's tokens, then over samples (bnpo: over tokens)",
    "cosine_warmup_with_min_lr": "same warm-up (step s: lr*(s+1)/warmup); TRL's cosine decay "
    "runs one step ahead",
    "(constant)": "the same: Ember's warm-up (step s: lr*(s+1)/warmup), then lr; TRL's cosine "
    "from lr to min_lr = lr (its constant_with_warmup starts from lr 0)",
    "linear": "TRL warms up from lr 0 and decays to 0, not to min_lr",
    "max_steps": "rollouts x optimizer steps per rollout; TRL's schedule decays over it",
    "(max_steps)": "differs: Ember decays over lr_decay_steps, TRL over max_steps",
    "bf16": "fp32 weights and math on both sides",
    "model": "Ember's export of its initial weights (and toy tokenizer), loaded in fp32",
    "(model)": "the same checkpoint directory Ember loads, in fp32",
    "processing_class": "the same tokenizer directory (chat template, stop ids)",
    "use_vllm": "TRL generates with transformers' generate() on the policy it trains",
    "train_dataset": "make_toy_prompts of the same data.toy section",
    "(train_dataset)": "each line's prompt as TRL's `prompt` column (chat messages: "
    "conversational, the same chat template; token ids checked against Ember's) and label",
    "seed": "same initial weights (hf_init); the sampling and shuffling streams differ",
    "(metadata)": "each line's metadata reaches the reward as its samples' metadata",
    "(seed)": "same initial weights (train.hf_load); the sampling and shuffling streams differ",
    "reward_funcs": "Ember's own function through its scorer, per completion with its label; "
    "stopped = it ends with a stop id",
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
    "train.micro_batches_by_length": "TRL's micro-batches take the samples in order; the steps "
    "train on the same samples either way, only the padding differs",
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
    "run.eval_interval": "TRL evaluates nothing here (the bench sets 0 unless --set gives it)",
}
"""Ember settings without a TRL counterpart, and why; listed when the config uses them."""
ONE_STEP_LOG_PROBS = (
    "neither runs a scoring forward: with one optimizer step per rollout TRL takes the "
    "policy's own log-probs as the old ones (ratio 1), Ember the engine's (the same in fp32)"
)


def trl_mapping(config: Any, *, seed: int | None = None) -> PeerMapping:
    """The GRPOConfig equivalent of a resolved Ember run config, line by line.

    A line's note is the NOTES entry of its TRL setting (of the schedule's name for
    lr_scheduler_type), or of the key `add` is given instead.

    Raises:
        ValueError: The config asks for something the comparison cannot hold (another
            estimator, an unknown reward, a batch that does not split evenly), naming it.
    """
    from ember_rollout.rewards import resolve_reward

    rows: list[Row] = []
    kwargs: dict[str, Any] = {}

    def add(ember, ember_value, trl, trl_value, note: bool | str = False, *, kwarg=True):
        key = note if isinstance(note, str) else trl_value if trl == "lr_scheduler_type" else trl
        text = NOTES.get(key, "") if note else ""
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
    resolve_reward(config.reward.reward_fn)  # TRL calls it: an unknown name fails here
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
        "constant": "cosine_warmup_with_min_lr",  # with min_lr = lr: Ember's warm-up, then lr
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
    add("train.shuffle_mini_batches", train.shuffle_mini_batches, "(shuffles the batch)", True,
        "shuffle", kwarg=False)  # fmt: skip
    unmapped("train.max_tokens_per_micro_batch", train.max_tokens_per_micro_batch,
             train.max_tokens_per_micro_batch is not None)  # fmt: skip
    unmapped("train.micro_batches_by_length", True, train.micro_batches_by_length)
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
    if alg.use_rollout_log_probs and steps == 1:
        rows.append(Row("algorithm.use_rollout_log_probs", True, "-", "-", ONE_STEP_LOG_PROBS))
    else:
        unmapped("algorithm.use_rollout_log_probs", True, alg.use_rollout_log_probs)
    add("train.optimizer.lr", opt.lr, "learning_rate", opt.lr)
    add("train.optimizer.lr_warmup_steps", opt.lr_warmup_steps, "warmup_steps", opt.lr_warmup_steps)
    constant = opt.lr_decay_style == "constant"
    add("train.optimizer.lr_decay_style", opt.lr_decay_style, "lr_scheduler_type", schedule,
        "(constant)" if constant else True)  # fmt: skip
    if constant:
        add("(no decay: min_lr = lr)", opt.lr, "lr_scheduler_kwargs", {"min_lr_rate": 1.0})
    elif opt.lr_decay_style == "cosine":
        add("train.optimizer.min_lr", opt.min_lr, "lr_scheduler_kwargs", {"min_lr": opt.min_lr})
    else:
        unmapped("train.optimizer.min_lr", opt.min_lr, bool(opt.min_lr))
    if not constant:
        add("train.optimizer.lr_decay_steps", opt.lr_decay_steps, "(max_steps)", rollouts * steps,
            opt.lr_decay_steps != rollouts * steps, kwarg=False)  # fmt: skip
    add("train.optimizer.weight_decay", opt.weight_decay, "weight_decay", opt.weight_decay)
    add("train.optimizer.adam_beta1", opt.adam_beta1, "adam_beta1", opt.adam_beta1)
    add("train.optimizer.adam_beta2", opt.adam_beta2, "adam_beta2", opt.adam_beta2)
    add("train.optimizer.adam_eps", opt.adam_eps, "adam_epsilon", opt.adam_eps)
    add("(torch AdamW on CPU)", "adamw", "optim", "adamw_torch")
    add("train.optimizer.clip_grad", opt.clip_grad, "max_grad_norm", opt.clip_grad)
    add("train.dtype", train.dtype, "bf16", train.dtype == "bfloat16", train.dtype == "float32")
    data, checkpoint = config.data, starts_from_checkpoint(config)
    if checkpoint:
        add("train.hf_load", train.hf_load, "model", train.hf_load, "(model)", kwarg=False)
        tokenizer = _run_tokenizer(config) or train.hf_load
        add("data.tokenizer_path", data.tokenizer_path, "processing_class", tokenizer, True,
            kwarg=False)  # fmt: skip
    else:
        add("train.model (+ model_overrides)", train.model, "model", "<run>/hf_init", True,
            kwarg=False)  # fmt: skip
    kwargs["model_init_kwargs"] = {"dtype": "float32"}
    add("train.model_overrides.moe_aux_loss_coeff", aux, "router_aux_loss_coef", aux)
    add("engine.kind", config.engine.kind, "use_vllm", False, True)
    if config.engine.kind == "hf" and config.engine.hf.dtype == train.dtype:
        # Both sample from the weights they train, in the dtype they train them in.
        add("engine.hf.dtype", config.engine.hf.dtype, "(samples with)", train.dtype, kwarg=False)
    else:
        unmapped("engine.hf.dtype", config.engine.hf.dtype, config.engine.kind == "hf")
    if data.prompt_data is None:
        add("data.toy", _toy_text(data.toy), "train_dataset", "same", True, kwarg=False)
    else:
        add("data.prompt_data", data.prompt_data, "train_dataset", "same", "(train_dataset)",
            kwarg=False)  # fmt: skip
        if data.metadata_key is not None:
            add("data.metadata_key", data.metadata_key, "(metadata column)", data.metadata_key,
                "(metadata)", kwarg=False)  # fmt: skip
    add("data.shuffle", data.shuffle, "shuffle_dataset", data.shuffle)
    add("rollout.seed, train.seed, data.seed", f"{roll.seed}, {train.seed}, {data.seed}",
        "seed", roll.seed if seed is None else seed, "(seed)" if checkpoint else True)  # fmt: skip
    add("reward.reward_fn", config.reward.reward_fn, "reward_funcs",
        f"Ember's {config.reward.reward_fn}", True, kwarg=False)  # fmt: skip
    if run.save_interval:
        add("run.save_interval", run.save_interval, "save_steps", run.save_interval * steps)
        add("run.keep_checkpoints", run.keep_checkpoints, "save_total_limit", run.keep_checkpoints)
        kwargs["save_strategy"] = "steps"
    else:
        add("run.save_interval", 0, "save_strategy", "no")
    if run.eval_interval:
        unmapped("run.eval_interval", run.eval_interval, True)
    else:
        add("run.eval_interval", 0, "eval_strategy", "no")
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


def starts_from_checkpoint(config: Any) -> bool:
    """Whether the run starts from a transformers checkpoint as it is (`train.hf_load`, no
    `model_overrides`), which TRL then loads itself; otherwise TRL loads Ember's export of its
    initial weights."""
    return config.train.hf_load is not None and not config.train.model_overrides


def _run_tokenizer(config: Any) -> str | None:
    from ember.config import run_tokenizer_path

    return run_tokenizer_path(config)


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
# Running the two sides
# --------------------------------------------------------------------------------------------


def work_dir(out: Path, work: str, seed: int | None) -> Path:
    """Where one seed of one piece of work (`copy-3-3`, a config's file name) runs."""
    return out / work / ("seed-config" if seed is None else f"seed{seed}")


def task_dir(out: Path, task: str, min_digits: int, max_digits: int, seed: int | None) -> Path:
    return work_dir(out, f"{task}-{min_digits}-{max_digits}", seed)


def read_metrics_file(run_dir: Path) -> list[dict[str, Any]]:
    """The records of `run_dir/metrics.jsonl` (Ember's format; the TRL worker writes it too)."""
    from ember.metrics import read_metrics

    return list(read_metrics(run_dir))


def _run(cmd: list[str], log: Path) -> tuple[float, float, dict[str, Any]]:
    """Run `cmd` with its output in `log`; returns (start time, wall seconds, the memory
    report of `watch_command`)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    code, start, wall, memory = watch_command(cmd, cwd=ROOT, log=log)
    if code != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-30:])
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed (exit {code}); {log} ends with:\n{tail}")
    return start, wall, memory


def run_ember(
    where: Path, sets: list[str], side: str = "ember", config: str | None = None
) -> dict[str, Any]:
    """One Ember run of `config` (None: the default) in `where/<side>`: the default loop, or
    with `side` IN_TURN the in-turn loop (`IN_TURN_SETS` on top of `sets`), with ON_RAY the
    default loop under Ray (`ON_RAY_SETS`)."""
    run_dir = where / side
    extra = list({IN_TURN: IN_TURN_SETS, ON_RAY: ON_RAY_SETS}.get(side, ()))
    cmd = ["uv", "run", "ember", "train", *([config] if config else []),
           *set_args([*sets, *extra, f"run.dir={run_dir}"])]  # fmt: skip
    start, wall, memory = _run(cmd, where / f"{side}.log")
    metrics = read_metrics_file(run_dir)
    return save_result(run_dir, side, sets, cmd, wall, rollout_records(metrics, start),
                       config=config, memory=memory, tokens=response_tokens(metrics))  # fmt: skip


def run_trl(
    where: Path, sets: list[str], seed: int | None, config_path: str | None = None
) -> dict[str, Any]:
    config = load_run_config(sets, config_path)
    mapping = trl_mapping(config, seed=seed)
    if starts_from_checkpoint(config):
        model = config.train.hf_load
        tokenizer = _run_tokenizer(config) or model
    else:
        init = where / "ember" / "hf_init"
        if not (init / "config.json").is_file() or not (init / "tokenizer_config.json").is_file():
            init = where / "init"
            if not (init / "tokenizer_config.json").is_file():
                print(f"  exporting Ember's initial weights to {init}", flush=True)
                cmd = [sys.executable, __file__, "--export-init", str(init), *set_args(sets),
                       *(["--config", config_path] if config_path else [])]  # fmt: skip
                _run(cmd, where / "export.log")
        model = tokenizer = str(init)
    trl_dir = where / "trl"
    trl_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "model": model,
        "tokenizer": tokenizer,
        "dir": str(trl_dir),
        "config": config_path,
        "sets": list(sets),
        "steps_per_rollout": mapping.steps_per_rollout,
        "threads": mapping.threads,
        "grpo": {**mapping.kwargs, "output_dir": str(trl_dir / "trl_output")},
    }
    (trl_dir / "spec.json").write_text(json.dumps(spec, indent=2))
    cmd = [sys.executable, __file__, "--trl-worker", str(trl_dir / "spec.json")]
    start, wall, memory = _run(cmd, where / "trl.log")
    metrics = read_metrics_file(trl_dir)
    return save_result(trl_dir, "trl", sets, cmd, wall, rollout_records(metrics, start),
                       config=config_path, memory=memory,
                       tokens=response_tokens(metrics))  # fmt: skip


def save_result(directory: Path, side: str, sets: list[str], cmd: list[str], wall: float,
                records: list, *, config: str | None = None,
                memory: dict[str, Any] | None = None,
                tokens: float | None = None) -> dict[str, Any]:  # fmt: skip
    """Write one finished run's figures: its config and overrides, command, wall time, records,
    memory report and mean response length."""
    result = {"side": side, "config": config, "sets": sets, "command": cmd, "wall_s": wall,
              "records": records, "memory": memory, "tokens": tokens}  # fmt: skip
    (directory / RESULT).write_text(json.dumps(result))
    return result


def load_result(
    directory: Path, sets: list[str] | None = None, config: str | None = None
) -> dict[str, Any] | None:
    """A finished run's figures, if there are some (and, given `sets`, for that config and
    those overrides)."""
    path = directory / RESULT
    if not path.is_file():
        return None
    result = json.loads(path.read_text())
    if sets is None:
        return result
    same = result.get("sets") == list(sets) and result.get("config") == config
    return result if same else None


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
    on_ray: bool = False,
    config: str | None = None,
    figures: dict[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """Ember (and with `in_turn` its in-turn loop, with `on_ray` its default loop under Ray),
    then TRL, on the same work in `where` (results already there are kept when `reuse`);
    returns each side's summary (`figures`: `summarize`'s thresholds, first and last)."""
    out = {}
    sides = ("ember", *([IN_TURN] if in_turn else []), *([ON_RAY] if on_ray else []), "trl")
    for side in sides:
        if only not in (None, "ember" if side in (IN_TURN, ON_RAY) else side):
            continue
        directory = where / side
        result = load_result(directory, sets, config) if reuse else None
        if result is None:
            print(f"  {NAMES[side]}: running ({where})", flush=True)
            shutil.rmtree(directory, ignore_errors=True)  # Ember appends to a metrics file
            if side == "trl":
                result = run_trl(where, sets, seed, config)
            else:
                result = run_ember(where, sets, side, config)
        else:
            print(f"  {side}: kept ({directory / RESULT})", flush=True)
        out[side] = summarize(result["records"], result["wall_s"], memory=result.get("memory"),
                              tokens=result.get("tokens"), **(figures or {}))  # fmt: skip
    return out


# --------------------------------------------------------------------------------------------
# The export of Ember's initial weights (TRL's process: peer_trl.py)
# --------------------------------------------------------------------------------------------


def export_init(path: str, sets: list[str], config_path: str | None = None) -> None:
    """Write the initial weights an Ember run with these overrides starts from, as its driver
    does (the actor's export plus the tokenizer), without running it."""
    from ember.config import load_config, run_tokenizer_path
    from ember_megatron_backend.parallel import init_distributed
    from ember_megatron_backend.worker import MegatronWorker
    from ember_rollout.tokenizer import save_tokenizer_for_model

    config, plugins = load_config(config_path, overrides=sets)
    init_distributed(config.train.parallel)
    worker = MegatronWorker(
        config.train,
        config.algorithm,
        config.rollout,
        plugins,
        quantization=config.engine.quant_spec(),  # `train.qat` refuses a worker without it
    )
    worker.export_hf(Path(path))
    save_tokenizer_for_model(run_tokenizer_path(config), path)


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    args = parse_args(argv)
    if args.trl_worker:
        from peer_trl import trl_worker

        trl_worker(args.trl_worker)
        return {}
    if args.export_init:
        export_init(args.export_init, args.set, args.config)
        return {}
    if args.only != "ember":
        require_trl()
    out = args.out or ROOT / "runs" / f"bench_peer-{time.strftime('%Y%m%d-%H%M%S')}"
    seeds = args.seeds or [None]

    def sets_for(seed: int | None) -> list[str]:
        return ember_overrides(args.task, args.min_digits, args.max_digits, args.rollouts, seed,
                               args.set, config=args.config)  # fmt: skip

    first = sets_for(seeds[0])
    # A config that already generates and trains in turn would run the same loop twice.
    in_turn = args.in_turn and load_run_config(first, args.config).rollout.async_
    print(f"machine: {describe_machine()}")
    print(
        f"{args.title}, {args.rollouts} rollouts, seeds {args.seeds or 'of the config'}; "
        f"output in {out}"
    )
    print(f"Ember: uv run ember train {args.config + ' ' if args.config else ''}"
          f"{' '.join('--set ' + s for s in first)}")  # fmt: skip
    print(format_mapping(trl_mapping(load_run_config(first, args.config), seed=seeds[0])))
    figures = {"thresholds": args.thresholds, "first": args.first, "last": args.last}
    summaries: dict[str, list[dict[str, Any]]] = {s: [] for s in SIDES}
    for seed in seeds:
        where = work_dir(out, args.work, seed)
        pair = run_pair(where, sets_for(seed), seed, args.only, reuse=args.keep,
                        in_turn=in_turn, on_ray=args.ray, config=args.config,
                        figures=figures)  # fmt: skip
        for side, summary in pair.items():
            summaries.setdefault(side, []).append(summary)
    print()
    print(
        f"{args.title}, {args.rollouts} rollouts, {len(seeds)} seed(s) "
        f"({' '.join(map(str, args.seeds)) if args.seeds else 'config'}):"
    )
    print(peer_table(summaries, peer_rows(args.thresholds, args.first, args.last)))
    curves = plot_curves(summaries, out / args.work / "curves.png", args.title)
    print(f"curves: {curves}")
    print(f"machine at the end: {describe_machine()}")
    return summaries


if __name__ == "__main__":
    main()
