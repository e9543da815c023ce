"""The peer benches' figures: a run's rollout records in, its summary and the table out, and the
peak memory of a command's processes while it runs."""

from __future__ import annotations

import math
import statistics
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil


@dataclass(frozen=True)
class Threshold:
    """A mean reward whose first crossing is reported: `value` itself or, when `relative`, the
    mean reward of the run's first rollouts plus `value` (a real task starts where the model
    already is, which differs by model and task)."""

    value: float
    relative: bool = False

    @property
    def key(self) -> str:
        """The threshold's name in a summary's `reach` and `levels` ("0.9", "+0.25")."""
        return f"+{self.value:g}" if self.relative else str(self.value)

    def label(self, first: int) -> str:
        return f"first-{first} + {self.value:g}" if self.relative else f"{self.value:g}"


def parse_threshold(text: str) -> Threshold:
    """`0.9`: a mean reward of 0.9; `+0.25`: 0.25 above the mean of the first rollouts.

    Raises:
        ValueError: Not a finite number, with or without a leading `+`.
    """
    relative = text.strip().startswith("+")
    try:
        value = float(text.strip().removeprefix("+"))
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ValueError(
            f"threshold {text!r}: expected a mean reward (0.9) or +DELTA over the mean of the "
            "first rollouts (+0.25)"
        )
    return Threshold(value, relative)


THRESHOLDS = (Threshold(0.5), Threshold(0.7), Threshold(0.9))
"""The toy task's thresholds: it starts near 0 and ends near 1."""
RELATIVE_THRESHOLDS = (Threshold(0.25, relative=True),)
"""A task on prompt data: the pretrained model starts somewhere, the bench reports its gain."""
FIRST = 10
"""Rollouts at the start whose mean reward is reported (and relative thresholds start from)."""
LAST = 20
"""Rollouts at the end whose mean reward is reported (the toy task's)."""
LAST_PROMPT_DATA = 10
"""The same for a task on prompt data (shorter runs: a real model's rollout takes longer)."""
DROP_AFTER = 50
"""The largest fall below the running best is measured from this rollout on."""


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


def response_tokens(metrics: Sequence[dict[str, Any]]) -> float | None:
    """The mean response length in tokens over a run's rollout records
    (`rollout/response_len_mean`), None when they do not log it."""
    values = [
        float(m["rollout/response_len_mean"])
        for m in metrics
        if m.get("kind") == "rollout" and "rollout/response_len_mean" in m
    ]
    return statistics.fmean(values) if values else None


def summarize(
    records: Sequence[Sequence[float]],
    wall_s: float | None,
    *,
    thresholds: Sequence[Threshold] = THRESHOLDS,
    first: int = FIRST,
    last: int = LAST,
    memory: dict[str, Any] | None = None,
    tokens: float | None = None,
) -> dict[str, Any]:
    """The figures of one run from its (rollout id, seconds since start, mean reward) records.

    A relative threshold's level is the mean reward of the first `first` rollouts (as many as
    there are, when fewer) plus its value; the first rollout at or above a level is searched
    from rollout 0 on. `memory` is `watch_command`'s report, when there is one; `tokens` the
    run's mean response length (``response_tokens``).
    """
    if not records:
        raise ValueError("no rollout records: the run finished no rollout")
    ids = [int(r[0]) for r in records]
    times = [float(r[1]) for r in records]
    rewards = [float(r[2]) for r in records]
    first_reward = statistics.fmean(rewards[:first])
    levels: dict[str, float] = {}
    reach: dict[str, tuple[int, float] | None] = {}
    for threshold in thresholds:
        level = first_reward + threshold.value if threshold.relative else threshold.value
        hit = next((i for i, r in enumerate(rewards) if r >= level), None)
        levels[threshold.key] = level
        reach[threshold.key] = None if hit is None else (ids[hit], times[hit])
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
        "response_tokens": tokens,
        "first_reward": first_reward,
        "last_reward": statistics.fmean(rewards[-last:]),
        "rewards": rewards,
        "levels": levels,
        "reach": reach,
        "max_drop": drop if ids[-1] >= DROP_AFTER else None,
        "peak_rss_mib": memory["peak_all_mib"] if memory else None,
        "peak_process_rss_mib": (
            memory["processes"][0]["peak_mib"] if memory and memory["processes"] else None
        ),
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


