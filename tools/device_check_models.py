"""The device check's model parts: the dense llama family with tied embeddings and a Mixtral
sparse-upcycled from it, through the trainer and the engine on the check's device
(`tools/device_check.py` runs them; each has a CPU dry-run form).

The runner reaches no hub and carries a few tens of MiB, so the models are built in code: the
`tiny-llama` preset (SmolLM2's features: tied embeddings, three query heads per key/value head)
and `ember.upcycle.upcycle` of its export. Megatron and the engine both run in float32 here,
whatever the check's dtype, so that their log-probs can be held to `TOLERANCE` per token.

- tied_llama: the shared weight on one pipeline stage, with the device's optimizer. The model
  has no output weight of its own, the export and the weight push name no `lm_head.weight`,
  one step on tokens below `SEEN_VOCAB` moves every embedding row above it (only the output
  layer's gradient reaches those rows: megatron-core's tying, language_module.py 197-202, and
  its DDP hook, distributed_data_parallel.py 437-439). Then the embedded engine, started from
  the export before the step, takes the trained weights by broadcast: its output layer must be
  the trained embedding bit for bit (transformers ties it, as sglang 0.5.23's llama.py 570-571
  does; llama.py 744-745 and 795-796 skip any `lm_head.weight`, in the loaders that
  /update_weights_from_distributed reaches through model_runner_components/weight_updater.py
  324-332), and its log-probs of its own rollout must match the trainer's.
- upcycled_mixtral: the dense export upcycled to Mixtral (4 experts, top-2). With zero noise
  Megatron's Mixtral gives the dense model's log-probs (the upcycling and the mixtral family on
  this device's kernels). With noise, under the r3_routing plugin: the push carries an
  untied `lm_head.weight` (sglang 0.5.23's mixtral.py 355 builds its own head, and its
  load_weights, 392-479, fills it only from that name), a step moves the output layer and the
  embedding apart, the engine serves the pushed head, and with replay the trainer's log-probs
  of the engine's rollout match the engine's.
- pp_tied: two pipeline stages, one process each: the last stage's copy of the embedding
  starts as the first stage's (megatron-core language_module.py 212-245: zeroed, then
  all-reduced over the embedding group, after `.cuda()` on a GPU), and after a step both copies
  are still equal and the first stage's unseen rows moved (only the last stage's output layer
  gives them a gradient: finalize_model_grads.py 164-259 all-reduces the two copies'
  gradients). The push from both stages names the embedding once and no `lm_head.weight`,
  and the export reloads in transformers with the trainer's log-probs. NCCL puts one rank per
  GPU, so on a one-GPU runner this part is skipped, and says so.

SGLang itself does not fit on the runner; these parts hold what Ember sends to it against the
rules of sglang's loaders cited above, and the embedded engine stands in as the receiver.
GGUF import (`ember import-gguf`) runs on the CPU only (numpy dequantisation through the gguf
package, which the runner does not carry): nothing of it reaches a GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# ember.upcycle from the checkout where `ember` is not installed (the runner: its driver needs
# Ray); the module itself needs only transformers, safetensors and ember_rollout.
sys.path.append(str(ROOT / "packages/ember/src"))

TOLERANCE = 1e-4
"""Largest per-token |trainer - engine| log-prob gap these parts accept: both in float32 with
different kernels (Megatron's layers against transformers', other summation orders) through two
layers and a log-softmax over logits of order 1-10, where float32 rounding (eps 1.2e-7) gave
at most 3e-6 in the CPU dry run; a wrong or stale weight moves log-probs by 1e-3 and more (the
engine before a step of lr 1e-3: about 0.5)."""
TEMPERATURE = 0.8
"""Rollout temperature: the engine samples at it and the trainer divides its logits by it."""
SEEN_VOCAB = 64
"""Training tokens are drawn below this id, so embedding rows at and above it take gradient
through the output layer alone."""
EXPERTS, TOP_K = 4, 2
"""The upcycled Mixtral's experts per layer and experts per token."""


