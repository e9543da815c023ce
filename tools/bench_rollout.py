"""Benchmark the hf engine: batched KV-cached generation against uncached one-at-a-time."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from ember_rollout.config import HFEngineConfig, ToyTaskConfig
from ember_rollout.engine import GenerateRequest, SamplingParams
from ember_rollout.hf_engine import HFEngine
from ember_rollout.tokenizer import load_tokenizer
from ember_rollout.toy_task import make_toy_prompts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=64, help="requests generated")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--batch-size", type=int, default=64, help="hf engine max_batch_size")
    parser.add_argument("--model-path", default=None, help="local HF model dir (default: tiny)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON line instead")
    return parser.parse_args(argv)


def make_requests(args: argparse.Namespace) -> list[GenerateRequest]:
    """Toy-task prompts of mixed lengths; EOS ignored so every request generates the same count."""
    tokenizer = load_tokenizer(args.model_path)
    records = make_toy_prompts(
        ToyTaskConfig(num_prompts=args.prompts, min_digits=2, max_digits=8, seed=args.seed)
    )
    return [
        GenerateRequest(
            input_ids=tokenizer(r["prompt"])["input_ids"],
            sampling=SamplingParams(
                max_new_tokens=args.new_tokens,
                temperature=args.temperature,
                ignore_eos=True,
                seed=args.seed * 100_003 + i,
            ),
            name=f"request {i}",
        )
        for i, r in enumerate(records)
    ]


def timed(fn, requests):
    started = time.perf_counter()
    outputs = fn(requests)
    elapsed = time.perf_counter() - started
    return outputs, elapsed, sum(len(o.output_ids) for o in outputs)


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = HFEngine(
        HFEngineConfig(model_path=args.model_path, dtype=args.dtype, max_batch_size=args.batch_size)
    )
    engine.load()
    requests = make_requests(args)
    engine.generate_sync(requests[:2])  # warm-up: lazy kernels and allocator
    batched, t_batched, n_batched = timed(engine.generate_sync, requests)
    uncached, t_uncached, n_uncached = timed(engine.generate_uncached, requests)
    same = sum(a.output_ids == b.output_ids for a, b in zip(batched, uncached, strict=True))
    result = {
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "threads": args.threads,
        "batched_tokens_per_s": n_batched / t_batched,
        "uncached_tokens_per_s": n_uncached / t_uncached,
        "speedup": (n_batched / t_batched) / (n_uncached / t_uncached),
        "identical_requests": same,
    }
    if args.json:
        print(json.dumps({"dtype": args.dtype, **result}))
        return result
    info = engine.model_info
    model = args.model_path or (
        f"tiny Qwen3-MoE ({info.num_layers} layers, {engine.config.tiny.num_experts} experts, "
        f"top-{info.topk})"
    )
    print(
        f"bench_rollout: {args.prompts} prompts x {args.new_tokens} new tokens, {args.dtype}, "
        f"{args.threads} threads, {model}"
    )
    print(
        f"  batched KV-cached:    {n_batched} tokens in {t_batched:7.2f} s = "
        f"{result['batched_tokens_per_s']:9.1f} tokens/s"
    )
    print(
        f"  uncached one-by-one:  {n_uncached} tokens in {t_uncached:7.2f} s = "
        f"{result['uncached_tokens_per_s']:9.1f} tokens/s"
    )
    print(f"  speedup: {result['speedup']:.1f}x (target >= 3x)")
    print(f"  identical responses (same seeds): {same}/{args.prompts}")
    return result


if __name__ == "__main__":
    main()
