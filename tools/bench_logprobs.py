"""Benchmark PolicyHead's chunked log-probs against the plain PyTorch a user would write.

Both sides do the same work on the same packed fp32 logits [T, V]: the log-prob of each response
token under softmax(logits / temperature), over the rows that predict response tokens only
(R of the T rows), and in the fwd+bwd pass also the entropy there and the gradient of the
logits. The naive side selects those rows, `logits[rows]` ([R, V], cast to fp32), divides by
the temperature, takes `log_softmax`, gathers the targets and computes the entropy as
`-(p * log p).sum(-1)`; the other side is `PolicyHead.log_probs` (chunked over the same rows).

Each repetition runs naive then chunked in one process, and for each run records its time and
its extra peak RSS: the process's peak resident memory (`getrusage`'s ru_maxrss, the kernel's
high-water mark, reset before the run by writing 5 to /proc/self/clear_refs: Linux only) minus
its resident memory just before it. The table prints the
median of each over the repetitions; the ratios are the medians over repetitions of the
chunked / naive ratio within a repetition, so load shared with other processes affects both
sides of a ratio alike.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import os
import resource
import statistics
import time
from pathlib import Path

import torch

from ember_core.heads import DEFAULT_CHUNK_BYTES, PolicyHead

VARIANTS = ("naive", "chunked")
PASSES = ("forward", "fwd+bwd")
TEMPERATURE = 0.7
MEMORY_TARGET = 0.25
"""Chunked forward: extra peak memory at most this fraction of the logits' size."""
TIME_TARGET = 1.0
"""Chunked forward: time at most this fraction of the naive one."""
CLEAR_REFS = Path("/proc/self/clear_refs")
"""Writing 5 resets the process's peak RSS to its current RSS (Linux's proc(5)); no library
offers that reset."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8192, help="packed tokens T")
    parser.add_argument("--vocab", type=int, default=32768, help="vocabulary size V")
    parser.add_argument("--samples", type=int, default=4, help="samples packed into T")
    parser.add_argument("--reps", type=int, default=5, help="repetitions of each pass")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES)
    parser.add_argument("--no-backward", action="store_true", help="skip the fwd+bwd pass")
    args = parser.parse_args(argv)
    for key in ("rows", "vocab", "samples", "reps", "threads", "chunk_bytes"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')}={getattr(args, key)}: expected >= 1")
    if args.rows < 2 * args.samples:
        parser.error(f"--rows={args.rows}: expected at least 2 per sample ({args.samples})")
    return args


def packed_lengths(args: argparse.Namespace) -> tuple[list[int], list[int]]:
    """Sample and response lengths packing T tokens; responses are most of each sample."""
    base = args.rows // args.samples
    total_lengths = [base] * args.samples
    total_lengths[-1] += args.rows - sum(total_lengths)
    fractions = (0.85, 0.7, 0.8, 0.9)
    response_lengths = [max(1, int(n * fractions[i % 4])) for i, n in enumerate(total_lengths)]
    return total_lengths, response_lengths


def make_batch(args: argparse.Namespace):
    """Packed fp32 logits [T, V], tokens [T] and the lengths."""
    generator = torch.Generator().manual_seed(0)
    logits_TV = torch.empty(args.rows, args.vocab).normal_(0.0, 2.0, generator=generator)
    tokens_T = torch.randint(0, args.vocab, (args.rows,), generator=generator)
    return (logits_TV, tokens_T, *packed_lengths(args))


def naive(logits_TV, tokens_T, total_lengths, response_lengths, with_entropy):
    """What a user writes: the response rows' logits [R, V] in fp32, log_softmax, gather."""
    rows, targets = [], []
    start = 0
    for length, response in zip(total_lengths, response_lengths, strict=True):
        # Row j predicts token j + 1: rows [s + L - R - 1, s + L - 1) predict the response.
        rows.append(torch.arange(start + length - response - 1, start + length - 1))
        targets.append(tokens_T[start + length - response : start + length])
        start += length
    log_probs_RV = torch.log_softmax(logits_TV[torch.cat(rows)].float() / TEMPERATURE, dim=-1)
    log_probs_R = log_probs_RV.gather(1, torch.cat(targets)[:, None])[:, 0]
    entropy_R = -(log_probs_RV.exp() * log_probs_RV).sum(-1) if with_entropy else None
    return (
        list(torch.split(log_probs_R, response_lengths)),
        list(torch.split(entropy_R, response_lengths)) if with_entropy else [],
    )


