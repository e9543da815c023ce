"""Where the start-up and shutdown of `ember train` go: a timeline across processes.

Runs `ember train` (by default the default job for one rollout) with `EMBER_STARTUP_TRACE` set,
then prints each process's steps in time order, in seconds after the command started, with the
gap since the previous line of the same process; last, the command's own wall time.

    uv run python tools/profile_startup.py [--rollouts N] [-- extra ember train arguments]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import describe_machine  # noqa: E402

from ember.startup import TRACE_ENV  # noqa: E402


def read_trace(path: Path) -> list[tuple[float, str, str]]:
    rows = []
    for line in path.read_text().splitlines():
        when, process, step = line.split("\t")
        rows.append((float(when), process, step))
    return sorted(rows)


def timeline(rows: list[tuple[float, str, str]], start: float) -> list[str]:
    last: dict[str, float] = {}
    lines = [f"{'at (s)':>7} {'+ (s)':>6}  {'process':<16} step"]
    for when, process, step in rows:
        name = process.split("[")[0]
        gap = when - last.get(process, when)
        last[process] = when
        lines.append(f"{when - start:7.2f} {gap:6.2f}  {name:<16} {step}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rollouts", type=int, default=1)
    parser.add_argument("extra", nargs="*", help="more `ember train` arguments (after --)")
    args = parser.parse_args(argv)
    print(describe_machine())
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.tsv"
        run_dir = Path(tmp) / "run"
        cmd = [
            sys.executable, "-m", "ember.cli", "train",
            "--set", f"run.num_rollouts={args.rollouts}", "--set", f"run.dir={run_dir}",
            *args.extra,
        ]  # fmt: skip
        env = {**os.environ, TRACE_ENV: str(trace)}
        start = time.time()
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        wall = time.time() - start
        print("\n".join(timeline(read_trace(trace), start)))
    print(f"{wall:7.2f}         command exited (wall {wall:.2f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
