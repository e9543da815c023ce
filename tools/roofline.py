"""How close each phase of a run gets to this machine's fp32 matmul rate.

    uv run python tools/roofline.py RUN_DIR [RUN_DIR ...] [--skip N] [--rate GFLOPS]

First it measures the machine: the sustained rate of fp32 matrix products in torch on every
core (square products of 1024 to 2048, best of a few seconds), unless `--rate` gives one. Then,
for each run directory (`ember train` writes one), it turns each phase's work into FLOPs from
the run's own records and its model (`hf_init/config.json`, built on the meta device):

- generation: 2 x N x (prompt + generated tokens), plus attention (4 x layers x attention
  width x context per token: half the prompt per prefill token, the prompt plus half the
  response per decoded token), over every sample generated (`perf/rollout_gen_*`), each
  prompt prefilled once for its group of `rollout.n_samples_per_prompt` samples (the
  embedded engine forwards a group's identical prompts once, SGLang's prefix cache shares
  them; under `rollout.partial_rollouts` SGLang runs without that cache, and every sample's
  prompt counts);
- scoring (the forwards before training: old log-probs, reference, values): 2 x N x tokens
  plus attention, per forward the config runs;
- training: 6 x N x tokens plus three times the attention, per trained model (the actor, and
  the critic under PPO);

where N is the matmul parameters one token meets: every weight of two dimensions or more but
the embedding table (a lookup), the output layer once even when tied to the embedding, and a
MoE layer's experts scaled to the `top_k` of them a token is routed to. The output layer counts
only at the positions whose logits are used: one per generated token in generation, one per
response token in scoring and training (the prompt's positions predict nothing that is read);
a critic's forwards have none (its value layer, 1 x hidden, is left out).
So the FLOPs are the work the phase needs, and a forward that also projects the prompt onto
the vocabulary shows as a lower fraction. It prints, per phase,
the median seconds per rollout (rollouts from `--skip` on), GFLOP per rollout, the rate that
makes, and its fraction of the machine's. The weight push moves bytes, not FLOPs: its seconds
only. With rollout and training overlapped, generation's time is its own (it runs beside
training), so the phases' fractions do not add up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe_machine  # noqa: E402

EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "top_k")


def machine_rate(seconds: float = 3.0, sizes: Sequence[int] = (1024, 1536, 2048)) -> float:
    """GFLOP/s of fp32 square products on every core: the best size's sustained rate."""
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(a, b)  # warm-up
        done, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / len(sizes):
            torch.mm(a, b)
            done += 1
        best = max(best, 2 * n**3 * done / (time.perf_counter() - start) / 1e9)
    return best