def chunked(head, logits_TV, tokens_T, total_lengths, response_lengths, with_entropy):
    out = head.log_probs(logits_TV, tokens_T, total_lengths, response_lengths, with_entropy)
    return out.log_probs, out.entropy or []


def run_once(variant, pass_, head, logits_TV, tokens_T, total_lengths, response_lengths):
    """One forward (log-probs) or forward+backward (log-probs and entropy) pass.

    Returns:
        The per-sample log-probs, the entropy (empty in the forward pass) and the gradient of
        the logits (None in the forward pass).
    """
    backward = pass_ == "fwd+bwd"
    logits_TV.requires_grad_(backward)
    logits_TV.grad = None
    batch = (logits_TV, tokens_T, total_lengths, response_lengths, backward)
    if variant == "naive":
        log_probs, entropy = naive(*batch)
    else:
        log_probs, entropy = chunked(head, *batch)
    grad = None
    if backward:
        # Fixed upstream weights stand in for a policy-gradient loss plus an entropy bonus.
        loss = sum(lp.sum() * 1e-3 for lp in log_probs) - sum(h.sum() * 1e-4 for h in entropy)
        loss.backward()
        grad = logits_TV.grad
    logits_TV.requires_grad_(False)
    logits_TV.grad = None
    return log_probs, entropy, grad