def train_config(hf_load: str | None = None) -> Any:
    """A float32 `train` section: the tiny-llama preset (or `hf_load`'s model), Adam without
    weight decay (a row with no gradient does not move), lr 1e-3, one step per rollout."""
    from ember_megatron_backend.config import BackendConfig, OptimizerConfig

    fresh = {"model": "tiny-llama", "model_overrides": {"init_method_std": 0.1}}
    return BackendConfig(
        **(fresh if hf_load is None else {"hf_load": hf_load}),
        optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.0),
        micro_batch_size=8,
        dtype="float32",
    )


def sampling_config(sizes: Any | None = None) -> Any:
    """Rollout settings at `TEMPERATURE` (the check's rollout sizes, when given)."""
    from ember_core.config import SamplingConfig

    if sizes is None:
        return SamplingConfig(temperature=TEMPERATURE)
    return SamplingConfig(
        rollout_batch_size=sizes.prompts,
        n_samples_per_prompt=sizes.samples_per_prompt,
        max_response_len=sizes.response_len,
        temperature=TEMPERATURE,
    )


def make_worker(train: Any, sampling: Any, plugins: Any = None) -> Any:
    from ember_core.config import AlgorithmConfig
    from ember_megatron_backend.worker import MegatronWorker

    return MegatronWorker(train, AlgorithmConfig(), sampling, plugins, with_ref=False)


def training_samples(worker: Any, rollout_id: int = 0) -> list[Any]:
    """16 synthetic samples with random rewards and tokens below `SEEN_VOCAB`; routed experts
    only for an MoE model."""
    from gpu_support import synthetic_samples

    cfg = worker.model_config
    samples = synthetic_samples(
        rollout_id,
        vocab=SEEN_VOCAB,
        layers=cfg.num_layers,
        experts=max(cfg.num_experts, 1),
        topk=max(cfg.moe_router_topk, 1),
    )
    if cfg.num_experts:
        return samples
    return [dataclasses.replace(s, rollout_routed_experts=None) for s in samples]


def unseen_rows_moved(before: Any, after: Any) -> tuple[int, int]:
    """(rows at and above SEEN_VOCAB that changed, rows at and above SEEN_VOCAB)."""
    changed = (after[SEEN_VOCAB:] != before[SEEN_VOCAB:]).any(dim=1)
    return int(changed.sum()), int(changed.numel())


@contextlib.contextmanager
def float32_engine(path: str, sizes: Any) -> Iterator[tuple[Any, Any]]:
    """A started float32 hf engine serving `path` on the check's device, and `run(fn, *args)`,
    which runs coroutine function `fn(engine, *args)` on the engine's event loop."""
    from ember_rollout import HFEngineConfig
    from ember_rollout.hf_engine import HFEngine

    config = HFEngineConfig(model_path=path, dtype="float32", device=sizes.device)
    engine = HFEngine(config)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(engine.start())
        yield engine, lambda fn, *args: loop.run_until_complete(fn(engine, *args))
    finally:
        loop.run_until_complete(engine.shutdown())
        loop.close()


async def engine_rollout(engine: Any, sizes: Any, rollout_id: int, plugins: Any = None) -> list:
    """One toy-task rollout from `engine` at `TEMPERATURE` (routed experts when a plugin asks)."""
    from ember_rollout import (
        DataConfig,
        EngineConfig,
        RolloutGenerator,
        RolloutSections,
        ToyTaskConfig,
    )

    sections = RolloutSections(
        engine=EngineConfig(kind="hf", hf=engine.config),
        data=DataConfig(toy=ToyTaskConfig(num_prompts=sizes.prompts)),
    )
    generator = RolloutGenerator.from_config(
        engine=engine, sampling=sampling_config(sizes), sections=sections, plugins=plugins
    )
    return (await generator.generate(rollout_id)).samples


def logprob_gaps(batch: Any) -> Any:
    """Per response token, |trainer - engine| log-prob, in float64."""
    import torch

    train = torch.cat([lp.detach().cpu().double() for lp in batch.log_probs])
    engine = torch.cat([torch.tensor(s.rollout_log_probs) for s in batch.samples]).double()
    return (train - engine).abs()


