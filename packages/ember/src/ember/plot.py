"""`ember plot RUN_DIR`: PNG curves of a run's rewards, KL, entropy, mismatch and routing."""

from __future__ import annotations

from collections import defaultdict
from fnmatch import fnmatchcase
from pathlib import Path

from ember.metrics import read_metrics

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