def model_shape(config_path: Path) -> dict[str, Any]:
    """The figures the FLOP counts need, from a transformers config.json: matmul parameters
    per token (`active`, the output layer's `output` among them), all parameters, layers and
    attention width."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(config_path.parent, local_files_only=True)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    experts = next((getattr(text, k) for k in EXPERT_COUNT_KEYS if getattr(text, k, None)), None)
    top_k = next((getattr(text, k) for k in TOP_K_KEYS if getattr(text, k, None)), None)
    embedding = model.get_input_embeddings().weight
    total = active = 0
    for name, param in model.named_parameters():
        total += param.numel()
        if param is embedding or param.dim() < 2:
            continue
        share = top_k / experts if experts and top_k and ".experts." in f".{name}." else 1.0
        active += param.numel() * share
    output = model.get_output_embeddings()
    if output is not None and output.weight is embedding:  # tied: the table is a matmul too
        active += embedding.numel()
    projection = output.weight.numel() if output is not None else 0
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return {
        "params": total,
        "active": active,
        "output": projection,
        "layers": text.num_hidden_layers,
        "attention_width": heads * head_dim,
        "experts": experts,
        "top_k": top_k,
    }


def rollout_records(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == "rollout"]


def forwards(resolved: dict[str, Any], record: dict[str, Any]) -> tuple[int, int]:
    """(scoring forwards, trained models) of one rollout under the resolved config."""
    algorithm = resolved.get("algorithm", {})
    scoring = int(
        not algorithm.get("use_rollout_log_probs", False) or bool(record.get("rollout/audit"))
    )
    scoring += int(bool(algorithm.get("use_kl_loss")) or bool(algorithm.get("kl_coef")))
    critic = algorithm.get("advantage_estimator") == "ppo"
    return scoring + int(critic), 1 + int(critic)


def phase_work(shape: dict[str, Any], resolved: dict[str, Any], record: dict[str, Any]) -> dict:
    """GFLOP of each phase of one rollout (the output layer only where its logits are read)."""
    head = shape.get("output", 0)
    body, attention = shape["active"] - head, 4 * shape["layers"] * shape["attention_width"]
    samples = record["rollout/num_samples"]
    prompt, response = record["rollout/prompt_len_mean"], record["rollout/response_len_mean"]
    generated = record.get("perf/rollout_gen_tokens", samples * response)
    prompted = record.get("perf/rollout_prompt_tokens", samples * prompt)
    per_sample = generated / samples if samples else 0.0
    per_prompt = prompted / samples if samples else 0.0
    rollout = resolved.get("rollout", {})
    sglang = resolved.get("engine", {}).get("kind") == "sglang"
    shared = not (sglang and rollout.get("partial_rollouts"))  # no radix cache then
    group = rollout.get("n_samples_per_prompt", 1) if shared else 1
    gen = (
        2 * body * (prompted / group + generated)
        + 2 * head * generated
        + samples
        * attention
        * (per_prompt**2 / 2 / group + per_sample * (per_prompt + per_sample / 2))
    )
    length = prompt + response
    trunk = samples * (2 * body * length + attention * length**2 / 2)
    policy = trunk + samples * 2 * head * response  # the critic's value layer: next to nothing
    scoring, trained = forwards(resolved, record)
    critic = trained - 1
    scored = (scoring - critic) * policy + critic * trunk
    return {"generation": gen / 1e9, "scoring": scored / 1e9,
            "training": 3 * (policy + critic * trunk) / 1e9}  # fmt: skip


PHASE_TIMES = {
    "generation": "perf/rollout_gen_time",
    "scoring": "perf/log_probs_time",
    "training": "perf/train_time",
    "weight push": "perf/weight_push_time",
    "iteration": "perf/iteration_time",
}


def roofline(run_dir: Path, rate: float, skip: int) -> str:
    import yaml

    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    shape = model_shape(run_dir / "hf_init" / "config.json")
    records = rollout_records(run_dir)[skip:]
    if not records:
        raise SystemExit(f"{run_dir}: no rollout records from rollout {skip} on")
    if "perf/rollout_gen_time" not in records[0]:
        raise SystemExit(f"{run_dir}: its metrics predate perf/rollout_gen_time; run it again")
    work = [phase_work(shape, resolved, r) for r in records]
    moe = f", {shape['experts']} experts, top-{shape['top_k']}" if shape["experts"] else ""
    lines = [
        f"{run_dir}: {shape['params'] / 1e6:.1f} M parameters, {shape['active'] / 1e6:.1f} M "
        f"matmul parameters per token{moe}; rollouts {skip}-{skip + len(records) - 1}",
        f"{'phase':<14}{'s/rollout':>11}{'GFLOP/rollout':>15}{'GFLOP/s':>10}{'of machine':>12}",
    ]
    for phase, key in PHASE_TIMES.items():
        seconds = statistics.median(r.get(key, 0.0) for r in records)
        if phase in work[0]:
            flops = statistics.median(w[phase] for w in work)
            achieved = flops / seconds if seconds else 0.0
            cells = f"{flops:>15.2f}{achieved:>10.1f}{achieved / rate:>12.1%}"
        else:
            cells = f"{'-':>15}{'-':>10}{'-':>12}"
        lines.append(f"{phase:<14}{seconds:>11.3f}{cells}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR")
    parser.add_argument("--skip", type=int, default=1, help="leave out the first N rollouts")
    parser.add_argument("--rate", type=float, default=None, help="machine GFLOP/s (measured)")
    args = parser.parse_args(argv)
    print(f"machine: {describe_machine()}")
    rate = args.rate if args.rate is not None else machine_rate()
    print(f"fp32 matmul, every core: {rate:.1f} GFLOP/s" + (" (given)" if args.rate else ""))
    for run_dir in args.runs:
        print()
        print(roofline(run_dir, rate, args.skip))


if __name__ == "__main__":
    main()
