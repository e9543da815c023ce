"""Benchmark weight transfer: driver peak memory and push time, broadcast vs the object store.

Each measurement runs in a fresh driver process (peak RSS only grows within a process) that
joins one local Ray the table's process starts for the four of them (`ray.address`): the
default config's training rank and embedded `hf` engine (one each, one thread each), the
trainer's weights pushed `--pushes` times, one path per process:

- broadcast: Ember's transfer (`weights.transport: broadcast`): the training rank packs the
  weights into flattened buckets (in the engine's dtype, `engine.hf.dtype`: float32 in the
  default config) and broadcasts them over gloo
  to the engine; the driver opens and closes the engine's session;
- object store: the path Ember used before, kept here for the comparison only: the training
  rank returns CPU copies of every tensor (the parameters' dtype, fp32) as a Ray object, the
  driver passes its reference to the engine actor, which fetches and loads it.

The first push is shown apart (the broadcast forms its process group then, the object store
path warms up); the median of the others is what the ratio compares. Two model sizes: the
`tiny-moe` preset and a larger one built from it in code (`PRESETS["large"]`: more layers,
wider experts; about 10x the parameters).

Targets (issue 14): driver peak RSS, large / tiny, <= 1.1 (the driver never holds weights);
median push time on the large model, broadcast / object store, <= 0.5.

Usage: uv run python tools/bench_weights.py [--pushes 11] [--bucket-mb 512]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ember  # noqa: F401  (sets Ray's environment variables before Ray is imported)

PRESETS: dict[str, list[str]] = {
    "tiny-moe": [],
    "large": [
        "train.model_overrides.num_layers=8",
        "train.model_overrides.moe_ffn_hidden_size=224",
    ],
}
"""Model sizes: `train.model_overrides` applied to the default config's tiny-moe preset."""
PATHS = ("broadcast", "object store")
TARGET_RSS = 1.1
TARGET_TIME = 0.5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pushes", type=int, default=11, help="pushes per measurement (>= 2)")
    parser.add_argument("--bucket-mb", type=int, default=512, help="weights.bucket_mb")
    parser.add_argument("--child", nargs=2, metavar=("PRESET", "PATH"), help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)  # the Ray a child joins
    args = parser.parse_args(argv)
    if args.pushes < 2:
        parser.error("--pushes must be >= 2 (the first push is reported apart)")
    return args


# --------------------------------------------------------------------------------------------
# One measurement (a child process): build a run's actors, push, report
# --------------------------------------------------------------------------------------------


def _cpu_copies(rank: Any) -> list | None:
    """The old path's trainer side (in the training rank): CPU copies, returned by rank 0."""
    keep = rank.rank == 0
    out = [(n, t.detach().to("cpu", copy=True)) for n, t in rank.worker.hf_weights()]
    return out if keep else None


def _load_tensors(actor: Any, named: list, version: str) -> None:
    """The old path's engine side (in the engine actor): load the fetched tensors."""
    actor.loop.run_until_complete(
        actor.engine.update_weights_from_tensors(named, weight_version=version)
    )


def _perturb(rank: Any) -> None:
    import torch

    with torch.no_grad():
        for param in rank.worker.actor.parameters():
            param.add_(1e-3)


def _ready(actor: Any) -> None:
    """Nothing: answered once the actor has finished starting."""


def _sums(named: Any) -> tuple[float, float]:
    """Sum and sum of magnitudes of every weight of `(name, tensor)` pairs, in float64."""
    tensors = [t.detach().double() for _, t in named]
    return float(sum(t.sum() for t in tensors)), float(sum(t.abs().sum() for t in tensors))


def _trainer_sums(rank: Any) -> tuple[float, float]:
    """`_sums` of the trainer's weights under HF names: what the engine should serve."""
    return _sums(rank.worker.hf_weights())


def _served(actor: Any) -> tuple[str | None, float]:
    """The engine's weight version and the sum of the weights it serves."""
    engine = actor.engine
    return engine.weight_version, _sums(engine.model.named_parameters())[0]


def _count(rank: Any) -> tuple[int, int]:
    """Parameters and fp32 bytes of the trainer's weights (under HF names)."""
    numel = sum(t.numel() for _, t in rank.worker.hf_weights())
    return numel, numel * 4


