"""Benchmark the real SGLang server on CPU against the embedded engine, side by side in one run.

Three measurements, each on Ember's own export of the model (fp32, as the default run trains):

- start-up: seconds from launching the server (through the sglang engine) to its first healthy
  answer, next to the embedded engine's model load;
- seconds per rollout on the default task: one rollout's requests (`--prompts` copy-task prompts
  x `--samples` each, at most `--new-tokens` tokens, temperature 1) through each engine, the
  median of `--reps` rollouts after one warm-up; the ratio is SGLang / embedded;
- weight push per transport at two model sizes (the `tiny-moe` preset, and a larger one with
  more layers and wider experts): the median seconds of `--pushes` pushes of the whole model
  from disk (`/update_weights_from_disk`), as CPU tensors by shared-memory file name
  (`/update_weights_from_tensor`), and broadcast over gloo from Ember's weight group
  (`/update_weights_from_distributed`, `--bucket-mb` buckets), each inside the session SGLang
  requires.

Needs the sglang extra (`uv sync --extra sglang`). Takes about 8 minutes on 2 cores (two server
starts). Prints one table and the machine it ran on.

Usage: uv run python tools/bench_sglang_cpu.py [--reps 5] [--pushes 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

SIZES: dict[str, dict[str, int]] = {
    "tiny-moe": {},
    "large": {"num_layers": 8, "moe_ffn_hidden_size": 224},
}
"""Model sizes: `ModelConfig` overrides of the tiny-moe preset (the large one as in
bench_weights.py, about 10x the parameters)."""

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "packages" / "rollout" / "tests"))
sys.path.insert(0, str(ROOT / "tools"))
from machine import describe_machine  # noqa: E402

# The real-server tests' support: the export and Ember's gloo weight push, shared with them.
from sglang_real import broadcast_weights, export_tiny_moe  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32, help="prompts per rollout")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--new-tokens", type=int, default=8, help="most tokens per response")
    parser.add_argument("--reps", type=int, default=5, help="timed rollouts per engine")
    parser.add_argument("--pushes", type=int, default=5, help="timed pushes per transport")
    parser.add_argument("--bucket-mb", type=int, default=512, help="broadcast bucket size")
    parser.add_argument("--json", action="store_true", help="print one JSON line instead")
    args = parser.parse_args(argv)
    for key in ("prompts", "samples", "new_tokens", "reps", "pushes", "bucket_mb"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')}={getattr(args, key)}: expected >= 1")
    return args


def parameters(model_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(model_dir / "model.safetensors", "pt") as file:
        return sum(math.prod(file.get_slice(key).get_shape()) for key in file.keys())


def rollout_requests(args: argparse.Namespace, model_dir: Path) -> list:
    from ember_rollout.config import ToyTaskConfig
    from ember_rollout.engine import GenerateRequest, SamplingParams
    from ember_rollout.tokenizer import load_tokenizer
    from ember_rollout.toy_task import make_toy_prompts

    tokenizer = load_tokenizer(model_dir)
    task = ToyTaskConfig(num_prompts=args.prompts, min_digits=3, max_digits=3)
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in make_toy_prompts(task)]
    return [
        GenerateRequest(
            input_ids=ids,
            sampling=SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0),
            name=f"prompt {i} sample {j}",
        )
        for i, ids in enumerate(prompts)
        for j in range(args.samples)
    ]


async def timed_rollouts(engine, requests, reps: int) -> float:
    await engine.generate(requests)  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        await engine.generate(requests)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def launch(model_dir: Path, log_dir: Path):
    from ember_rollout.config import SGLangEngineConfig
    from ember_rollout.sglang_engine import SGLangEngine

    config = SGLangEngineConfig(
        model_path=str(model_dir),
        device="cpu",
        dtype="float32",
        launch_timeout_s=900,
        log_dir=str(log_dir),
    )
    return SGLangEngine(config)


async def timed_pushes(engine, model_dir: Path, args: argparse.Namespace) -> dict[str, float]:
    from safetensors.torch import load_file

    weights = load_file(model_dir / "model.safetensors")
    pushes = {
        "disk": lambda i: engine.update_weights_from_disk(model_dir, weight_version=f"d{i}"),
        "tensor": lambda i: engine.update_weights_from_tensors(weights.items()),
        "distributed": lambda i: broadcast_weights(
            engine, weights, bucket_bytes=args.bucket_mb * 2**20, version=f"b{i}"
        ),
    }
    seconds = {}
    for name, push in pushes.items():
        times = []
        for i in range(args.pushes + 1):  # the first one warms up
            start = time.perf_counter()
            await push(i)
            times.append(time.perf_counter() - start)
        seconds[name] = statistics.median(times[1:])
    return seconds


def benchmark(args: argparse.Namespace) -> dict:
    import torch

    from ember_rollout.config import HFEngineConfig
    from ember_rollout.hf_engine import HFEngine

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    result: dict = {"machine": describe_machine(), "pushes": {}, "parameters": {}}
    with tempfile.TemporaryDirectory(prefix="bench-sglang-") as tmp:
        root = Path(tmp)
        for size, overrides in SIZES.items():
            model_dir = root / size
            export_tiny_moe(model_dir, overrides=overrides)
            result["parameters"][size] = parameters(model_dir)
            engine = launch(model_dir, root / "logs")
            loop = asyncio.new_event_loop()
            try:
                start = time.perf_counter()
                loop.run_until_complete(engine.start())
                if size == "tiny-moe":
                    result["sglang_start_s"] = time.perf_counter() - start
                    requests = rollout_requests(args, model_dir)
                    result["requests"] = len(requests)
                    result["sglang_rollout_s"] = loop.run_until_complete(
                        timed_rollouts(engine, requests, args.reps)
                    )
                result["pushes"][size] = loop.run_until_complete(
                    timed_pushes(engine, model_dir, args)
                )
            finally:
                loop.run_until_complete(engine.shutdown())
                loop.close()
            if size == "tiny-moe":
                start = time.perf_counter()
                hf = HFEngine(
                    HFEngineConfig(model_path=str(model_dir), dtype="float32", max_batch_size=256)
                )
                hf.load()
                result["hf_start_s"] = time.perf_counter() - start
                result["hf_rollout_s"] = asyncio.run(timed_rollouts(hf, requests, args.reps))
    return result


def report(result: dict) -> str:
    lines = [
        f"machine: {result['machine']}",
        "",
        "| | SGLang on CPU | embedded (hf) | SGLang / embedded |",
        "| --- | --- | --- | --- |",
        f"| start-up (launch or load to ready), s | {result['sglang_start_s']:.1f} | "
        f"{result['hf_start_s']:.2f} | {result['sglang_start_s'] / result['hf_start_s']:.0f} |",
        f"| one default rollout ({result['requests']} requests), s | "
        f"{result['sglang_rollout_s']:.3f} | {result['hf_rollout_s']:.3f} | "
        f"{result['sglang_rollout_s'] / result['hf_rollout_s']:.2f} |",
        "",
        "| model (parameters) | disk, s | tensor, s | distributed (gloo), s |",
        "| --- | --- | --- | --- |",
    ]
    for size, seconds in result["pushes"].items():
        lines.append(
            f"| {size} ({result['parameters'][size] / 1e6:.2f} M) | {seconds['disk']:.3f} | "
            f"{seconds['tensor']:.3f} | {seconds['distributed']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result = benchmark(args)
    print(json.dumps(result) if args.json else report(result))
    return result


if __name__ == "__main__":
    main()
