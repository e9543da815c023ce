"""Benchmark Ember's embedded hf engine against transformers' own `generate()` on the same work.

Equal work, as measured here:
- the same weights, dtype and attention kernel: generate() runs the model as transformers
  builds it; Ember's engine a copy of it with its fp32 CPU linear weights packed for oneDNN, as
  it serves by default (`engine.hf.pack_linears`, `ember_rollout.packed_linear`), and a third
  side, Ember's engine on generate()'s own model, shows what the packing is worth; the same
  prompts (toy-task prompts of mixed lengths, left-padded on both sides), the same batches
  (`--batch-size` requests decoded together, with a KV cache on both sides) and the same
  sampling: `--temperature`, `--top-p`, no top-k (`top_k=0` for generate(), whose default is
  50), `--new-tokens`;
- results of the same kind: each request's response token ids and the fp32 log-prob of each
  token, one log-softmax over the vocabulary per step on each side. Ember's engine always
  returns these (log softmax(logits / temperature), before the top-p filter, as the trainer
  computes them); generate() returns them with `output_scores=True` and
  `compute_transition_scores(..., normalize_logits=True)`, which is timed with it, and its
  numbers are of the top-p filtered, renormalised distribution, so with `--top-p` below 1 the
  two report different values for the same work. Both end as Python lists per request
  (Ember's engine also builds SGLang-style metadata for each). Before
  timing, two prompts check that generate()'s scores give the same distribution as Ember's
  sampler on the same logits, so a model whose generation config adds other processors
  (repetition penalty, min-p) stops the benchmark; the max difference is printed;
- EOS ignored on both sides (`ignore_eos`; `eos_token_id=[]`, since generate() fills an unset
  one from the model's generation config), so every request generates exactly `--new-tokens`
  tokens. generate() also stops a sequence at EOS, but keeps decoding it as padding until the
  whole batch ends, while Ember's engine drops finished rows from the batch; and the two sides
  draw different random numbers (one seeded generator per request vs torch.multinomial), so
  their sequences would end at different points and the work would differ.

After one untimed run of each side, each repetition runs Ember's engine (packed), Ember's engine
(plain linears) and generate() on all requests; the figures are the medians over repetitions of
each side's tokens/s and of the ratios within a repetition.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import statistics
import time

import torch

from ember_rollout.config import HFEngineConfig, ToyTaskConfig
from ember_rollout.engine import GenerateRequest, SamplingParams
from ember_rollout.hf_engine import HFEngine
from ember_rollout.packed_linear import pack_linears
from ember_rollout.token_sampling import filtered_log_probs
from ember_rollout.tokenizer import load_tokenizer
from ember_rollout.toy_task import make_toy_prompts

Completion = tuple[list[int], list[float]]
"""One request's response token ids and their log-probs."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64, help="requests generated")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--batch-size", type=int, default=64, help="requests decoded together")
    parser.add_argument("--model-path", default=None, help="local HF model dir (default: tiny)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=9, help="timed repetitions of each side")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON line instead")
    args = parser.parse_args(argv)
    for key in ("prompts", "new_tokens", "threads", "batch_size", "reps"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')}={getattr(args, key)}: expected >= 1")
    return args


def make_prompts(args: argparse.Namespace) -> list[list[int]]:
    """Token ids of toy-task prompts of mixed lengths (2 to 8 digits)."""
    tokenizer = load_tokenizer(args.model_path)
    records = make_toy_prompts(
        ToyTaskConfig(num_prompts=args.prompts, min_digits=2, max_digits=8, seed=args.seed)
    )
    return [tokenizer(r["prompt"])["input_ids"] for r in records]


def ember_generate(engine: HFEngine, prompts, args: argparse.Namespace) -> list[Completion]:
    """All prompts through Ember's engine, one seeded sampler per request."""
    requests = [
        GenerateRequest(
            input_ids=ids,
            sampling=SamplingParams(
                max_new_tokens=args.new_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                ignore_eos=True,
                seed=args.seed * 100_003 + i,
            ),
            name=f"request {i}",
        )
        for i, ids in enumerate(prompts)
    ]
    return [(o.output_ids, o.output_log_probs) for o in engine.generate_sync(requests)]


def generation_config(args: argparse.Namespace, *, output_logits: bool = False):
    """generate()'s settings: the same sampling as Ember's requests, EOS ignored."""
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=True,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=0,
        max_new_tokens=args.new_tokens,
        eos_token_id=[],
        pad_token_id=0,
        output_scores=True,
        output_logits=output_logits,
        return_dict_in_generate=True,
    )


