"""Benchmark PolicyHead's chunked log-probs against a naive full log_softmax + gather."""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

from ember_core.heads import DEFAULT_CHUNK_BYTES, PolicyHead

VARIANTS = ("naive", "chunked")
PASSES = ("forward", "fwd+bwd")
TEMPERATURE = 0.7


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=8192, help="packed tokens T")
    parser.add_argument("--vocab", type=int, default=32768, help="vocabulary size V")
    parser.add_argument("--samples", type=int, default=4, help="samples packed into T")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per variant")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES)
    parser.add_argument("--no-backward", action="store_true", help="skip the fwd+bwd lines")
    parser.add_argument("--mode", choices=("all", "memory", "time"), default="all")
    parser.add_argument("--variant", choices=VARIANTS, help="memory mode: the variant to run")
    parser.add_argument("--pass", dest="pass_", choices=PASSES, default="forward")
    return parser.parse_args(argv)


def packed_lengths(args: argparse.Namespace) -> tuple[list[int], list[int]]:
    """Sample and response lengths packing T tokens; responses are most of each sample."""
    base = args.rows // args.samples
    total_lengths = [base] * args.samples
    total_lengths[-1] += args.rows - sum(total_lengths)
    fractions = (0.85, 0.7, 0.8, 0.9)
    response_lengths = [int(n * fractions[i % 4]) for i, n in enumerate(total_lengths)]
    return total_lengths, response_lengths


def make_batch(args: argparse.Namespace):
    """Packed fp32 logits [T, V], tokens [T] and the lengths."""
    generator = torch.Generator().manual_seed(0)
    logits_TV = torch.empty(args.rows, args.vocab).normal_(0.0, 2.0, generator=generator)
    tokens_T = torch.randint(0, args.vocab, (args.rows,), generator=generator)
    return (logits_TV, tokens_T, *packed_lengths(args))


def naive(logits_TV, tokens_T, total_lengths, response_lengths, with_entropy):
    """Full-size log_softmax of the scaled logits, then per-sample gathers."""
    log_probs_TV = torch.log_softmax(logits_TV / TEMPERATURE, dim=-1)
    entropy_T = -(log_probs_TV.exp() * log_probs_TV).sum(-1) if with_entropy else None
    log_probs, entropy = [], []
    start = 0
    for length, response in zip(total_lengths, response_lengths, strict=True):
        rows = slice(start + length - response - 1, start + length - 1)
        targets = tokens_T[start + length - response : start + length]
        log_probs.append(log_probs_TV[rows].gather(1, targets[:, None])[:, 0])
        if with_entropy:
            entropy.append(entropy_T[rows])
        start += length
    return log_probs, entropy


def chunked(head, logits_TV, tokens_T, total_lengths, response_lengths, with_entropy):
    out = head.log_probs(logits_TV, tokens_T, total_lengths, response_lengths, with_entropy)
    return out.log_probs, out.entropy or []


def run_once(variant, pass_, head, logits_TV, tokens_T, total_lengths, response_lengths):
    """One forward (log-probs) or forward+backward (log-probs and entropy) pass."""
    backward = pass_ == "fwd+bwd"
    logits_TV.requires_grad_(backward)
    logits_TV.grad = None
    batch = (logits_TV, tokens_T, total_lengths, response_lengths, backward)
    if variant == "naive":
        log_probs, entropy = naive(*batch)
    else:
        log_probs, entropy = chunked(head, *batch)
    if backward:
        # Fixed upstream weights stand in for a policy-gradient loss plus an entropy bonus.
        loss = sum(lp.sum() * 1e-3 for lp in log_probs) - sum(h.sum() * 1e-4 for h in entropy)
        loss.backward()
    logits_TV.requires_grad_(False)
    logits_TV.grad = None


def warm_up(args: argparse.Namespace, head: PolicyHead, passes) -> None:
    """Run every variant and pass once on a tiny batch (kernel and thread-pool start-up)."""
    small = argparse.Namespace(**{**vars(args), "rows": 64, "vocab": 256, "samples": 2})
    batch = make_batch(small)
    for pass_ in passes:
        for variant in VARIANTS:
            run_once(variant, pass_, head, *batch)


def max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def memory_mode(args: argparse.Namespace) -> None:
    """Print, as JSON, the extra peak RSS of one pass of one variant beyond the logits."""
    torch.set_num_threads(args.threads)
    head = PolicyHead(TEMPERATURE, chunk_bytes=args.chunk_bytes)
    # Warm up first, on a batch small enough that its own peak stays far below the one of
    # allocating the logits, so one-off allocations are not counted.
    warm_up(args, head, [args.pass_])
    batch = make_batch(args)
    gc.collect()
    baseline = max_rss_bytes()
    run_once(args.variant, args.pass_, head, *batch)
    print(json.dumps({"baseline": baseline, "extra": max_rss_bytes() - baseline}))