def _peak_rss_kib() -> int:
    """The process's peak resident memory since the last reset (KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _libc_malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


MALLOC_TRIM = _libc_malloc_trim()
"""glibc's malloc_trim: hands freed heap pages back to the OS, so a run that reuses them counts
them again in its own peak (without it, memory freed by the previous run is resident already)."""


def reset_peak_rss() -> int | None:
    """Reset the peak RSS to the current RSS and return it (KiB); None where the OS cannot."""
    if MALLOC_TRIM is not None:
        MALLOC_TRIM(0)
    try:
        CLEAR_REFS.write_text("5")
        return _peak_rss_kib()
    except (OSError, AttributeError):
        return None


def measure(variant, pass_, head, batch, memory: bool) -> tuple[float, int | None]:
    """Seconds and extra peak RSS (bytes; None without `memory`) of one run."""
    gc.collect()
    before = reset_peak_rss() if memory else None
    start = time.perf_counter()
    outputs = run_once(variant, pass_, head, *batch)
    elapsed = time.perf_counter() - start
    extra = None if before is None else (_peak_rss_kib() - before) * 1024
    del outputs
    return elapsed, extra


def benchmark(args: argparse.Namespace) -> dict:
    """Time and extra peak memory of every (pass, variant) over `args.reps` repetitions."""
    torch.set_num_threads(args.threads)
    head = PolicyHead(TEMPERATURE, chunk_bytes=args.chunk_bytes)
    passes = PASSES[:1] if args.no_backward else PASSES
    memory = reset_peak_rss() is not None
    # Warm up on a batch small enough that one-off allocations (thread pools, kernels) are made
    # before any measured run.
    small = argparse.Namespace(**{**vars(args), "rows": 64, "vocab": 256, "samples": 2})
    for pass_ in passes:
        for variant in VARIANTS:
            run_once(variant, pass_, head, *make_batch(small))
    batch = make_batch(args)
    runs: dict[tuple[str, str], list[tuple[float, int | None]]] = {}
    for pass_ in passes:
        for _ in range(args.reps):
            for variant in VARIANTS:
                runs.setdefault((pass_, variant), []).append(
                    measure(variant, pass_, head, batch, memory)
                )
    return {"passes": passes, "memory": memory, "runs": runs}


def summarize(result: dict) -> dict[str, dict[str, float | None]]:
    """Medians per (pass, variant) and median chunked/naive ratios per pass."""
    runs = result["runs"]
    summary: dict[str, dict[str, float | None]] = {}
    for pass_ in result["passes"]:
        naive_runs, chunked_runs = runs[(pass_, "naive")], runs[(pass_, "chunked")]
        row: dict[str, float | None] = {}
        for name, values in (("naive", naive_runs), ("chunked", chunked_runs)):
            row[f"{name}_time"] = statistics.median(t for t, _ in values)
            row[f"{name}_extra"] = (
                statistics.median(m for _, m in values) if result["memory"] else None
            )
        pairs = list(zip(naive_runs, chunked_runs, strict=True))
        row["time_ratio"] = statistics.median(c[0] / n[0] for n, c in pairs)
        # A run whose allocations all fit in pages already resident can show no extra at all
        # (only at toy sizes): such a repetition has no memory ratio.
        memory_ratios = [c[1] / n[1] for n, c in pairs if result["memory"] and n[1] > 0]
        row["memory_ratio"] = statistics.median(memory_ratios) if memory_ratios else None
        summary[pass_] = row
    return summary


def main(argv: list[str] | None = None) -> dict[str, dict[str, float | None]]:
    args = parse_args(argv)
    logits_bytes = args.rows * args.vocab * 4
    response_rows = sum(packed_lengths(args)[1])
    print(
        f"PolicyHead (chunked) vs naive log_softmax(logits[rows] / T) + gather, both over the "
        f"{response_rows} response rows of T={args.rows}: V={args.vocab}, fp32 logits "
        f"{logits_bytes / 2**30:.2f} GiB, {args.samples} samples, temperature {TEMPERATURE}, "
        f"{args.threads} threads, chunk_bytes {args.chunk_bytes / 2**20:g} MiB, "
        f"median of {args.reps} repetitions"
    )
    result = benchmark(args)
    summary = summarize(result)
    print(f"{'pass':<8} {'variant':<8} {'median time':>12} {'extra peak RSS':>15} {'x logits':>9}")
    for pass_, row in summary.items():
        for variant in VARIANTS:
            extra = row[f"{variant}_extra"]
            mib = "-" if extra is None else f"{extra / 2**20:.0f} MiB"
            of_logits = "-" if extra is None else f"{extra / logits_bytes:.3f}x"
            print(
                f"{pass_:<8} {variant:<8} {row[f'{variant}_time']:>10.3f} s "
                f"{mib:>15} {of_logits:>9}"
            )
    for pass_, row in summary.items():
        memory = "-" if row["memory_ratio"] is None else f"{row['memory_ratio']:.3f}x"
        print(f"{pass_} chunked/naive: time {row['time_ratio']:.3f}x, extra peak RSS {memory}")
    print(
        "forward: log-probs only, no autograd; fwd+bwd: log-probs and entropy, backward of a "
        "weighted sum (its extra includes the [T, V] gradient, 1.0x logits)."
    )
    if not result["memory"]:
        print("extra peak RSS: not measured (resetting the peak needs Linux's clear_refs)")
        return summary
    forward = summary["forward"]
    mem = forward["chunked_extra"] / logits_bytes
    time_ratio = forward["time_ratio"]
    print(
        f"forward targets: chunked extra peak RSS {mem:.3f}x logits (target <= "
        f"{MEMORY_TARGET}x) {'OK' if mem <= MEMORY_TARGET else 'MISSED'}; time chunked/naive "
        f"{time_ratio:.3f}x (target <= {TIME_TARGET}x) "
        f"{'OK' if time_ratio <= TIME_TARGET else 'MISSED'}"
    )
    return summary


if __name__ == "__main__":
    main()
