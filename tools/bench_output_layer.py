"""The output layer at the response windows against the output layer at every position: one
training micro-batch's forward and backward (policy head included), side by side in one process.

    uv run python tools/bench_output_layer.py [--checkpoint models/smollm2] [--samples 8]
        [--prompt 43] [--response 40] [--repeats 5]

Megatron-core's GPTModel projects every position it is given onto the vocabulary; Ember's
forwards hand its output layer each sample's last R + 1 positions only
(`ember_megatron_backend.forward.ModelCall`). This builds the checkpoint's model (its
`config.json`; the weights do not change the time and are left at their initialisation), packs
`--samples` samples of `--prompt` prompt and `--response` response tokens, and times
`run_model` with the response windows and without, alternating, `--repeats` times each after
one warm-up of each: forward, `PolicyHead` log-probs and entropy at temperature 0.7, backward.
It prints the median seconds of each and their ratio, the positions the output layer was given
in each (counted by a hook on it), and the largest difference between their log-probs.
Without `--checkpoint` (or when it is absent) it uses the `tiny-moe` preset.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import describe_machine  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default=str(ROOT / "models" / "smollm2"),
                        help="an HF checkpoint directory (its config.json)")  # fmt: skip
    parser.add_argument("--samples", type=int, default=8, help="samples in the micro-batch")
    parser.add_argument("--prompt", type=int, default=43, help="prompt tokens per sample")
    parser.add_argument("--response", type=int, default=40, help="response tokens per sample")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes of each")
    args = parser.parse_args(argv)
    for name in ("samples", "prompt", "response", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


def model_config(checkpoint: str):
    from ember_megatron_backend.config import ModelConfig
    from ember_megatron_backend.hf_layout import model_config_from_hf

    if (Path(checkpoint) / "config.json").is_file():
        from transformers import AutoConfig

        return model_config_from_hf(AutoConfig.from_pretrained(checkpoint)), checkpoint
    return ModelConfig.preset("tiny-moe"), "tiny-moe preset"


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    from ember_megatron_backend.parallel import destroy_distributed, init_distributed

    init_distributed()
    try:
        return _compare(args)
    finally:
        destroy_distributed()


def _compare(args: argparse.Namespace) -> dict[str, float]:
    from ember_core.heads import PolicyHead
    from ember_core.types import Sample, pack_samples
    from ember_megatron_backend.forward import response_window
    from ember_megatron_backend.forward import run_model as run
    from ember_megatron_backend.model import build_model

    cfg, source = model_config(args.checkpoint)
    model = build_model(cfg, seed=0)
    g = torch.Generator().manual_seed(0)
    total = args.prompt + args.response
    samples = [
        Sample(tokens=torch.randint(0, cfg.vocab_size, (total,), generator=g).tolist(),
               response_length=args.response)
        for _ in range(args.samples)
    ]  # fmt: skip
    batch = pack_samples(samples)
    spans = response_window(batch)
    head = PolicyHead(0.7)
    projected: list[int] = []  # positions the output layer was given, per forward
    model.output_layer.register_forward_hook(
        lambda module, args, out: projected.append(args[0].shape[0] * args[0].shape[1])
    )

    def step(windowed: bool) -> tuple[float, torch.Tensor]:
        read = spans.batch if windowed else batch
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        rows = run(model, batch, window=spans if windowed else None)
        out = head.log_probs(rows, read.tokens[: read.num_tokens], read.total_lengths,
                             read.response_lengths, with_entropy=True)  # fmt: skip
        loss = torch.cat(out.log_probs).mean() + torch.cat(out.entropy).mean()
        loss.backward()
        return time.perf_counter() - start, torch.cat(out.log_probs).detach()

    print(f"machine: {describe_machine()}")
    print(f"model: {source}, vocabulary {cfg.vocab_size}, hidden {cfg.hidden_size}, "
          f"{cfg.num_layers} layers; {args.samples} samples of {args.prompt} + {args.response} "
          f"tokens, {torch.get_num_threads()} threads")  # fmt: skip
    _, windowed = step(True)
    _, full = step(False)
    gap = float((windowed - full).abs().max())
    at_windows, at_every = projected[:2]
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.repeats):
        for windowed_pass in (False, True):
            times[windowed_pass].append(step(windowed_pass)[0])
    every, windows = statistics.median(times[False]), statistics.median(times[True])
    print(f"{'output layer at':<28}{'positions':>10}{'median s':>10}")
    print(f"{'every position':<28}{at_every:>10}{every:>10.3f}")
    print(f"{'the response windows':<28}{at_windows:>10}{windows:>10.3f}")
    print(f"response windows vs every position: {windows / every:.2f}x the time")
    print(f"log-probs, largest difference: {gap:.1e}")
    return {"every_s": every, "windows_s": windows, "max_log_prob_diff": gap,
            "positions_every": at_every, "positions_windows": at_windows}  # fmt: skip


if __name__ == "__main__":
    main()
