"""Benchmark R3: bf16 hf-engine rollouts scored by an fp32 Megatron worker with and without replay.

One run: a MegatronWorker (fp32, CPU) exports its weights as a transformers checkpoint (or both
start from `--hf-load`); the embedded hf engine loads them in bf16 and generates rollouts that
record their routed experts; the worker then scores the same rollouts with the r3_routing plugin
off and on and times training steps in both modes, alternated.

Definitions (all over response tokens unless said otherwise):
- a token is *flipped* when, at the position that predicts it, the fp32 actor's own top-k expert
  set (no replay) differs from the engine's in at least one MoE layer; otherwise *agreeing*;
- gap = |log p_train - log p_rollout| per token, log p_train from the scoring forward at the
  rollout temperature; rollout/train_rollout_logprob_abs_diff is the worker's own metric
  (per-sample mean, then mean over samples);
- routing agreement without replay: (position, layer) pairs whose actor top-k set equals the
  engine's, over every forwarded position; with replay: the experts the routers actually used
  (their routing maps) against the engine's, in the scoring forward and in a training step;
- extreme token: |exp(log p_train - log p_rollout) - 1| > 0.5.

Usage: uv run python tools/bench_r3.py [--rollouts 512 --response-len 32 --reps 6 ...]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ember_core.config import AlgorithmConfig, CIConfig, SamplingConfig
from ember_core.hookspecs import Role, hookimpl
from ember_core.plugins import EmberPlugins
from ember_core.types import Sample, SampleStatus
from ember_megatron_backend.config import BackendConfig, OptimizerConfig
from ember_megatron_backend.parallel import destroy_distributed, init_distributed
from ember_megatron_backend.worker import MegatronWorker
from ember_r3_routing import R3RoutingConfig
from ember_r3_routing import plugin as r3_plugin
from ember_rollout.config import HFEngineConfig, ToyTaskConfig
from ember_rollout.engine import GenerateRequest, SamplingParams
from ember_rollout.hf_engine import HFEngine
from ember_rollout.tokenizer import toy_tokenizer
from ember_rollout.toy_task import make_toy_prompts

R3 = "r3_routing"
EXTREME = 0.5
"""A token is extreme when |exp(dlogp) - 1| exceeds this."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf-load", help="transformers checkpoint both sides start from")
    parser.add_argument("--seed", type=int, default=1234, help="fresh weights and prompts")
    parser.add_argument("--rollouts", type=int, default=512, help="rollouts (samples)")
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    parser.add_argument("--prompt-len", type=int, default=16, help="random prompt tokens")
    parser.add_argument(
        "--toy-prompts",
        action="store_true",
        help="prompts of the default toy task (toy tokenizer) instead of random tokens",
    )
    parser.add_argument("--response-len", type=int, default=32, help="max new tokens")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--micro-batch-size", type=int, default=8, help="samples per micro-batch")
    parser.add_argument("--reps", type=int, default=6, help="timed steps per mode (0: none)")
    parser.add_argument("--recompute", action="store_true", help="full activation recompute")
    # One thread: on a shared machine, oversubscribed OpenMP threads make step times erratic.
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    return parser.parse_args(argv)


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """What the plugins read from a run config: the training section and the CI switch."""

    train: BackendConfig
    plugins: list[str] = field(default_factory=lambda: [R3])
    ci: CIConfig = field(default_factory=CIConfig)


class Recompute:
    """Turns on megatron-core's full activation recompute for the actor, one layer at a time."""

    @hookimpl
    def ember_model_config(self, role: Role, model_config: Any) -> None:
        model_config.recompute_granularity = "full"
        model_config.recompute_method = "uniform"
        model_config.recompute_num_layers = 1


@contextlib.contextmanager
def replay(plugins: EmberPlugins, on: bool) -> Iterator[None]:
    """Score or train with the r3_routing plugin's forward contexts on or off. The actor's
    routers are built replay-capable either way; without an action they route by themselves."""
    if on:
        yield
        return
    plugins.unregister(R3)
    try:
        yield
    finally:
        plugins.register(r3_plugin, R3)


