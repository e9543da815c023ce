"""How well Ember learns against TRL's GRPOTrainer, over several toy tasks and seeds.

    uv run --group peer python tools/bench_learning.py [--tasks copy:3 copy:2-4 ... shift:2]
        [--seeds 1 2 3] [--rollouts N] [--only ember|trl] [--out DIR] [--force] [--report]
        [--trl-out DIR] [--markdown] [--set key=value ...]

Each (task, seed) pair is one run of each side, set up exactly as `tools/bench_peer.py` sets it
up (same initial weights, tokenizer, prompts, reward and mapped hyper-parameters; the seed sets
rollout.seed, train.seed and data.seed, so the initial weights change with it). A task is
`NAME:DIGITS` or `NAME:MIN-MAX`. Results are kept in `--out` (default runs/bench_learning): a
run already there with the same overrides is not run again (`--force` reruns it), so the
comparison can be run in parts, one task or seed at a time, and `--report` prints the table
of what is there without running anything. `--trl-out` reads TRL's runs from another
directory (those run there without `--set`), so an Ember variant (`--only ember --set ...`
in its own `--out`) is compared with the same TRL runs.

Per task it prints, for each side, the mean +- sample standard deviation over seeds of the
mean reward of the last 20 rollouts, of the first rollout whose mean reward reaches 0.5, 0.7
and 0.9 ("(k/n)": only k of the n seeds got there; the mean is over those), and of the largest
fall of a rollout's mean reward below the best before it, from rollout 50 on; then the
Ember/TRL ratio of the means, and each seed's figures. Each task's curves, both sides and
every seed, go to `<out>/<task>-<min>-<max>.png`. `--markdown` ends with one table of every
task for the docs: each figure as mean +- std over seeds, then by seed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import bench_peer as peer
import peer_figures as figures

DEFAULT_TASKS = ("copy:3", "copy:2-4", "reverse:3", "sort:3", "reverse:4", "sort:4", "shift:2")
"""The four named tasks, their harder four-digit variants, and the shift family."""
DEFAULT_SEEDS = (1, 2, 3)
TASK = re.compile(r"^(copy|reverse|sort|shift):(\d+)(?:-(\d+))?$")

LEARNING_ROWS = (
    (f"mean reward, last {figures.LAST} rollouts", lambda s: s["last_reward"], 3),
    ("first rollout with reward >= 0.5", lambda s: figures.reach_of(s, 0.5, 0), 1),
    ("first rollout with reward >= 0.7", lambda s: figures.reach_of(s, 0.7, 0), 1),
    ("first rollout with reward >= 0.9", lambda s: figures.reach_of(s, 0.9, 0), 1),
    (f"largest fall below best, from {figures.DROP_AFTER}", lambda s: s["max_drop"], 3),
)


def parse_task(text: str) -> tuple[str, int, int]:
    """`copy:3` -> ("copy", 3, 3); `copy:2-4` -> ("copy", 2, 4)."""
    match = TASK.match(text.strip())
    if match is None:
        raise ValueError(f"task {text!r}: expected NAME:DIGITS or NAME:MIN-MAX, NAME one of "
                         "copy, reverse, sort, shift (for example copy:2-4)")  # fmt: skip
    low = int(match.group(2))
    high = int(match.group(3) or low)
    if not 1 <= low <= high:
        raise ValueError(f"task {text!r}: expected 1 <= MIN <= MAX digits")
    return match.group(1), low, high


def parse_args(argv: Sequence[str] | None = None):
    parser = peer.build_parser(__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS), metavar="TASK")
    parser.add_argument("--force", action="store_true", help="rerun runs that are already there")
    parser.add_argument("--report", action="store_true", help="print the table, run nothing")
    parser.add_argument("--markdown", action="store_true", help="end with a table for the docs")
    parser.add_argument("--trl-out", type=Path, default=None, metavar="DIR",
                        help="read TRL's runs (made without --set) from DIR")  # fmt: skip
    parser.set_defaults(seeds=list(DEFAULT_SEEDS), out=peer.ROOT / "runs" / "bench_learning")
    args = parser.parse_args(argv)
    for flag in ("task", "min_digits", "max_digits"):
        if getattr(args, flag) is not None:
            parser.error(f"--{flag.replace('_', '-')}: use --tasks NAME:MIN-MAX here")
    try:
        args.tasks = [parse_task(t) for t in args.tasks]
    except ValueError as exc:
        parser.error(str(exc))
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds {args.seeds}: each seed once")
    if args.rollouts is None:
        args.rollouts = peer.load_run_config(args.set).run.num_rollouts
    if args.rollouts < 1:
        parser.error(f"--rollouts {args.rollouts}: expected >= 1")
    return args


def task_summaries(out: Path, task: tuple[str, int, int], seeds: Sequence[int], sets_of,
                   trl_out: Path | None = None, trl_sets_of=None,
                   ) -> dict[str, list[dict[str, Any] | None]]:  # fmt: skip
    """Each side's summary per seed (None where that run is not there); TRL's from `trl_out`
    with `trl_sets_of`'s overrides when given."""
    found: dict[str, list[dict[str, Any] | None]] = {side: [] for side in peer.SIDES}
    for seed in seeds:
        for side in peer.SIDES:
            other = side == "trl" and trl_out is not None
            where = peer.task_dir(trl_out if other else out, *task, seed)
            result = peer.load_result(where / side, (trl_sets_of if other else sets_of)(seed))
            found[side].append(
                None if result is None else figures.summarize(result["records"], result["wall_s"])
            )
    return found