async def push(engine: Any, worker: Any) -> dict[str, Any]:
    import torch
    from device_check_parts import push_by_broadcast

    return await push_by_broadcast(engine, worker.hf_weights, version="1", dtype=torch.float32)


def export(worker: Any, path: Path) -> dict[str, Any]:
    """Write `worker`'s actor as a float32 checkpoint with the toy tokenizer; its config.json."""
    import torch

    from ember_rollout.tokenizer import save_toy_tokenizer

    worker.export_hf(path, dtype=torch.float32)
    save_toy_tokenizer(path)
    return json.loads((path / "config.json").read_text())


def checkpoint_names(path: Path) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for file in path.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            names |= set(f.keys())
    return names


# --------------------------------------------------------------------------------------------
# tied_llama
# --------------------------------------------------------------------------------------------


def part_tied_llama(part: Any, sizes: Any) -> None:
    import torch
    from device_check import ensure_distributed

    ensure_distributed()
    worker = make_worker(train_config(), sampling_config(sizes))
    model = worker.actor.module
    embedding = model.embedding.word_embeddings.weight
    own_output = [n for n, _ in model.named_parameters() if n.startswith("output_layer.")]
    pushed_names = [n for n, _ in worker.hf_weights()]
    before = embedding.detach().cpu().clone()
    with tempfile.TemporaryDirectory(prefix="ember-device-check-") as tmp:
        config = export(worker, Path(tmp))
        written = checkpoint_names(Path(tmp))
        with float32_engine(tmp, sizes) as (engine, run):
            stale = run(engine_rollout, sizes, 0)  # from the weights before the step
            metrics = worker.train(0, worker.prepare(0, training_samples(worker)))
            after = embedding.detach().cpu().clone()
            pushed = run(push, worker)
            head = engine.model.get_output_embeddings().weight
            tied_in_engine = head is engine.model.get_input_embeddings().weight
            head_is_trained = torch.equal(head.detach().cpu(), after)
            served = engine.weight_version
            fresh = run(engine_rollout, sizes, 1)
    moved, unseen = unseen_rows_moved(before, after)
    gap = logprob_gaps(worker.prepare(1, fresh))
    stale_gap = logprob_gaps(worker.prepare(1, stale))
    part.record(
        model=worker.model_config.family,
        megatron_device=str(embedding.device),
        optimizer=worker.actor_optimizer.kind,
        float32_matmul_precision=torch.get_float32_matmul_precision(),
        share_embeddings_and_output_weights=model.share_embeddings_and_output_weights,
        output_layer_parameters=own_output,
        zero_out_wgrad=getattr(embedding, "zero_out_wgrad", False),
        pushed_tensors=len(pushed_names),
        pushed_lm_head="lm_head.weight" in pushed_names,
        pushed_embedding="model.embed_tokens.weight" in pushed_names,
        tie_word_embeddings=config.get("tie_word_embeddings"),
        checkpoint_lm_head="lm_head.weight" in written,
        grad_norm=metrics[0]["train/grad_norm"],
        unseen_rows=unseen,
        unseen_rows_moved=moved,
        broadcast_buckets=pushed["buckets"],
        engine_head_tied=tied_in_engine,
        engine_head_is_trained_embedding=head_is_trained,
        served_version=served,
        response_tokens=int(gap.numel()),
        max_abs_logprob_diff=float(gap.max()),
        mean_abs_logprob_diff=float(gap.mean()),
        max_abs_logprob_diff_stale_engine=float(stale_gap.max()),
        tolerance=TOLERANCE,
    )
    part.expect(
        model.share_embeddings_and_output_weights and not own_output,
        f"the output layer holds its own parameters {own_output}",
    )
    part.expect("lm_head.weight" not in pushed_names, "the push names lm_head.weight")
    part.expect("model.embed_tokens.weight" in pushed_names, "the push lacks the embedding")
    part.expect(config.get("tie_word_embeddings") is True, "the export is not tied")
    part.expect("lm_head.weight" not in written, "the export writes lm_head.weight")
    part.expect(
        unseen > 0 and moved == unseen,
        f"{moved} of {unseen} embedding rows of unseen tokens moved: the output layer's "
        "gradient did not reach the shared weight",
    )
    part.expect(
        tied_in_engine and head_is_trained, "the engine's output layer is not the pushed embedding"
    )
    part.expect(served == "1", f"the engine serves version {served!r}")
    part.expect(
        float(gap.max()) < TOLERANCE, f"trainer - engine log-probs up to {float(gap.max())}"
    )
    part.expect(
        float(stale_gap.max()) > 10 * TOLERANCE,
        f"the step moved log-probs by {float(stale_gap.max())} only: the parity proves nothing",
    )


