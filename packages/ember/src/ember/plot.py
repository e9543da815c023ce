"""`ember plot RUN_DIR`: PNG curves of a run's rewards, KL, entropy, mismatch and routing."""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
import tempfile
from collections import defaultdict
from fnmatch import fnmatchcase
from pathlib import Path

from ember.metrics import read_metrics

logger = logging.getLogger(__name__)

DRAW = "draw"
"""What `PlotProcess.draw` tells its child."""
PLOT_TIMEOUT_S = 300.0
"""How long the end of a run waits for its plots before it stops the child and says so."""

PANELS: dict[str, tuple[str, ...]] = {
    "reward": ("rollout/rewards", "eval/*/reward", "eval/*/pass@*"),
    "kl": ("train/kl_loss", "train/ppo_kl"),
    "entropy": ("rollout/entropy", "train/entropy_loss"),
    "mismatch": ("rollout/train_rollout_logprob_abs_diff",),
    "routing": ("rollout/routing_agreement", "rollout/replay_agreement"),
}
"""Each output file (`<name>.png`) and the metric keys it draws (shell-style patterns), where the
run logged them."""


def plot_run(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """Write one PNG per panel that has data, plus `curves.png` with all of them.

    Returns:
        The files written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    out_dir = Path(out_dir) if out_dir else run_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    # Every panel's x-axis is the rollout: a rollout's n train steps sit at id + k / n.
    records = list(read_metrics(run_dir))
    steps_per_rollout: dict[int, int] = defaultdict(int)
    for record in records:
        if record.get("kind") == "train":
            steps_per_rollout[record["rollout_id"]] += 1
    seen: dict[int, int] = defaultdict(int)
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for record in records:
        rollout_id = record["rollout_id"]
        x = float(rollout_id)
        if record.get("kind") == "train":
            x += seen[rollout_id] / steps_per_rollout[rollout_id]
            seen[rollout_id] += 1
        for key, value in record.items():
            if "/" in key and isinstance(value, int | float):
                series[key].append((x, float(value)))
    panels = {
        name: [k for pattern in patterns for k in sorted(series) if fnmatchcase(k, pattern)]
        for name, patterns in PANELS.items()
    }
    panels = {name: keys for name, keys in panels.items() if keys}
    if not panels:
        raise ValueError(f"{run_dir}: metrics.jsonl holds none of the plotted metrics yet")

    written = []
    combined, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax_all, (name, keys) in zip(axes[0], panels.items(), strict=True):
        fig, ax = plt.subplots(figsize=(5, 3.4))
        for target in (ax, ax_all):
            for key in keys:
                xs, ys = zip(*series[key], strict=True)
                target.plot(xs, ys, marker="." if len(xs) < 50 else None, label=key)
            target.set_title(name)
            target.set_xlabel("rollout")
            target.grid(alpha=0.3)
            target.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    combined.tight_layout()
    path = out_dir / "curves.png"
    combined.savefig(path, dpi=110)
    plt.close(combined)
    written.append(path)
    return written


class PlotProcess:
    """A run's end-of-run plots, drawn by a child process started with the run.

    The child imports matplotlib at once (1.3-1.6 s on a 2-core AMD EPYC), on a core the run
    leaves idle (an in-process run's start-up and loop compute on one thread), and waits for
    `draw`; the run's end then costs the drawing alone (0.2-0.5 s there), alongside the
    actors' shutdown. Drawn on a thread of the run's own process instead, the import and the
    drawing held its GIL and the shutdown that waited on them: 2.8 s from the last checkpoint to
    the command's exit of a 20-rollout default run, against 0.9 s without plots. A run that ends
    without `draw` (an error) closes the child's input and it exits having drawn nothing; so
    does a child whose run was killed.
    """

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self._drawing = False
        self._errors = tempfile.TemporaryFile(mode="w+")
        self._process = subprocess.Popen(
            [sys.executable, "-m", "ember.plot", str(self.run_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=self._errors,
            text=True,
        )

    def draw(self) -> None:
        """Tell the child to draw the run's metrics as they are now (it runs on alone)."""
        self._drawing = True
        with contextlib.suppress(OSError):  # it died already: `finish` says so
            self._process.stdin.write(DRAW + "\n")
        self._close_input()

    def _close_input(self) -> None:
        with contextlib.suppress(OSError):  # a child that died leaves a broken pipe
            self._process.stdin.close()

    def finish(self, timeout: float = PLOT_TIMEOUT_S) -> bool:
        """Wait for the child; with `draw` called, log a warning naming what went wrong, if
        anything did. Returns whether the plots were written."""
        self._close_input()  # without `draw`, the child exits having drawn nothing
        try:
            self._process.wait(timeout=timeout)
            self._errors.seek(0)
            err = self._errors.read()
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
            err = f"no plots after {timeout:g} s"
        finally:
            self._errors.close()
        if not self._drawing:
            return False
        if self._process.returncode == 0:
            return True
        lines = [line for line in err.splitlines() if line.strip()]
        why = lines[-1] if lines else f"exit status {self._process.returncode}"
        logger.warning(
            "plotting failed (%s); `ember plot %s` draws the plots again", why, self.run_dir
        )
        return False


def _draw_when_told(run_dir: str) -> int:
    """The child of `PlotProcess`: import matplotlib, wait for the word, draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401

    if sys.stdin.readline().strip() != DRAW:  # the run ended without asking
        return 0
    try:
        plot_run(Path(run_dir))
    except Exception as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_draw_when_told(*sys.argv[1:]))