def measure_memory(args: argparse.Namespace, variant: str, pass_: str) -> int:
    command = [
        sys.executable, __file__, "--mode", "memory", "--variant", variant, "--pass", pass_,
        "--rows", str(args.rows), "--vocab", str(args.vocab), "--samples", str(args.samples),
        "--threads", str(args.threads), "--chunk-bytes", str(args.chunk_bytes),
    ]  # fmt: skip
    result = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])["extra"]


def measure_time(args: argparse.Namespace, passes) -> dict[tuple[str, str], list[float]]:
    """Seconds per run for each (variant, pass), the variants alternating run by run."""
    torch.set_num_threads(args.threads)
    head = PolicyHead(TEMPERATURE, chunk_bytes=args.chunk_bytes)
    warm_up(args, head, passes)
    batch = make_batch(args)
    times: dict[tuple[str, str], list[float]] = {}
    for pass_ in passes:
        reps = args.reps if pass_ == "forward" else backward_reps(args)
        for _ in range(reps):
            for variant in VARIANTS:
                gc.collect()
                start = time.perf_counter()
                run_once(variant, pass_, head, *batch)
                times.setdefault((variant, pass_), []).append(time.perf_counter() - start)
    return times


def backward_reps(args: argparse.Namespace) -> int:
    return max(1, (args.reps + 1) // 2)  # the naive fwd+bwd is slow


def main() -> None:
    args = parse_args()
    if args.mode == "memory":
        if args.variant is None:
            sys.exit("--mode memory needs --variant")
        memory_mode(args)
        return
    passes = PASSES[:1] if args.no_backward else PASSES
    logits_bytes = args.rows * args.vocab * 4
    response_rows = sum(packed_lengths(args)[1])
    print(
        f"PolicyHead (chunked) vs naive log_softmax(logits / T) + gather: T={args.rows}, "
        f"V={args.vocab}, fp32 logits {logits_bytes / 2**30:.2f} GiB, {args.samples} samples, "
        f"{response_rows} response rows, temperature {TEMPERATURE}, {args.threads} threads, "
        f"chunk_bytes {args.chunk_bytes / 2**20:g} MiB"
    )
    memory = {}
    if args.mode == "all":
        memory = {(v, p): measure_memory(args, v, p) for p in passes for v in VARIANTS}
    runs = {key: sorted(values) for key, values in measure_time(args, passes).items()}
    times = {key: statistics.median(values) for key, values in runs.items()}
    print(f"{'pass':<8} {'variant':<8} {'extra peak RSS':>14} {'x logits':>9} "
          f"{'median time':>12} {'min time':>9}  runs")  # fmt: skip
    for p in passes:
        for v in VARIANTS:
            extra = memory.get((v, p))
            mib = "-" if extra is None else f"{extra / 2**20:.0f} MiB"
            ratio = "-" if extra is None else f"{extra / logits_bytes:.3f}x"
            print(f"{p:<8} {v:<8} {mib:>14} {ratio:>9} {times[(v, p)]:>10.3f} s "
                  f"{runs[(v, p)][0]:>7.3f} s  {len(runs[(v, p)])}")  # fmt: skip
    print("forward: log-probs only, no autograd; fwd+bwd: log-probs and entropy, backward of a "
          "weighted sum (its extra includes the [T, V] gradient, 1.0x logits).")  # fmt: skip
    print("Extra peak RSS: ru_maxrss of a fresh process after one pass minus after allocating the "
          "logits; times alternate naive and chunked run by run.")  # fmt: skip
    if memory:
        mem_ratio = memory[("chunked", "forward")] / logits_bytes
        verdict = "OK" if mem_ratio <= 0.25 else "MISSED"
        print(f"forward extra-peak-memory ratio, chunked: {mem_ratio:.3f}x logits "
              f"(target <= 0.25x) {verdict}")  # fmt: skip
    for p in passes:
        time_ratio = times[("chunked", p)] / times[("naive", p)]
        verdict = "" if p != "forward" else (" OK" if time_ratio <= 1.0 else " MISSED")
        target = " (target <= 1.0x)" if p == "forward" else ""
        print(f"{p} time ratio chunked/naive: {time_ratio:.3f}x{target}{verdict}")


if __name__ == "__main__":
    main()