# --------------------------------------------------------------------------------------------
# upcycled_mixtral
# --------------------------------------------------------------------------------------------


def r3_plugins(train: Any) -> Any:
    """The r3_routing plugin loaded through its entry point and configured for `train`, as the
    r3 part does."""
    import bench_r3

    from ember_core.plugins import EmberPlugins
    from ember_r3_routing import R3RoutingConfig

    plugins = EmberPlugins.load([bench_r3.R3])
    plugins.configure(bench_r3.RunConfig(train=train), {bench_r3.R3: R3RoutingConfig()})
    return plugins


def part_upcycled_mixtral(part: Any, sizes: Any) -> None:
    import bench_r3
    import torch
    from device_check import ensure_distributed

    from ember.upcycle import upcycle

    ensure_distributed()
    sampling = sampling_config(sizes)
    dense = make_worker(train_config(), sampling)
    probe = training_samples(dense, rollout_id=1)
    with tempfile.TemporaryDirectory(prefix="ember-device-check-") as tmp:
        root = Path(tmp)
        export(dense, root / "dense")
        dense_lp = [lp.cpu() for lp in dense.prepare(0, probe).log_probs]
        del dense
        # Identical experts: whatever the router picks, top-2 weights renormalised to 1 give
        # the dense MLP (upcycle.py's module docstring).
        upcycle(root / "dense", root / "copies", experts=EXPERTS, top_k=TOP_K, noise=0.0)
        copies = make_worker(train_config(str(root / "copies")), sampling)
        copies_lp = [lp.cpu() for lp in copies.prepare(0, probe).log_probs]
        del copies
        copies_gap = torch.cat([(a - b).abs() for a, b in zip(dense_lp, copies_lp, strict=True)])
        # Experts that differ and routers that are far from uniform: routing decides.
        upcycle(
            root / "dense",
            root / "moe",
            experts=EXPERTS,
            top_k=TOP_K,
            noise=0.05,
            router_std=0.5,
            seed=1,
        )
        train = train_config(str(root / "moe"))
        plugins = r3_plugins(train)
        worker = make_worker(train, sampling, plugins)
        cfg = worker.model_config
        pushed = dict(worker.hf_weights())
        head_was_embedding = torch.equal(
            pushed["lm_head.weight"].cpu(), pushed["model.embed_tokens.weight"].cpu()
        )
        with float32_engine(str(root / "moe"), sizes) as (engine, run):
            with bench_r3.replay(plugins, False):  # the synthetic experts are not the model's
                worker.train(0, worker.prepare(0, training_samples(worker)))
            trained = {n: t.detach().cpu().clone() for n, t in worker.hf_weights()}
            run(push, worker)
            head = engine.model.get_output_embeddings().weight.detach().cpu()
            embed = engine.model.get_input_embeddings().weight.detach().cpu()
            served = engine.weight_version
            samples = run(engine_rollout, sizes, 1, plugins)
    off = bench_r3.score(worker, plugins, samples, False)
    on = bench_r3.score(worker, plugins, samples, True)
    gap_off, gap_on = logprob_gaps(off["batch"]), logprob_gaps(on["batch"])
    routed = all(s.rollout_routed_experts is not None for s in samples)
    agreement = off["metrics"]["rollout/routing_agreement"]
    replayed = on["metrics"].get("rollout/replay_agreement")
    moved_apart = not torch.equal(trained["lm_head.weight"], trained["model.embed_tokens.weight"])
    engine_head = torch.equal(head, trained["lm_head.weight"])
    engine_embed = torch.equal(embed, trained["model.embed_tokens.weight"])
    part.record(
        model=cfg.family,
        experts=cfg.num_experts,
        topk=cfg.moe_router_topk,
        tie_word_embeddings=cfg.tie_word_embeddings,
        zero_noise_max_abs_logprob_diff=float(copies_gap.max()),
        pushed_lm_head="lm_head.weight" in pushed,
        lm_head_starts_as_embedding=head_was_embedding,
        lm_head_and_embedding_apart_after_step=moved_apart,
        engine_head_is_pushed_head=engine_head,
        engine_embedding_is_pushed_embedding=engine_embed,
        served_version=served,
        samples=len(samples),
        routed_experts_returned=routed,
        response_tokens=int(gap_on.numel()),
        routing_agreement_without_replay=agreement,
        replay_agreement=replayed,
        max_abs_logprob_diff_without_replay=float(gap_off.max()),
        max_abs_logprob_diff_with_replay=float(gap_on.max()),
        mean_abs_logprob_diff_with_replay=float(gap_on.mean()),
        tolerance=TOLERANCE,
    )
    part.expect(cfg.family == "mixtral" and cfg.num_experts == EXPERTS, f"built {cfg.family}")
    part.expect(
        float(copies_gap.max()) < TOLERANCE,
        f"zero-noise upcycle differs from the dense model by {float(copies_gap.max())}",
    )
    part.expect(not cfg.tie_word_embeddings, "the upcycled model ties its output layer")
    part.expect(
        "lm_head.weight" in pushed, "the push lacks lm_head.weight (sglang's Mixtral needs it)"
    )
    part.expect(head_was_embedding, "the upcycled lm_head is not the dense embedding's copy")
    part.expect(moved_apart, "a step left the output layer equal to the embedding")
    part.expect(
        engine_head and engine_embed, "the engine does not serve the pushed head and embedding"
    )
    part.expect(served == "1", f"the engine serves version {served!r}")
    part.expect(routed, "the engine returned no routed experts for a sample")
    part.expect(replayed == 1.0, f"rollout/replay_agreement {replayed}")
    part.expect(
        float(gap_on.max()) < TOLERANCE,
        f"trainer - engine log-probs with replay up to {float(gap_on.max())}",
    )