def learning_table(found: dict[str, list[dict[str, Any] | None]], seeds: Sequence[int]) -> str:
    """Per side, mean +- std over the seeds that ran; Ember/TRL ratios of the means."""
    lines = [f"{'':<38}{'Ember':>22}{'TRL':>22}{'Ember/TRL':>11}"]
    for label, get, digits in LEARNING_ROWS:
        cells, means = [], []
        for side in peer.SIDES:
            values = [get(s) for s in found[side] if s is not None]
            cells.append(figures.fmt(values, digits) if values else "not run")
            means.append(figures.spread(values)[0])
        lines.append(f"{label:<38}{cells[0]:>22}{cells[1]:>22}{figures.ratio(*means):>11}")
    for side in peer.SIDES:
        per_seed = ", ".join(
            f"{seed}: " + ("-" if s is None else f"{s['last_reward']:.3f}")
            for seed, s in zip(seeds, found[side], strict=True)
        )
        name = "Ember" if side == "ember" else "TRL"
        lines.append(f"  {name} last-{figures.LAST} by seed: {per_seed}")
        for level in (0.5, 0.7):
            per_seed = ", ".join(
                f"{seed}: " + ("-" if s is None else str(figures.reach_of(s, level, 0)))
                for seed, s in zip(seeds, found[side], strict=True)
            )
            lines.append(f"  {name} first >= {level} by seed: {per_seed}")
    return "\n".join(lines)


MARKDOWN_FIGURES = (
    ("last-20", lambda s: s["last_reward"], 3),
    ("first >= 0.5", lambda s: figures.reach_of(s, 0.5, 0), 1),
    ("first >= 0.7", lambda s: figures.reach_of(s, 0.7, 0), 1),
)


def _seed_cell(summary: dict[str, Any] | None, get, digits: int) -> str:
    if summary is None:
        return "not run"
    value = get(summary)
    if value is None:
        return "never"
    return f"{value:.{digits}f}" if digits > 1 else str(int(value))


def markdown_table(tables: dict[tuple[str, int, int], dict[str, list]]) -> str:
    """One row per task and figure: each side's mean +- std over seeds ("(k/n)" where only k
    seeds got there), then its value per seed ("never": that seed did not get there)."""
    lines = [
        "| task | figure | Ember | TRL | Ember by seed | TRL by seed |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for (name, low, high), found in tables.items():
        task = f"{name} {low}" if low == high else f"{name} {low}-{high}"
        for label, get, digits in MARKDOWN_FIGURES:
            cells, seeds = [], []
            for side in peer.SIDES:
                ran = [get(s) for s in found[side] if s is not None]
                cells.append(figures.fmt(ran, digits) if ran else "not run")
                seeds.append(", ".join(_seed_cell(s, get, digits) for s in found[side]))
            lines.append(
                f"| {task} | {label} | {cells[0]} | {cells[1]} | {seeds[0]} | {seeds[1]} |"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[tuple[str, int, int], dict[str, list]]:
    args = parse_args(argv)
    if not args.report and args.only != "ember":
        peer.require_trl()

    def sets_for(task, user_sets=args.set):
        return lambda seed: peer.ember_overrides(*task, args.rollouts, seed, user_sets)

    if not args.report:
        first = sets_for(args.tasks[0])(args.seeds[0])
        print(
            peer.format_mapping(peer.trl_mapping(peer.load_run_config(first), seed=args.seeds[0]))
        )
        for task in args.tasks:
            for seed in args.seeds:
                where = peer.task_dir(args.out, *task, seed)
                peer.run_pair(where, sets_for(task)(seed), seed, args.only, reuse=not args.force)
    tables = {}
    for task in args.tasks:
        found = task_summaries(args.out, task, args.seeds, sets_for(task), args.trl_out,
                               sets_for(task, []))  # fmt: skip
        tables[task] = found
        seeds = " ".join(map(str, args.seeds))
        title = f"{task[0]} {task[1]}-{task[2]} digits, {args.rollouts} rollouts, seeds {seeds}"
        print(f"\n{title}:")
        print(learning_table(found, args.seeds))
        drawn = {side: [s for s in runs if s is not None] for side, runs in found.items()}
        if any(drawn.values()):
            path = args.out / f"{task[0]}-{task[1]}-{task[2]}.png"
            print(f"  curves: {figures.plot_curves(drawn, path, title)}")
    if args.markdown:
        print()
        print(markdown_table(tables))
    return tables


if __name__ == "__main__":
    main()
