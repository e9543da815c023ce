"""Ember's one-GPU device check: the Megatron backend and the embedded engine, one JSON of results.

Parts, each timed and recorded as passed or failed with its figures (a part that fails or raises
does not stop the others; its traceback goes into the JSON):

- environment: versions, Transformer Engine's absence, the plugins found through the `ember`
  entry-point group, and unmet requirements of the distributions the check imports;
- train: two rollouts of synthetic samples, two optimizer steps each, in bf16 with megatron-core's
  optimizer (the backend picks it on a GPU): the first step of each rollout has train/ppo_kl
  exactly 0, the first of the run train/kl_loss exactly 0, then the actor moves; every loss and
  gradient norm finite;
- critic: one critic scores the same samples at two rollout temperatures: identical values;
- export: the actor exported as a transformers checkpoint and reloaded in transformers gives the
  logits and log-probs Megatron gives (max and mean absolute differences);
- r3: the embedded `hf` engine generates toy-task rollouts in bf16 from that export; the worker
  scores them with the r3_routing plugin off and on: routing agreement without replay, with
  replay (scoring and a training step, both must be exactly 1), and the train-rollout log-prob
  gap without and with replay (measured, not judged: `tools/bench_r3.py` defines the figures);
- true_on_policy: the trainer and the embedded engine under `rollout.true_on_policy`, in
  Megatron's dtype: the sampled tokens' log-probs, engine against trainer (equal bit for bit on
  the CPU; on a GPU the mismatch measured, or the mode's refusal of the device's kernels);
- offload_checkpoint, ipc, broadcast_hf: what a colocated run hands between the trainer and
  the engines (offload, checkpoint while offloaded, load bit for bit; a weight bucket as CUDA
  IPC handles opened in a second process; a gloo broadcast into the hf engine), described in
  `tools/device_check_parts.py`;
- tied_llama, upcycled_mixtral, pp_tied: the dense llama family with tied embeddings (one
  pipeline stage, then two) and a Mixtral sparse-upcycled from it, trained and pushed by
  broadcast into the engine, float32 on both sides so that their log-probs agree to 1e-4 per
  token, described in `tools/device_check_models.py` (with the upstream lines each guards).

A part the machine cannot run (pp_tied with fewer than two GPUs) records why and is skipped;
it does not fail the check.

On a GPU (the default) Megatron runs in bf16 on cuda:0 and the model is the GPU tests' served
shape. `--cpu-dry-run` runs the same code on the CPU with CUDA hidden: Megatron in fp32 (the
CPU optimizer updates fp32 weights only), the engine in bf16 as on the GPU, the tiny-moe preset
and fewer rollouts, so that CI keeps the check from rotting. `tools/device_check.sh` installs
what a GPU image lacks and runs this file.

Usage: python tools/device_check.py [--cpu-dry-run] [--out device_check.json]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata as metadata
import importlib.util
import json
import math
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# gpu_support (the GPU tests' helpers) and bench_r3 (the R3 figures) are imported, not copied.
sys.path[:0] = [str(ROOT / "integration_tests"), str(ROOT / "tools")]

DISTRIBUTIONS = (
    "ember-core",
    "ember-megatron-backend",
    "ember-rollout",
    "ember-r3-routing",
    "ember-ci-kl-checker",
    "megatron-core",
    "transformers",
)
"""Distributions whose own requirements must hold where the check runs (ember's CLI and Ray
driver, `ember`, are not among them: Ray does not fit on the GPU runner)."""
VERSIONS = (*DISTRIBUTIONS, "torch", "safetensors", "tokenizers", "pluggy", "aiohttp", "numpy")
PLUGINS = ("r3_routing", "ci_kl_checker")
TRAIN_KEYS = ("train/loss", "train/pg_loss", "train/ppo_kl", "train/kl_loss", "train/grad_norm")
"""The per-step metrics recorded by the train part."""


@dataclass(frozen=True, kw_only=True)
class Sizes:
    """How large the check runs: a GPU run, or the CPU dry run."""

    device: str
    """torch device of Megatron and of the engine."""
    dtype: str
    """Megatron parameter dtype (BackendConfig.dtype)."""
    model_overrides: dict[str, Any] = field(default_factory=dict)
    """ModelConfig fields over the tiny-moe preset."""
    prompts: int
    """Toy-task prompts per R3 rollout."""
    samples_per_prompt: int
    """Engine samples per prompt."""
    response_len: int
    """Most tokens per engine response."""
    logprob_tolerance: float
    """Largest mean |transformers - Megatron| log-prob difference the export part accepts."""


def gpu_sizes() -> Sizes:
    from gpu_support import SERVED_MODEL

    # bf16 on both sides of the export: the GPU tests accept a mean gap below 0.05 there.
    return Sizes(
        device="cuda",
        dtype="bfloat16",
        model_overrides=dict(SERVED_MODEL),
        prompts=16,
        samples_per_prompt=8,
        response_len=32,
        logprob_tolerance=0.05,
    )


CPU_SIZES = Sizes(
    device="cpu",
    dtype="float32",
    prompts=4,
    samples_per_prompt=4,
    response_len=8,
    logprob_tolerance=1e-3,
)


class Part:
    """What one part found: figures, and the expectations that failed."""

    def __init__(self) -> None:
        self.figures: dict[str, Any] = {}
        self.failures: list[str] = []
        self.skipped: str | None = None

    def skip(self, reason: str) -> None:
        """Note that this machine cannot run the part, and why (the part then returns)."""
        self.skipped = reason

    def record(self, **figures: Any) -> None:
        self.figures.update(figures)

    def expect(self, ok: bool, what: str) -> None:
        """Note `what` (the expectation, with the figure that broke it) unless `ok`."""
        if not ok:
            self.failures.append(what)


def _fraction(agreeing: float, compared: float) -> float:
    """agreeing / compared, NaN (which fails every judgement) when nothing was compared."""
    return agreeing / compared if compared else math.nan


def model_shape(sizes: Sizes) -> dict[str, int]:
    """Vocabulary and routing shape of the model the parts build."""
    from ember_megatron_backend.config import BackendConfig

    cfg = BackendConfig(model_overrides=sizes.model_overrides).model_config()
    return {
        "vocab": cfg.vocab_size,
        "layers": cfg.num_layers,
        "experts": cfg.num_experts,
        "topk": cfg.moe_router_topk,
    }


_owns_distributed = False
"""Whether this run set up torch.distributed (and so tears it down at the end)."""


def ensure_distributed() -> None:
    """One rank, world size 1 (NCCL on a GPU, gloo on the CPU); later calls do nothing."""
    global _owns_distributed
    import torch.distributed as dist

    from ember_megatron_backend.parallel import init_distributed

    fresh = not dist.is_initialized()
    init_distributed()
    _owns_distributed = _owns_distributed or fresh


# --------------------------------------------------------------------------------------------
# Parts
# --------------------------------------------------------------------------------------------


def unmet_requirements(names: tuple[str, ...]) -> list[str]:
    """Each requirement (extras aside) of the distributions `names` that the installed
    versions do not meet, and each of those distributions that is missing."""
    from packaging.requirements import Requirement

    unmet = []
    for name in names:
        try:
            requires = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:
            unmet.append(f"{name}: not installed")
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                have = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                unmet.append(f"{name} needs {req}: not installed")
                continue
            if not req.specifier.contains(have, prereleases=True):
                unmet.append(f"{name} needs {req}: {have} installed")
    return unmet


def part_environment(part: Part, sizes: Sizes) -> None:
    import torch

    from ember_core.plugins import installed_plugins

    versions = {}
    for name in VERSIONS:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    gpu = torch.cuda.is_available()
    plugins = {name: p.distribution for name, p in installed_plugins().items()}
    unmet = unmet_requirements(DISTRIBUTIONS)
    part.record(
        python=platform.python_version(),
        torch_cuda=torch.version.cuda,
        cuda_available=gpu,
        gpu=torch.cuda.get_device_name(0) if gpu else None,
        versions=versions,
        transformer_engine=importlib.util.find_spec("transformer_engine") is not None,
        entry_point_plugins=plugins,
        unmet_requirements=unmet,
    )
    part.expect(gpu == (sizes.device == "cuda"), f"torch.cuda.is_available() is {gpu}")
    part.expect(not unmet, f"unmet requirements: {unmet}")
    missing = [name for name in PLUGINS if name not in plugins]
    part.expect(not missing, f"plugins missing from the `ember` entry points: {missing}")


def part_train(part: Part, sizes: Sizes) -> None:
    from gpu_support import megatron_worker, synthetic_samples

    from ember_core.certify import exactly_zero, finite  # the judgements `ember certify` makes

    ensure_distributed()
    shape = model_shape(sizes)
    worker = megatron_worker(dtype=sizes.dtype, model_overrides=sizes.model_overrides)
    optimizer = worker.actor_optimizer
    part.record(
        optimizer=optimizer.kind,
        optimizer_class=type(optimizer.optimizer).__name__,
        param_dtype=str(next(worker.actor.parameters()).dtype).removeprefix("torch."),
    )
    if sizes.device == "cuda":
        part.expect(optimizer.kind == "megatron", f"optimizer {optimizer.kind}, not megatron")
    rollouts = []
    for rollout_id in (0, 1):
        batch = worker.prepare(rollout_id, synthetic_samples(rollout_id, **shape))
        rollouts.append([{k: m[k] for k in TRAIN_KEYS} for m in worker.train(rollout_id, batch)])
    first, second = rollouts[0][0], rollouts[1][0]
    part.record(
        first_step_ppo_kl=first["train/ppo_kl"],
        first_step_kl_loss=first["train/kl_loss"],
        rollout_1_first_step_ppo_kl=second["train/ppo_kl"],
        rollout_1_first_step_kl_loss=second["train/kl_loss"],
        steps=rollouts,
    )
    part.expect(exactly_zero(first["train/ppo_kl"]), f"first step ppo_kl {first['train/ppo_kl']!r}")
    part.expect(
        exactly_zero(first["train/kl_loss"]), f"first step kl_loss {first['train/kl_loss']!r}"
    )
    part.expect(
        exactly_zero(second["train/ppo_kl"]),
        f"rollout 1 first step ppo_kl {second['train/ppo_kl']!r}",
    )
    part.expect(
        second["train/kl_loss"] > 0.0,
        f"rollout 1 kl_loss {second['train/kl_loss']!r}: two steps did not move the actor",
    )
    for step in (s for steps in rollouts for s in steps):
        part.expect(finite(*step.values()), f"a step with a non-finite metric: {step}")
        part.expect(step["train/grad_norm"] > 0, f"a step with grad_norm {step['train/grad_norm']}")


def part_critic(part: Part, sizes: Sizes) -> None:
    import torch
    from gpu_support import critic_values, megatron_worker, synthetic_samples

    ensure_distributed()
    worker = megatron_worker(
        dtype=sizes.dtype, model_overrides=sizes.model_overrides, advantage_estimator="ppo"
    )
    scored = critic_values(worker, synthetic_samples(0, **model_shape(sizes)), (1.0, 0.4))
    (hot_values, hot_lp), (cold_values, cold_lp) = scored[1.0], scored[0.4]
    hot, cold = torch.cat(hot_values), torch.cat(cold_values)
    value_diff = float((hot - cold).abs().max())
    logprob_diff = float((torch.cat(hot_lp) - torch.cat(cold_lp)).abs().max())
    part.record(
        temperatures=[1.0, 0.4],
        max_abs_value_diff=value_diff,
        mean_abs_value=float(hot.abs().mean()),
        max_abs_actor_logprob_diff=logprob_diff,
    )
    part.expect(torch.equal(hot, cold), f"values differ across temperatures by {value_diff}")
    part.expect(float(hot.abs().sum()) > 0, "the critic predicts 0 everywhere: nothing compared")
    part.expect(logprob_diff > 0, "actor log-probs ignore the temperature")


def part_export(part: Part, sizes: Sizes) -> None:
    import torch
    from gpu_support import ROLLOUT_TEMPERATURE, hf_log_probs, megatron_worker, synthetic_samples
    from transformers import AutoModelForCausalLM

    from ember_core.certify import at_most, finite  # the judgements `ember certify` makes
    from ember_core.types import pack_samples
    from ember_megatron_backend.forward import model_inputs

    ensure_distributed()
    dtype = getattr(torch, sizes.dtype)
    worker = megatron_worker(dtype=sizes.dtype, model_overrides=sizes.model_overrides)
    samples = synthetic_samples(0, **model_shape(sizes))
    ours = worker.prepare(0, samples).log_probs
    with tempfile.TemporaryDirectory(prefix="ember-device-check-") as tmp:
        worker.export_hf(tmp, dtype=dtype)
        hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype, local_files_only=True)
        hf = hf.to(sizes.device).eval()
    theirs = hf_log_probs(hf, samples, ROLLOUT_TEMPERATURE)
    gaps = torch.cat([(a - b).abs() for a, b in zip(theirs, ours, strict=True)])
    first = samples[0]
    with torch.no_grad():
        worker.actor.eval()
        megatron_logits = worker.actor(
            **model_inputs(pack_samples([first])), runtime_gather_output=True
        )[0, : first.total_length].float()
        hf_logits = hf(input_ids=torch.tensor([first.tokens], device=sizes.device)).logits[0]
    part.record(
        architecture=hf.config.architectures,
        dtype=sizes.dtype,
        max_abs_logprob_diff=float(gaps.max()),
        mean_abs_logprob_diff=float(gaps.mean()),
        max_abs_logit_diff_sample_0=float((hf_logits.float() - megatron_logits).abs().max()),
        tolerance_mean=sizes.logprob_tolerance,
    )
    mean = float(gaps.mean())
    part.expect(finite(mean, float(gaps.max())), "non-finite log-prob differences")
    part.expect(at_most(mean, sizes.logprob_tolerance), f"mean log-prob gap {mean}")


def engine_rollouts(
    sizes: Sizes,
    path: str,
    plugins: Any,
    *,
    dtype: str = "bfloat16",
    true_on_policy: bool = False,
) -> tuple[list[Any], float]:
    """One toy-task rollout from the hf engine serving `path` (bf16 unless `dtype` says), under
    `rollout.true_on_policy` where asked, through the rollout pipeline (rewards, and routed
    experts checked and stored by the plugin); its seconds."""
    from ember_core.config import SamplingConfig
    from ember_rollout import (
        DataConfig,
        EngineConfig,
        HFEngineConfig,
        RolloutGenerator,
        RolloutSections,
        ToyTaskConfig,
    )
    from ember_rollout.hf_engine import HFEngine

    config = HFEngineConfig(model_path=path, dtype=dtype, device=sizes.device)
    sections = RolloutSections(
        engine=EngineConfig(kind="hf", hf=config),
        data=DataConfig(toy=ToyTaskConfig(num_prompts=sizes.prompts)),
    )
    sampling = SamplingConfig(
        rollout_batch_size=sizes.prompts,
        n_samples_per_prompt=sizes.samples_per_prompt,
        max_response_len=sizes.response_len,
    )

    async def rollout() -> Any:
        async with HFEngine(config, true_on_policy=true_on_policy) as engine:
            generator = RolloutGenerator.from_config(
                engine=engine, sampling=sampling, sections=sections, plugins=plugins
            )
            return await generator.generate(0)

    started = time.perf_counter()
    batch = asyncio.run(rollout())
    return batch.samples, time.perf_counter() - started


def part_r3(part: Part, sizes: Sizes) -> None:
    import bench_r3
    import torch

    from ember_core.certify import exactly_one, finite  # the judgements `ember certify` makes
    from ember_core.config import AlgorithmConfig, SamplingConfig
    from ember_core.plugins import EmberPlugins
    from ember_megatron_backend.config import BackendConfig, OptimizerConfig
    from ember_megatron_backend.worker import MegatronWorker
    from ember_r3_routing import R3RoutingConfig
    from ember_rollout.tokenizer import save_toy_tokenizer

    ensure_distributed()
    plugins = EmberPlugins.load([bench_r3.R3])  # through the entry point, as `ember train` does
    train = BackendConfig(
        model_overrides=sizes.model_overrides,
        dtype=sizes.dtype,
        micro_batch_size=8,
        optimizer=OptimizerConfig(lr=1e-6),
    )
    plugins.configure(bench_r3.RunConfig(train=train), {bench_r3.R3: R3RoutingConfig()})
    worker = MegatronWorker(train, AlgorithmConfig(), SamplingConfig(), plugins, with_ref=False)
    cfg = worker.model_config
    with tempfile.TemporaryDirectory(prefix="ember-device-check-") as tmp:
        worker.export_hf(tmp, dtype=torch.bfloat16)
        save_toy_tokenizer(tmp)
        samples, seconds = engine_rollouts(sizes, tmp, plugins)
    off = bench_r3.score(worker, plugins, samples, False)
    on = bench_r3.score(worker, plugins, samples, True)
    flipped, _, _ = bench_r3.flipped_tokens(off["batch"].samples, off["matched"])
    scoring = bench_r3.used_agreement(on["matched"])
    log = bench_r3.RouterLog(worker.actor)
    try:
        worker.train(0, on["batch"])
    finally:
        log.close()
    layers, experts = cfg.num_layers, cfg.num_experts
    matched = bench_r3.match_calls(
        log.calls, bench_r3.micro_batches_of(on["batch"]), layers, layers, experts
    )
    training = bench_r3.used_agreement(matched)
    gap = "rollout/train_rollout_logprob_abs_diff"
    without, with_replay = off["metrics"][gap], on["metrics"][gap]
    natural = off["metrics"]["rollout/routing_agreement"]
    part.record(
        engine="hf, bfloat16",
        megatron_dtype=sizes.dtype,
        samples=len(samples),
        response_tokens=sum(s.response_length for s in samples),
        generate_seconds=seconds,
        routing_agreement_without_replay=natural,
        flipped_token_fraction=float(torch.cat(flipped).float().mean()),
        routing_agreement_with_replay_scoring=scoring[0] / scoring[1],
        routing_agreement_with_replay_training=training[0] / training[1],
        replay_agreement_metric=on["metrics"].get("rollout/replay_agreement"),
        train_rollout_logprob_abs_diff_without_replay=without,
        train_rollout_logprob_abs_diff_with_replay=with_replay,
        gap_ratio_with_over_without=with_replay / without if without else None,
    )
    part.expect(0.0 <= natural <= 1.0, f"routing_agreement without replay {natural}")
    part.expect(exactly_one(_fraction(*scoring)), f"replayed scoring agreement {scoring}")
    part.expect(exactly_one(_fraction(*training)), f"replayed training agreement {training}")
    replayed = on["metrics"].get("rollout/replay_agreement")
    part.expect(exactly_one(replayed), f"rollout/replay_agreement {replayed}")
    part.expect(finite(without, with_replay), f"gaps {without}, {with_replay}")


def part_true_on_policy(part: Part, sizes: Sizes) -> None:
    """`rollout.true_on_policy` on the check's device: the trainer (Megatron, `sizes.dtype`)
    and the embedded engine serving its export in the same dtype both run `ember_core.exact`;
    the sampled tokens' log-probs, engine against the trainer's old log-probs. On the CPU they
    must be equal bit for bit. On a GPU this records what a run gets: the mismatch, or the
    mode's refusal where the device's products are not batch-invariant (`exact.check_linear`);
    the kernels are cuBLAS's, not the CPU's the mode was measured with."""
    import torch

    from ember_core.config import AlgorithmConfig, SamplingConfig
    from ember_core.exact import ExactModeError
    from ember_core.plugins import EmberPlugins
    from ember_megatron_backend.config import BackendConfig
    from ember_megatron_backend.worker import MegatronWorker
    from ember_rollout.tokenizer import save_toy_tokenizer

    ensure_distributed()
    train = BackendConfig(model_overrides=sizes.model_overrides, dtype=sizes.dtype)
    sampling = SamplingConfig(true_on_policy=True)
    try:
        worker = MegatronWorker(train, AlgorithmConfig(), sampling, with_ref=False)
    except ExactModeError as exc:
        part.record(refused=str(exc))
        part.expect(sizes.device != "cpu", f"the mode refused the CPU: {exc}")
        return
    with tempfile.TemporaryDirectory(prefix="ember-device-check-") as tmp:
        worker.export_hf(tmp, dtype=getattr(torch, sizes.dtype))
        save_toy_tokenizer(tmp)
        samples, seconds = engine_rollouts(
            sizes, tmp, EmberPlugins(), dtype=sizes.dtype, true_on_policy=True
        )
    trained = worker.prepare(0, samples).log_probs
    engine = [
        torch.tensor(s.rollout_log_probs, dtype=t.dtype)
        for s, t in zip(samples, trained, strict=True)
    ]
    differ = sum(int((e != t.cpu()).sum()) for e, t in zip(engine, trained, strict=True))
    tokens = sum(e.numel() for e in engine)
    largest = max(float((e - t.cpu()).abs().max()) for e, t in zip(engine, trained, strict=True))
    part.record(
        dtype=sizes.dtype,
        samples=len(samples),
        response_tokens=tokens,
        differing_log_probs=differ,
        max_abs_logprob_diff=largest,
        generate_seconds=seconds,
    )
    part.expect(tokens > 0, "no response tokens to compare")
    if sizes.device == "cpu":
        part.expect(differ == 0, f"{differ} of {tokens} log-probs differ, by up to {largest}")


def _handoff_parts() -> dict[str, Callable[[Part, Sizes], None]]:
    import device_check_parts as parts

    return {
        "offload_checkpoint": parts.part_offload_checkpoint,
        "ipc": parts.part_ipc,
        "broadcast_hf": parts.part_broadcast_hf,
    }


def _model_parts() -> dict[str, Callable[[Part, Sizes], None]]:
    import device_check_models as models

    return {
        "tied_llama": models.part_tied_llama,
        "upcycled_mixtral": models.part_upcycled_mixtral,
        "pp_tied": models.part_pp_tied,
    }


PARTS: dict[str, Callable[[Part, Sizes], None]] = {
    "environment": part_environment,
    "train": part_train,
    "critic": part_critic,
    "export": part_export,
    "r3": part_r3,
    "true_on_policy": part_true_on_policy,
    **_handoff_parts(),
    **_model_parts(),
}


# --------------------------------------------------------------------------------------------
# Running and reporting
# --------------------------------------------------------------------------------------------


def run_part(fn: Callable[[Part, Sizes], None], sizes: Sizes) -> dict[str, Any]:
    part = Part()
    started = time.perf_counter()
    error = None
    try:
        fn(part, sizes)
    except Exception:
        error = traceback.format_exc()
    return {
        "passed": error is None and not part.failures,
        "seconds": round(time.perf_counter() - started, 3),
        "figures": part.figures,
        "failures": part.failures,
        "error": error,
        "skipped": part.skipped,
    }


def summary_lines(results: dict[str, Any]) -> list[str]:
    lines = [f"device check ({results['mode']}): {'PASSED' if results['passed'] else 'FAILED'}"]
    for name, result in results["parts"].items():
        scalars = {
            k: v for k, v in result["figures"].items() if isinstance(v, int | float | str | None)
        }
        figures = ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in scalars.items()
        )
        verdict = "FAIL" if not result["passed"] else "skip" if result["skipped"] else "pass"
        lines.append(f"  {verdict} {name} ({result['seconds']:.1f} s): {figures}")
        if result["skipped"]:
            lines.append(f"    skipped: {result['skipped']}")
        lines += [f"    failed: {what}" for what in result["failures"]]
        if result["error"]:
            lines.append(f"    error: {result['error'].strip().splitlines()[-1]}")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="run every part on the CPU (CUDA hidden), fp32 Megatron, CI-sized",
    )
    parser.add_argument(
        "--requirements-only",
        action="store_true",
        help="only check the installed distributions' requirements (no GPU, nothing imported)",
    )
    parser.add_argument("--out", default="device_check.json", help="where the JSON goes")
    parser.add_argument(
        "--parts", nargs="+", choices=sorted(PARTS), default=list(PARTS), help="parts to run"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.requirements_only:
        unmet = unmet_requirements(DISTRIBUTIONS)
        for line in unmet:
            print(f"device_check: unmet: {line}")
        print(
            f"device_check: requirements of {', '.join(DISTRIBUTIONS)}: "
            + ("all met" if not unmet else f"{len(unmet)} unmet")
        )
        return 1 if unmet else 0
    if args.cpu_dry_run:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch first looks for a GPU
    import torch

    if not args.cpu_dry_run and not torch.cuda.is_available():
        print("device_check: torch sees no CUDA GPU (use --cpu-dry-run on a CPU)", file=sys.stderr)
        return 2
    if args.cpu_dry_run:
        # The dry run's operations are tiny: one intra-op thread, since oversubscribed OpenMP
        # threads on a shared CPU make them many times slower (bench_r3.py does the same).
        torch.set_num_threads(1)
    sizes = CPU_SIZES if args.cpu_dry_run else gpu_sizes()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "mode": "cpu-dry-run" if args.cpu_dry_run else "gpu",
        "finished": False,
        "passed": False,
        "sizes": asdict(sizes),
        "parts": {},
    }
    started = time.perf_counter()
    try:
        for name in args.parts:
            print(f"device_check: {name} ...", flush=True)
            results["parts"][name] = run_part(PARTS[name], sizes)
            # Written after every part: a run stopped at its time limit keeps what it measured.
            out.write_text(json.dumps(results, indent=2) + "\n")
    finally:
        if _owns_distributed:
            from ember_megatron_backend.parallel import destroy_distributed

            destroy_distributed()
    results["finished"] = True
    results["passed"] = all(r["passed"] for r in results["parts"].values())
    results["seconds"] = round(time.perf_counter() - started, 3)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print("\n".join(summary_lines(results)))
    print(f"device_check: results in {out}")
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