# --------------------------------------------------------------------------------------------
# pp_tied
# --------------------------------------------------------------------------------------------


def _copies_equal(weight: Any) -> bool:
    """Whether both pipeline stages hold the same shared weight (collective)."""
    from ember_megatron_backend import comm

    both = [None, None]
    comm.all_gather_object(both, weight.detach().cpu().clone())
    return bool(both[0].equal(both[1]))


def pp_tied_rank(rank: int, world: int, init_method: str, path: str) -> dict[str, Any]:
    """One stage of the tied tiny-llama under PP = 2 (spawned, one process per stage)."""
    import torch

    from ember_megatron_backend.parallel import (
        ParallelConfig,
        destroy_distributed,
        init_distributed,
        uses_gpu,
    )

    if not uses_gpu():
        torch.set_num_threads(1)  # two processes on a shared CPU (device_check.main's reason)
    init_distributed(
        ParallelConfig(pipeline_parallel=2), rank=rank, world_size=world, init_method=init_method
    )
    try:
        worker = make_worker(train_config(), sampling_config())
        model = worker.actor.module
        weight = model.shared_embedding_or_output_weight()
        equal_at_build = _copies_equal(weight)
        before = weight.detach().cpu().clone()
        samples = training_samples(worker)
        metrics = worker.train(0, worker.prepare(0, samples))
        after = weight.detach().cpu().clone()
        equal_after_step = _copies_equal(weight)
        moved, unseen = unseen_rows_moved(before, after)
        names = [n for n, _ in worker.hf_weights()]
        worker.export_hf(path, dtype=torch.float32)
        probe = training_samples(worker, rollout_id=1)
        log_probs = [lp.detach().cpu() for lp in worker.prepare(1, probe).log_probs]
        return {
            "first_stage": model.pre_process,
            "last_stage": model.post_process,
            "device": str(weight.device),
            "optimizer": worker.actor_optimizer.kind,
            "equal_at_build": equal_at_build,
            "equal_after_step": equal_after_step,
            "unseen_rows": unseen,
            "unseen_rows_moved": moved,
            "grad_norm": metrics[0]["train/grad_norm"],
            "pushed_names": names,
            "probe": probe,
            "log_probs": log_probs,
        }
    finally:
        destroy_distributed()