def measure(preset: str, path: str, pushes: int, bucket_mb: int, address: str) -> dict[str, Any]:
    import ray

    from ember.config import load_config
    from ember.driver import Driver

    overrides = [
        *PRESETS[preset],
        "ray.enabled=true",  # the object store path is Ray's: every role a Ray actor
        "ray.threads_per_actor=1",
        f"ray.address={address}",
        "ray.object_store_mb=null",  # sizes a Ray the run starts
        f"weights.bucket_mb={bucket_mb}",
        "weights.transport=broadcast",
        "run.tensorboard=false",
        "run.plot=false",
    ]
    config, _ = load_config("default", overrides=overrides)
    with tempfile.TemporaryDirectory() as run_dir:
        driver = Driver(config, Path(run_dir))
        driver.start()
        try:
            driver.build()
            train, engines = driver.actors.train, driver.actors.engines
            numel, nbytes = ray.get(train[0].__ray_call__.remote(_count))
            ray.get([e.__ray_call__.remote(_ready) for e in engines])  # engines have loaded
            times = []
            for i in range(pushes):
                ray.get([t.__ray_call__.remote(_perturb) for t in train])
                start = time.perf_counter()
                if path == "broadcast":
                    driver.push_weights(i)
                else:
                    refs = [t.__ray_call__.remote(_cpu_copies) for t in train]
                    loads = [e.__ray_call__.remote(_load_tensors, refs[0], str(i)) for e in engines]
                    ray.get(refs[1:] + loads)
                times.append(time.perf_counter() - start)
            # A push that did not land would time nothing: every engine must serve the last
            # push's version and the trainer's weights. An engine in bf16 would round them (2^-9
            # relative at most), so the sums must agree within 2^-8 of the weights' magnitudes;
            # one missed push is off by 1e-3 per weight (`_perturb`), over ten times that bound
            # for either model.
            wanted, magnitude = ray.get(train[0].__ray_call__.remote(_trainer_sums))
            for version, served in ray.get([e.__ray_call__.remote(_served) for e in engines]):
                if version != str(pushes - 1) or abs(served - wanted) > magnitude * 2**-8:
                    raise RuntimeError(
                        f"{preset} / {path}: the engine serves version {version!r} with weights "
                        f"summing to {served!r}, not push {pushes - 1}'s from the trainer "
                        f"({wanted!r} within {magnitude * 2**-8:.3g})"
                    )
        finally:
            driver.shutdown()
            ray.shutdown()
    return {
        "preset": preset,
        "path": path,
        "params": numel,
        "engine_dtype": config.engine.hf.dtype,
        "fp32_bytes": nbytes,
        "first_s": times[0],
        "median_s": statistics.median(times[1:]),
        # Linux reports ru_maxrss in KiB.
        "driver_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


# --------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------


def run_child(preset: str, path: str, args: argparse.Namespace, address: str) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", preset, path, "--address", address]
    command += ["--pushes", str(args.pushes), "--bucket-mb", str(args.bucket_mb)]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ})
    if done.returncode != 0:
        sys.exit(f"{preset} / {path} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def ratio_line(label: str, ours: float, theirs: float, unit: str, target: float) -> None:
    value = ours / theirs
    verdict = "met" if value <= target else "NOT met"
    print(f"{label}: {ours:.3f} vs {theirs:.3f} {unit} -> {value:.2f}x", end=" ")
    print(f"(target <= {target}: {verdict})")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        preset, path = args.child
        print(json.dumps(measure(preset, path, args.pushes, args.bucket_mb, args.address)))
        return
    # One local Ray for the four measurements, started once ("local": never a running one).
    # Its processes (GCS, raylet, the workers) are not the driver's, whose RSS is measured,
    # started or joined alike. The children inherit its token's settings from this process.
    import ray

    context = ray.init(
        address="local", num_cpus=2, include_dashboard=False, object_store_memory=256 * 2**20
    )
    try:
        address = context.address_info["gcs_address"]
        rows = {(p, q): run_child(p, q, args, address) for p in PRESETS for q in PATHS}
    finally:
        ray.shutdown()
    engine_dtype = rows[("tiny-moe", "broadcast")]["engine_dtype"]
    print(
        f"weight transfer: 1 training rank -> 1 hf engine ({engine_dtype}), CPU, "
        f"{args.pushes} pushes each (first apart), weights.bucket_mb={args.bucket_mb}"
    )
    print(
        f"{'model':<10}{'params':>10}{'fp32 MB':>9}  {'path':<14}{'first s':>9}"
        f"{'median s':>10}{'driver peak RSS MB':>20}"
    )
    for (preset, path), row in rows.items():
        print(
            f"{preset:<10}{row['params'] / 1e6:>9.2f}M{row['fp32_bytes'] / 2**20:>9.1f}  "
            f"{path:<14}{row['first_s']:>9.3f}{row['median_s']:>10.3f}"
            f"{row['driver_peak_rss_mb']:>20.0f}"
        )
    tiny, large = rows[("tiny-moe", "broadcast")], rows[("large", "broadcast")]
    scale = large["params"] / tiny["params"]
    print(f"large / tiny-moe parameters: {scale:.1f}x")
    ratio_line(
        "driver peak RSS, broadcast, large vs tiny-moe",
        large["driver_peak_rss_mb"],
        tiny["driver_peak_rss_mb"],
        "MB",
        TARGET_RSS,
    )
    old = rows[("large", "object store")]
    ratio_line(
        "median push time, large, broadcast vs object store",
        large["median_s"],
        old["median_s"],
        "s",
        TARGET_TIME,
    )
    if not math.isclose(old["params"], large["params"]):
        print("warning: the two paths measured different models")


if __name__ == "__main__":
    main()
