"""The Megatron backend on CUDA with NCCL: one GPU (bf16, megatron-core's optimizer), TP=2, EP=2.

Each scenario runs in spawned processes (one per GPU): score a rollout, check the first step is
on-policy, train, export to transformers and compare log-probs, then save, continue, and check
that a fresh worker resumed from the checkpoint logs the same next steps.
"""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.gpu

NEEDS_TWO = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)
NEEDS_TE = pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is None,
    reason="MoE training under TP needs sequence parallelism, i.e. Transformer Engine",
)

LAYOUTS = {
    "1gpu-bf16": ({}, "bfloat16", 1),
    "tp2": ({"tensor_parallel": 2}, "float32", 2),
    "ep2": ({"expert_parallel": 2, "expert_tensor_parallel": 1}, "float32", 2),
}


def _samples(rollout_id: int, rank: int, world: int):
    from ember_core.types import Sample

    g = torch.Generator().manual_seed(10 + rollout_id)
    samples = []
    for k in range(16):  # 8 prompt groups of 2
        length = int(torch.randint(12, 40, (1,), generator=g))
        response = int(torch.randint(4, length - 4, (1,), generator=g))
        samples.append(
            Sample(
                tokens=torch.randint(0, 256, (length,), generator=g).tolist(),
                response_length=response,
                index=k,
                group_index=k // 2,
                reward=float(torch.rand(1, generator=g)),
                rollout_log_probs=(-3 * torch.rand(response, generator=g)).tolist(),
                rollout_routed_experts=torch.randint(0, 8, (length - 1, 4, 2), generator=g),
            )
        )
    share = len(samples) // world
    return samples[rank * share : (rank + 1) * share]


def _worker(layout: dict, dtype: str):
    from ember_core.config import AlgorithmConfig, SamplingConfig
    from ember_megatron_backend.config import BackendConfig, OptimizerConfig
    from ember_megatron_backend.parallel import ParallelConfig
    from ember_megatron_backend.worker import MegatronWorker

    config = BackendConfig(
        model_overrides={"init_method_std": 0.1},
        parallel=ParallelConfig(**layout),
        optimizer=OptimizerConfig(lr=1e-4),
        num_steps_per_rollout=2,
        micro_batch_size=2,
        dtype=dtype,
    )
    algorithm = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.1, use_tis=True)
    return MegatronWorker(config, algorithm, SamplingConfig(temperature=0.8))


def _scenario(rank: int, world: int, port: int, name: str, root: str, queue) -> None:
    os.environ["LOCAL_RANK"] = str(rank)
    from ember_megatron_backend.parallel import ParallelConfig, init_distributed

    layout, dtype, _ = LAYOUTS[name]
    init_distributed(
        ParallelConfig(**layout), rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}"
    )
    worker = _worker(layout, dtype)
    batch = worker.prepare(0, _samples(0, rank, world))
    worker.export_hf(os.path.join(root, "hf"), dtype=torch.float32)  # the weights that scored
    out = {"rollout": worker.log_rollout_data(0, batch), "steps": worker.train(0, batch)}
    out["log_probs"] = [t.tolist() for t in batch.log_probs]
    out["ref_gap"] = max(
        float((a - b).abs().max())
        for a, b in zip(batch.log_probs, batch.ref_log_probs, strict=True)
    )
    worker.save_checkpoint(os.path.join(root, "ckpt"))
    nxt = worker.prepare(1, _samples(1, rank, world))
    out["continued"] = worker.train(1, nxt)
    fresh = _worker(layout, dtype)
    fresh.load_checkpoint(os.path.join(root, "ckpt"))
    out["resumed"] = fresh.train(1, fresh.prepare(1, _samples(1, rank, world)))
    queue.put((rank, out))


def _run(name: str, tmp_path) -> dict[int, dict]:
    from ember_megatron_backend.parallel import free_port

    world = LAYOUTS[name][2]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(
        _scenario,
        args=(world, free_port(), name, str(tmp_path), queue),
        nprocs=world,
        start_method="spawn",
    )
    return dict(queue.get() for _ in range(world))


def _check(name: str, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    results = _run(name, tmp_path)
    first = results[0]
    for out in results.values():  # metrics are reduced: every rank logs the same
        assert out["steps"] == first["steps"] and out["rollout"] == first["rollout"]
        assert out["ref_gap"] == 0.0  # reference = initial actor, same kernels
    step0 = first["steps"][0]
    assert abs(step0["train/ppo_kl"]) < 1e-8 and abs(step0["train/kl_loss"]) < 1e-8
    assert first["rollout"]["rollout/log_probs"] == first["rollout"]["rollout/ref_log_probs"]
    assert all(
        math.isfinite(s["train/grad_norm"]) and s["train/grad_norm"] > 0 for s in first["steps"]
    )
    assert 0.0 <= first["rollout"]["rollout/routing_agreement"] <= 1.0
    for got, want in zip(first["resumed"], first["continued"], strict=True):
        for key, value in want.items():
            assert math.isclose(got[key], value, rel_tol=1e-3, abs_tol=1e-4), (key, got, want)

    # The exported checkpoint (taken before training) scores the first rollout as we did.
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).cuda().eval()
    world = LAYOUTS[name][2]
    tolerance = 0.05 if LAYOUTS[name][1] == "bfloat16" else 5e-3
    for rank, out in results.items():
        for sample, ours in zip(_samples(0, rank, world), out["log_probs"], strict=True):
            ids = torch.tensor([sample.tokens], device="cuda")
            with torch.no_grad():
                logits = hf(ids).logits[0].float() / 0.8
            rows = logits[len(sample.tokens) - sample.response_length - 1 : -1]
            targets = ids[0, -sample.response_length :, None]
            reference = rows.log_softmax(-1).gather(1, targets)[:, 0].cpu()
            gap = (reference - torch.tensor(ours)).abs().mean()
            assert gap < tolerance, (rank, float(gap))


def test_single_gpu_bf16_with_megatron_optimizer(tmp_path):
    _check("1gpu-bf16", tmp_path)


@NEEDS_TWO
@NEEDS_TE
def test_tensor_parallel_2(tmp_path):
    _check("tp2", tmp_path)


@NEEDS_TWO
def test_expert_parallel_2(tmp_path):
    _check("ep2", tmp_path)