def left_pad(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and attention mask [B, width], prompts padded on the left with id 0."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for b, prompt in enumerate(prompts):
        ids[b, width - len(prompt) :] = torch.tensor(prompt)
        mask[b, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


def hf_generate(model, prompts, args: argparse.Namespace, config=None) -> list[Completion]:
    """All prompts through `model.generate()` in batches, with each token's log-prob."""
    config = config or generation_config(args)
    device = next(model.parameters()).device
    completions: list[Completion] = []
    for start in range(0, len(prompts), args.batch_size):
        ids, mask = left_pad(prompts[start : start + args.batch_size], device)
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        log_probs = model.compute_transition_scores(
            out.sequences, out.scores, normalize_logits=True
        )
        tokens = out.sequences[:, ids.shape[1] :]
        completions += list(zip(tokens.tolist(), log_probs.tolist(), strict=True))
    return completions


TIE = 1e-6
"""Probabilities this close count as tied: the two sides may order them differently."""
ROUNDING = 1e-5
"""Bound on the fp32 rounding of a cumulative probability."""


def top_p_ambiguous(logits_BV: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Tokens that top-p keeps or drops depending only on tie order or rounding: bool [B, V].

    Top-p keeps a token while the mass ranked before it is below top_p. With m the mass of the
    strictly more likely tokens and g the number tied with it, that mass lies anywhere in
    [m, m + (g - 1) p] depending on how ties are ordered (Ember: by token id; generate(): by
    its sort), so the decision is fixed only when the whole range is clear of top_p.
    """
    probs = torch.softmax(logits_BV.float() / temperature, dim=-1)
    ascending = probs.sort(dim=-1).values
    # suffix[b, k]: mass of ascending[b, k:]
    suffix = ascending.flip(-1).cumsum(-1).flip(-1)
    suffix = torch.cat([suffix, suffix.new_zeros(suffix.shape[0], 1)], dim=-1)
    above = torch.searchsorted(ascending, probs + TIE, right=True)  # first strictly likelier
    below = torch.searchsorted(ascending, probs - TIE)  # first tied
    mass_before = suffix.gather(-1, above)
    tied_before = (above - below - 1).clamp(min=0) * probs
    return (mass_before < top_p + ROUNDING) & (mass_before + tied_before >= top_p - ROUNDING)


def check_same_sampling(model, prompts, args: argparse.Namespace) -> dict[str, float | int]:
    """Compare generate()'s sampling distribution with Ember's sampler on the same logits.

    Returns:
        max_abs_diff (of the log-probs, over the rows where both keep the same tokens), rows
        (decoding steps x requests) and boundary_rows: rows where the two keep a different
        token, each such token being a top-p tie or rounding case (`top_p_ambiguous`).

    Raises:
        SystemExit: If generate() samples from another distribution (another token filtered
            out, or values off by more than float rounding).
    """
    config = generation_config(args, output_logits=True)
    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, device)
    torch.manual_seed(args.seed)
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    worst, rows, boundary_rows = 0.0, 0, 0
    for step, (raw, scores) in enumerate(zip(out.logits, out.scores, strict=True)):
        theirs = torch.log_softmax(scores.float(), dim=-1)
        ours = filtered_log_probs(raw, args.temperature, -1, args.top_p)
        kept = torch.isfinite(ours)
        differ = kept != torch.isfinite(theirs)
        if differ.any():
            ambiguous = top_p_ambiguous(raw, args.temperature, args.top_p)
            if (differ & ~ambiguous).any():
                raise SystemExit(
                    f"generate() filters other tokens than Ember's sampler at step {step}"
                )
        for b in range(raw.shape[0]):
            rows += 1
            if differ[b].any():
                boundary_rows += 1
                continue
            row_diff = (ours[b, kept[b]] - theirs[b, kept[b]]).abs().max()
            worst = max(worst, float(row_diff))
    if worst > 1e-4:
        raise SystemExit(f"generate()'s log-probs differ from Ember's sampler by {worst:.2e}")
    return {"max_abs_diff": worst, "rows": rows, "boundary_rows": boundary_rows}


def timed(fn) -> tuple[float, list[Completion]]:
    started = time.perf_counter()
    completions = fn()
    return time.perf_counter() - started, completions


def benchmark(args: argparse.Namespace) -> dict:
    """Tokens/s of the three sides over `args.reps` repetitions, and the sampling check."""
    torch.set_num_threads(args.threads)
    config = HFEngineConfig(
        model_path=args.model_path,
        dtype=args.dtype,
        max_batch_size=args.batch_size,
        num_threads=args.threads,
        pack_linears=False,
    )
    plain = HFEngine(config)
    plain.load()
    model = plain.model  # generate() runs this one: plain nn.Linear layers, as TRL's does
    # Ember's engine as configured by default: the same weights, linear weights packed.
    engine = HFEngine(dataclasses.replace(config, pack_linears=True), model=copy.deepcopy(model))
    packed = pack_linears(engine.model, batch_hint=args.batch_size)
    prompts = make_prompts(args)
    sampling = check_same_sampling(model, prompts[:2], args)
    gen_config = generation_config(args)
    sides = {
        "ember": lambda: ember_generate(engine, prompts, args),
        "ember_plain": lambda: ember_generate(plain, prompts, args),
        "generate": lambda: hf_generate(model, prompts, args, gen_config),
    }
    names = {"ember": "Ember", "ember_plain": "Ember (plain linears)", "generate": "generate()"}
    # One untimed run of each side on the full batches: kernels are picked per shape.
    for run in sides.values():
        run()
    times: dict[str, list[float]] = {key: [] for key in sides}
    for rep in range(args.reps):
        for key, run in sides.items():
            torch.manual_seed(args.seed * 100_003 + rep)  # generate() draws from this generator
            elapsed, completions = timed(run)
            times[key].append(elapsed)
            short = [i for i, (ids, _) in enumerate(completions) if len(ids) != args.new_tokens]
            if len(completions) != len(prompts) or short:
                raise SystemExit(
                    f"{names[key]}: requests {short[:5]} did not get {args.new_tokens} tokens"
                )
    tokens = len(prompts) * args.new_tokens
    rates = {key: [tokens / t for t in runs] for key, runs in times.items()}

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(rates[a], rates[b], strict=True))

    return {
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "dtype": args.dtype,
        "threads": args.threads,
        "batch_size": args.batch_size,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "reps": args.reps,
        "packed_layers": packed,
        **{f"{key}_tokens_per_s": statistics.median(r) for key, r in rates.items()},
        **{f"{key}_runs_tokens_per_s": r for key, r in rates.items()},
        "ratio": ratio("ember", "generate"),
        "packed_ratio": ratio("ember", "ember_plain"),
        "sampling_max_abs_diff": sampling["max_abs_diff"],
        "sampling_rows": sampling["rows"],
        "sampling_boundary_rows": sampling["boundary_rows"],
        "model": args.model_path or describe_tiny(engine),
    }


def describe_tiny(engine: HFEngine) -> str:
    info = engine.model_info
    return (
        f"tiny Qwen3-MoE ({info.num_layers} layers, {engine.config.tiny.num_experts} experts, "
        f"top-{info.topk}, vocab {info.vocab_size})"
    )


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result = benchmark(args)
    if args.json:
        print(json.dumps(result))
        return result
    tokens = args.prompts * args.new_tokens
    print(
        f"bench_rollout: {args.prompts} prompts x {args.new_tokens} new tokens (EOS ignored), "
        f"batch {args.batch_size}, temperature {args.temperature}, top-p {args.top_p}, "
        f"{args.dtype}, {args.threads} threads, {result['model']}, median of {args.reps}"
    )
    sides = (
        ("Ember hf engine", "ember"),
        ("  with plain linears", "ember_plain"),
        ("transformers generate()", "generate"),
    )
    for name, key in sides:
        runs = result[f"{key}_runs_tokens_per_s"]
        print(
            f"  {name + ':':<25} {tokens} tokens, {result[f'{key}_tokens_per_s']:9.1f} tokens/s "
            f"(runs {min(runs):.1f}-{max(runs):.1f})"
        )
    for label, a, b, key in (
        ("Ember / generate()", "ember", "generate", "ratio"),
        ("packed / plain linears", "ember", "ember_plain", "packed_ratio"),
    ):
        ratios = [
            x / y
            for x, y in zip(
                result[f"{a}_runs_tokens_per_s"], result[f"{b}_runs_tokens_per_s"], strict=True
            )
        ]
        print(
            f"  {label} within a repetition: median {result[key]:.2f}x "
            f"(runs {min(ratios):.2f}-{max(ratios):.2f})"
        )
    print(
        f"  {result['packed_layers']} linear layers packed for oneDNN (0: this dtype or torch "
        "build runs them as is); the other two sides share one unpacked model"
    )
    print(
        "  both return token ids and one fp32 log-prob per token (Ember's: log softmax(logits / "
        "T) before the filter; generate()'s: of the renormalised nucleus); on the same logits "
        "generate()'s sampling "
        f"distribution matches Ember's to {result['sampling_max_abs_diff']:.1e} "
        f"({result['sampling_boundary_rows']} of {result['sampling_rows']} rows differ by a token "
        "tied or within rounding at the top-p cut)"
    )
    return result


if __name__ == "__main__":
    main()