def reach_of(summary: dict[str, Any], threshold: float | Threshold, part: int) -> float | None:
    """The rollout id (`part` 0) or the seconds after the start (1) at which the run first
    reached `threshold` (a Threshold, or a plain mean reward), None when it never did."""
    key = threshold.key if isinstance(threshold, Threshold) else str(threshold)
    hit = summary["reach"][key]
    return None if hit is None else hit[part]


def peer_rows(
    thresholds: Sequence[Threshold] = THRESHOLDS, first: int = FIRST, last: int = LAST
) -> list[tuple[str, Any, int]]:
    """The table's rows: (label, figure of a summary, digits)."""
    rows: list[tuple[str, Any, int]] = [("whole command, wall (s)", lambda s: s["wall_s"], 1)]
    for t in thresholds:
        rows += [
            (f"first rollout with reward >= {t.label(first)}", lambda s, t=t: reach_of(s, t, 0), 1),
            ("  ... its end, s after start", lambda s, t=t: reach_of(s, t, 1), 1),
        ]
    rows += [
        ("median seconds per rollout", lambda s: s["median_s_per_rollout"], 3),
        ("mean response tokens per sample", lambda s: s.get("response_tokens"), 1),
        ("rollout 0 done, s after start", lambda s: s["first_done_s"], 1),
        (f"mean reward, first {first} rollouts", lambda s: s.get("first_reward"), 3),
        (f"mean reward, last {last} rollouts", lambda s: s["last_reward"], 3),
        ("peak RSS, all its processes (MiB)", lambda s: s.get("peak_rss_mib"), 0),
        ("peak RSS, largest process (MiB)", lambda s: s.get("peak_process_rss_mib"), 0),
    ]
    return rows


NAMES = {
    "ember": "Ember",
    "ember_inturn": "Ember in turn",
    "ember_ray": "Ember on Ray",
    "trl": "TRL",
}
RATIO_NAMES = {"ember": "Ember/TRL", "ember_inturn": "in turn/TRL", "ember_ray": "on Ray/TRL"}


def peer_table(
    summaries: dict[str, list[dict[str, Any]]], rows: Sequence[tuple[str, Any, int]] | None = None
) -> str:
    """Each side's figures (mean +- std over seeds) and, with TRL there, each Ember loop's
    ratio to TRL of the means."""
    rows = peer_rows() if rows is None else rows
    sides = [s for s in NAMES if summaries.get(s)]
    against = [s for s in sides if s != "trl"] if "trl" in sides else []
    width = max(34, *(len(label) + 2 for label, _, _ in rows))
    lines = [
        " " * width
        + "".join(f"{NAMES[s]:>22}" for s in sides)
        + "".join(f"{RATIO_NAMES[s]:>13}" for s in against)
    ]
    for label, get, digits in rows:
        values = {s: [get(x) for x in summaries[s]] for s in sides}
        line = f"{label:<{width}}" + "".join(f"{fmt(values[s], digits):>22}" for s in sides)
        trl = spread(values["trl"])[0] if against else None
        line += "".join(f"{ratio(spread(values[s])[0], trl):>13}" for s in against)
        lines.append(line)
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Memory of a running command
# --------------------------------------------------------------------------------------------


COLORS = {
    "ember": "tab:red",
    "ember_inturn": "tab:orange",
    "ember_ray": "tab:purple",
    "trl": "tab:blue",
}