def part_pp_tied(part: Any, sizes: Any) -> None:
    import torch
    from gpu_support import hf_log_probs, spawn
    from transformers import AutoModelForCausalLM

    if sizes.device == "cuda" and torch.cuda.device_count() < 2:
        part.skip(
            f"PP = 2 needs two GPUs, one rank each (NCCL refuses two ranks on one GPU); "
            f"{torch.cuda.device_count()} visible. One GPU checks the one-stage tied path "
            "(tied_llama)"
        )
        return
    with tempfile.TemporaryDirectory(prefix="ember-device-check-") as tmp:
        ranks = spawn(pp_tied_rank, 2, tmp)
        hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, local_files_only=True)
        config = hf.config
        written = checkpoint_names(Path(tmp))
    first, last = ranks[0], ranks[1]
    reference = hf_log_probs(hf.to(sizes.device).eval(), first["probe"], TEMPERATURE)
    gap = torch.cat([(a - b).abs() for a, b in zip(reference, last["log_probs"], strict=True)])
    same = all(
        torch.equal(a, b) for a, b in zip(first["log_probs"], last["log_probs"], strict=True)
    )
    names = first["pushed_names"]
    part.record(
        stages=[(r["first_stage"], r["last_stage"]) for r in (first, last)],
        devices=[r["device"] for r in (first, last)],
        optimizer=first["optimizer"],
        copies_equal_at_build=first["equal_at_build"] and last["equal_at_build"],
        copies_equal_after_step=first["equal_after_step"] and last["equal_after_step"],
        unseen_rows=first["unseen_rows"],
        first_stage_unseen_rows_moved=first["unseen_rows_moved"],
        last_stage_unseen_rows_moved=last["unseen_rows_moved"],
        grad_norm=first["grad_norm"],
        pushed_tensors=len(names),
        pushed_embedding_times=names.count("model.embed_tokens.weight"),
        pushed_lm_head="lm_head.weight" in names,
        same_names_on_both_stages=names == last["pushed_names"],
        tie_word_embeddings=config.tie_word_embeddings,
        checkpoint_lm_head="lm_head.weight" in written,
        same_log_probs_on_both_stages=same,
        max_abs_logprob_diff_export=float(gap.max()),
        tolerance=TOLERANCE,
    )
    part.expect((first["first_stage"], last["last_stage"]) == (True, True), "stages misplaced")
    part.expect(first["equal_at_build"] and last["equal_at_build"], "copies differ at build")
    part.expect(
        first["equal_after_step"] and last["equal_after_step"], "copies differ after a step"
    )
    unseen = first["unseen_rows"]
    part.expect(
        unseen > 0 and first["unseen_rows_moved"] == last["unseen_rows_moved"] == unseen,
        f"unseen embedding rows moved: {first['unseen_rows_moved']} (first stage), "
        f"{last['unseen_rows_moved']} (last) of {unseen}: the output layer's gradient did not "
        "reach the first stage",
    )
    part.expect(names.count("model.embed_tokens.weight") == 1, "the embedding is not pushed once")
    part.expect("lm_head.weight" not in names, "the push names lm_head.weight")
    part.expect(names == last["pushed_names"], "the stages push different names")
    part.expect(
        config.tie_word_embeddings and "lm_head.weight" not in written, "the export is not tied"
    )
    part.expect(same, "the stages return different log-probs")
    part.expect(
        float(gap.max()) < TOLERANCE, f"export - trainer log-probs up to {float(gap.max())}"
    )