class RouterLog:
    """Per router call of the actor: its layer and the routing map it used [T, E]."""

    def __init__(self, model: Any) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.calls: list[tuple[int, Tensor]] = []
        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        self.handles = [r.register_forward_hook(self._hook) for r in routers]

    def _hook(self, router: Any, args: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
        self.calls.append((router.layer_number - 1, output[1].detach().cpu()))

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def rollout_maps(samples: list[Sample], layers: int, experts: int) -> tuple[Tensor, Tensor]:
    """The engine's routing over a packed micro-batch: maps [T, layers, E] and [T] rows that
    have rollout experts (every token but each sample's last)."""
    maps, valid = [], []
    for sample in samples:
        ids = sample.rollout_routed_experts.long()  # [L - 1, layers, k]
        block = torch.zeros(ids.shape[0] + 1, layers, experts, dtype=torch.bool)
        block[:-1].scatter_(2, ids, True)
        maps.append(block)
        valid.append(torch.arange(ids.shape[0] + 1) < ids.shape[0])
    return torch.cat(maps), torch.cat(valid)


def match_calls(
    calls: list[tuple[int, Tensor]],
    micro_batches: list[list[Sample]],
    per_micro_batch: int,
    layers: int,
    experts: int,
) -> list[tuple[list[Sample], int, Tensor, Tensor, Tensor]]:
    """Pair each router call with its micro-batch (calls come `per_micro_batch` at a time):
    (samples, layer, used map, rollout map, valid rows)."""
    if len(calls) != per_micro_batch * len(micro_batches):
        raise RuntimeError(f"{len(calls)} router calls for {len(micro_batches)} micro-batches")
    from ember_core.types import pack_samples
    from ember_megatron_backend.forward import router_rows_to_stream

    out = []
    for k, samples in enumerate(micro_batches):
        want, valid = rollout_maps(samples, layers, experts)
        packed = pack_samples(samples)
        for layer, used in calls[k * per_micro_batch : (k + 1) * per_micro_batch]:
            used = router_rows_to_stream(used, packed)
            out.append((samples, layer, used, want[:, layer], valid))
    return out


def generate(args: argparse.Namespace, path: str, plugins: EmberPlugins) -> list[Sample]:
    """Rollouts from the bf16 hf engine, routed experts decoded and stored by the plugin."""
    engine = HFEngine(HFEngineConfig(model_path=path, dtype="bfloat16", max_batch_size=64))
    engine.load()
    vocab = engine.model_info.vocab_size
    g = torch.Generator().manual_seed(args.seed)
    fields = plugins.rollout_request_fields("hf")
    groups = -(-args.rollouts // args.group_size)
    stop: list[int] = []
    if args.toy_prompts:
        tokenizer = toy_tokenizer()
        toy = ToyTaskConfig(num_prompts=groups, seed=args.seed)
        prompts = [tokenizer.encode(r["prompt"]) for r in make_toy_prompts(toy)]
        stop = [tokenizer.eos_token_id]
    else:
        prompts = [
            torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(groups)
        ]
    requests = []
    for k in range(args.rollouts):
        prompt = prompts[k // args.group_size]
        sampling = SamplingParams(
            max_new_tokens=args.response_len,
            temperature=args.temperature,
            stop_token_ids=stop,
            seed=args.seed + k,
        )
        requests.append(
            GenerateRequest(input_ids=prompt, sampling=sampling, fields=fields, name=f"sample {k}")
        )
    started = time.perf_counter()
    outputs = engine.generate_sync(requests)
    elapsed = time.perf_counter() - started
    samples = []
    for k, (request, output) in enumerate(zip(requests, outputs, strict=True)):
        sample = Sample(
            tokens=request.input_ids + output.output_ids,
            response_length=len(output.output_ids),
            index=k,
            group_index=k // args.group_size,
            reward=float(torch.rand(1, generator=g)),
            rollout_log_probs=list(output.output_log_probs),
            status=SampleStatus.COMPLETED,
        )
        plugins.process_sample(sample, output.meta_info, "hf")
        samples.append(sample)
    tokens = sum(s.response_length for s in samples)
    print(f"engine: bf16 hf, {len(samples)} rollouts, {tokens} response tokens in {elapsed:.1f} s")
    return samples


def flipped_tokens(
    samples: list[Sample], matched: list[tuple[list[Sample], int, Tensor, Tensor, Tensor]]
) -> tuple[list[Tensor], Tensor, Tensor]:
    """Per sample, [R] True where the token's predicting position disagrees in any layer; and
    per layer, the (disagreeing, compared) routing decision counts over all positions."""
    layers = 1 + max(layer for _, layer, *_ in matched)
    rows: dict[int, Tensor] = {}
    per_layer = torch.zeros(layers, 2, dtype=torch.long)
    for mb, layer, used, want, valid in matched:
        differs = (used != want).any(dim=-1) & valid  # [T]
        per_layer[layer, 0] += int(differs.sum())
        per_layer[layer, 1] += int(valid.sum())
        start = 0
        for sample in mb:
            n = sample.total_length
            key = id(sample)
            rows[key] = rows.get(key, torch.zeros(n, dtype=torch.bool)) | differs[start : start + n]
            start += n
    flipped = []
    for sample in samples:
        positions = rows[id(sample)]
        # Response token j is predicted at position prompt_length + j - 1.
        flipped.append(positions[sample.prompt_length - 1 : sample.total_length - 1])
    return flipped, per_layer[:, 0], per_layer[:, 1]


def used_agreement(matched: list[tuple[Any, ...]]) -> tuple[int, int]:
    """(position, layer) pairs whose used experts equal the engine's, and pairs compared."""
    agree = total = 0
    for _mb, _layer, used, want, valid in matched:
        agree += int((used == want).all(dim=-1)[valid].sum())
        total += int(valid.sum())
    return agree, total


def gaps(batch: Any) -> Tensor:
    """Per response token, log p_train - log p_rollout, in sample order."""
    train = torch.cat(batch.log_probs).double()
    rollout = torch.cat([torch.tensor(s.rollout_log_probs) for s in batch.samples]).double()
    return train - rollout


def ratio_interval(flip: Tensor, agree: Tensor, reps: int = 1000) -> tuple[float, float]:
    """95% bootstrap interval of mean(flip) / mean(agree), tokens resampled."""
    g = torch.Generator().manual_seed(0)
    ratios = []
    for _ in range(reps):
        a = flip[torch.randint(0, len(flip), (len(flip),), generator=g)].mean()
        b = agree[torch.randint(0, len(agree), (len(agree),), generator=g)].mean()
        ratios.append(float(a / b))
    ratios.sort()
    return ratios[int(0.025 * reps)], ratios[int(0.975 * reps) - 1]


def build(args: argparse.Namespace) -> tuple[MegatronWorker, EmberPlugins]:
    """The fp32 worker with the r3_routing plugin configured (its shape from `train`)."""
    train = BackendConfig(
        model=None if args.hf_load else "tiny-moe",
        hf_load=args.hf_load,
        seed=args.seed,
        optimizer=OptimizerConfig(lr=1e-6),
        micro_batch_size=args.micro_batch_size,
    )
    plugins = EmberPlugins()
    plugins.register(r3_plugin, R3)
    if args.recompute:
        plugins.register(Recompute(), "recompute")
    plugins.check_pending()
    plugins.configure(RunConfig(train=train), {R3: R3RoutingConfig()})
    sampling = SamplingConfig(temperature=args.temperature)
    worker = MegatronWorker(train, AlgorithmConfig(), sampling, plugins, with_ref=False)
    cfg = worker.model_config
    print(
        f"model: {cfg.num_layers} layers, {cfg.num_experts} experts, top-{cfg.moe_router_topk}, "
        f"hidden {cfg.hidden_size}, vocab {cfg.vocab_size}; {args.hf_load or 'fresh weights'}; "
        f"Megatron fp32 on CPU, recompute {'on' if args.recompute else 'off'}, "
        f"{args.threads} thread(s)"
    )
    return worker, plugins


def micro_batches_of(batch: Any) -> list[list[Sample]]:
    return [[batch.samples[i] for i in mb] for step in batch.steps for mb in step]


def score(worker: MegatronWorker, plugins: EmberPlugins, samples: list[Sample], on: bool) -> dict:
    """Old log-probs and rollout metrics of `samples`, with the router calls of the forward."""
    cfg = worker.model_config
    log = RouterLog(worker.actor)
    with replay(plugins, on):
        batch = worker.prepare(0, samples)
        metrics = worker.log_rollout_data(0, batch)
    log.close()
    layers, experts = cfg.num_layers, cfg.num_experts
    matched = match_calls(log.calls, micro_batches_of(batch), layers, layers, experts)
    return {"batch": batch, "metrics": metrics, "matched": matched}


def report_routing(off: dict, on: dict) -> Tensor:
    """Print the routing figures; return [N] flipped-token flags over response tokens."""
    flipped, disagree, compared = flipped_tokens(off["batch"].samples, off["matched"])
    agree, total = used_agreement(on["matched"])
    rates = ", ".join(f"{int(d) / int(c):.2%}" for d, c in zip(disagree, compared, strict=True))
    flip = torch.cat(flipped)
    print()
    print("routing, fp32 actor vs bf16 engine, every forwarded position:")
    natural = off["metrics"]["rollout/routing_agreement"]
    print(f"  routing_agreement without replay         {natural:.4f}")
    print(f"  decisions that differ, per layer         {rates}")
    print(f"  routing_agreement with replay (scoring)  {agree / total:.6f} ({agree}/{total})")
    worker_view = on["metrics"].get("rollout/replay_agreement")
    if worker_view is not None:
        print(f"  the worker's rollout/replay_agreement    {worker_view:.6f}")
    print(
        f"response tokens {flip.numel()}, flipped (routing differs in >= 1 layer) "
        f"{int(flip.sum())} = {float(flip.float().mean()):.2%}"
    )
    return flip


def report_gaps(off: dict, on: dict, flip: Tensor) -> None:
    """Print the log-prob gap table, without and with replay."""
    rows: dict[bool, dict[str, float]] = {}
    intervals = {}
    for replayed, result in ((False, off), (True, on)):
        d = gaps(result["batch"])
        a = d.abs()
        extreme = (d.exp() - 1).abs() > EXTREME
        rows[replayed] = {
            "train_rollout_logprob_abs_diff": result["metrics"][
                "rollout/train_rollout_logprob_abs_diff"
            ],
            "  token mean, all": float(a.mean()),
            "  token mean, flipped tokens": float(a[flip].mean()),
            "  token mean, agreeing tokens": float(a[~flip].mean()),
            "  ratio flipped / agreeing": float(a[flip].mean() / a[~flip].mean()),
            # Means of heavy-tailed gaps can hang on a single token; the medians show the bulk.
            "  ratio of the medians": float(a[flip].median() / a[~flip].median()),
            "  largest gap on a flipped token": float(a[flip].max()),
            "extreme tokens, all": float(extreme.double().mean()),
            "extreme tokens, flipped": float(extreme[flip].double().mean()),
        }
        intervals[replayed] = ratio_interval(a[flip], a[~flip])
    print()
    print(f"  {'':36s}{'without replay':>16s}{'with replay':>16s}")
    for key in rows[False]:
        fmt = "{:16.3%}" if key.startswith("extreme") else "{:16.6f}"
        print(f"  {key:36s}" + "".join(fmt.format(rows[r][key]) for r in (False, True)))
        if key.endswith("ratio flipped / agreeing"):
            cells = "".join(f"{f'{lo:.2f} - {hi:.2f}':>16s}" for lo, hi in intervals.values())
            print(f"  {'    95% bootstrap interval':36s}{cells}")
    overall = rows[True]["  token mean, all"] / rows[False]["  token mean, all"]
    print(f"  overall token-mean gap, with / without replay: {overall:.3f}")


def time_steps(
    args: argparse.Namespace, worker: MegatronWorker, plugins: EmberPlugins, off: dict, on: dict
) -> None:
    """Warm up, check the replayed training step's experts, then time alternated steps."""
    cfg = worker.model_config
    log = RouterLog(worker.actor)
    worker.train(0, on["batch"])
    log.close()
    per_mb = cfg.num_layers * (2 if args.recompute else 1)
    matched = match_calls(
        log.calls, micro_batches_of(on["batch"]), per_mb, cfg.num_layers, cfg.num_experts
    )
    agree, total = used_agreement(matched)
    where = "forward + backward recompute" if args.recompute else "forward"
    print()
    print(
        f"routing_agreement with replay (training {where}): {agree / total:.6f} ({agree}/{total})"
    )
    if not args.reps:
        return
    with replay(plugins, False):
        worker.train(0, off["batch"])

    wall: dict[bool, list[float]] = {False: [], True: []}
    cpu: dict[bool, list[float]] = {False: [], True: []}
    for rep in range(args.reps):
        for replayed in (False, True) if rep % 2 == 0 else (True, False):  # ABBA against drift
            with replay(plugins, replayed):
                started, started_cpu = time.perf_counter(), time.process_time()
                worker.train(0, (on if replayed else off)["batch"])
                wall[replayed].append(time.perf_counter() - started)
                cpu[replayed].append(time.process_time() - started_cpu)
    for name, times in (("wall", wall), ("cpu", cpu)):
        ratios = [w / o for w, o in zip(times[True], times[False], strict=True)]
        median_off, median_on = statistics.median(times[False]), statistics.median(times[True])
        print(
            f"training step {name} time: without {median_off:.3f} s, with {median_on:.3f} s "
            f"(medians of {args.reps}); ratio with / without {median_on / median_off:.3f} "
            f"(pairs: {min(ratios):.3f} - {max(ratios):.3f})"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    init_distributed()
    try:
        worker, plugins = build(args)
        with tempfile.TemporaryDirectory() as tmp:
            path = args.hf_load or str(worker.export_hf(Path(tmp) / "hf"))
            samples = generate(args, path, plugins)
        off = score(worker, plugins, samples, False)
        on = score(worker, plugins, samples, True)
        flip = report_routing(off, on)
        report_gaps(off, on, flip)
        time_steps(args, worker, plugins, off, on)
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