def plot_curves(summaries: dict[str, list[dict[str, Any]]], path: Path, title: str) -> Path:
    """One PNG of every side's mean reward per rollout: each seed a thin line, the mean over
    seeds a thick one (over the rollouts every seed reached)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for side, name in NAMES.items():
        runs = [s["rewards"] for s in summaries.get(side, []) if s.get("rewards")]
        if not runs:
            continue
        for rewards in runs:
            ax.plot(range(len(rewards)), rewards, color=COLORS[side], alpha=0.25, lw=0.8)
        horizon = min(map(len, runs))
        mean = [statistics.fmean(r[i] for r in runs) for i in range(horizon)]
        label = f"{name} (mean of {len(runs)} seed{'s' if len(runs) > 1 else ''})"
        ax.plot(range(horizon), mean, color=COLORS[side], lw=2.0, label=label)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("rollout")
    ax.set_ylabel("mean reward")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _title(proc: Any) -> str:
    """A process's name as it shows itself: Ray retitles its workers (`ray::RolloutEngine`)."""
    try:
        words = proc.cmdline() or [proc.name()]
    except psutil.Error:  # gone, or not ours to read
        return "?"
    head = Path(words[0]).name
    if head.startswith("ray::"):  # `ray::Actor.method` while a method runs
        head = head.split(".")[0]
    elif head.startswith("python") and "-c" in words[1:-1]:  # a multiprocessing child
        head = f"{head} -c {words[words.index('-c') + 1]}"
    elif head.startswith("python") and len(words) > 1:  # the script or module it runs
        rest = [w for w in words[1:] if not w.startswith("-")]
        head = f"{head} {Path(rest[0]).name}" if rest else head
    return head[:60]


def watch_command(
    cmd: Sequence[str], *, cwd: Path, log: Path, interval_s: float = 1.0
) -> tuple[int, float, float, dict[str, Any]]:
    """Run `cmd` with its output in `log`, sampling the RSS of it and every process below it
    every `interval_s` seconds (for `ember train`: the driver, Ray's processes and the actors,
    which Ray's raylet starts).

    Returns:
        The exit status, the start time, the wall seconds, and the memory report: the peak
        over samples of the summed RSS (`peak_all_mib`; shared pages count once per process)
        and each process's own peak, largest first (`processes`: pid, name, peak_mib).
    """
    mib = 1024.0 * 1024.0
    peaks: dict[int, dict[str, Any]] = {}
    peak_all = 0.0
    samples = 0
    with log.open("w") as handle:
        start = time.time()
        proc = subprocess.Popen(list(cmd), stdout=handle, stderr=subprocess.STDOUT, cwd=cwd)
        root = psutil.Process(proc.pid)
        code = None
        while code is None:
            total = 0.0
            try:
                tree = [root, *root.children(recursive=True)]
            except psutil.Error:  # the command ended between the wait and this sample
                tree = []
            for member in tree:
                try:
                    rss = member.memory_info().rss / mib
                except psutil.Error:
                    continue
                if not rss:  # a zombie: exited, not yet reaped
                    continue
                total += rss
                seen = peaks.setdefault(member.pid, {"pid": member.pid, "peak_mib": 0.0})
                name = _title(member)
                if name not in ("?", "ray::IDLE") or "name" not in seen:
                    seen["name"] = name
                seen["peak_mib"] = max(seen["peak_mib"], rss)
            peak_all = max(peak_all, total)
            samples += 1
            try:
                code = proc.wait(timeout=interval_s)
            except subprocess.TimeoutExpired:
                pass
        wall = time.time() - start
    processes = sorted(peaks.values(), key=lambda p: -p["peak_mib"])
    memory = {
        "interval_s": interval_s,
        "samples": samples,
        "peak_all_mib": peak_all,
        "processes": [{**p, "peak_mib": round(p["peak_mib"], 1)} for p in processes],
    }
    return code, start, wall, memory
