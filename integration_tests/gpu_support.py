"""Helpers of the GPU tests: code run in spawned CUDA processes, and the MoE model they serve.

megatron-core keeps its parallel state in the process, and NCCL wants one process per GPU, so
every Megatron step of these tests runs in freshly spawned processes (rank r on GPU r).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

SERVED_MODEL = {
    "num_layers": 4,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "head_dim": 64,
    "vocab_size": 128,
    "ffn_hidden_size": 512,
    "num_experts": 8,
    "moe_ffn_hidden_size": 128,
    "moe_router_topk": 2,
    "max_position_embeddings": 512,
}
"""ModelConfig fields (over the tiny-moe preset) of the model SGLang serves in these tests:
widths its attention and fused-MoE kernels accept (head_dim 64, widths multiples of 64). With
top-2 routing, CUDA's unordered scatter-add of expert outputs gives the same sum in any order,
so forward passes repeat bit for bit."""

SGLANG_ARGS = ["--dtype", "bfloat16", "--disable-cuda-graph", "--skip-tokenizer-init"]
"""Server flags of every test server: bf16 as real engines run, a quicker start, and no
detokenizing (the served model's vocabulary is larger than the toy tokenizer's, and the engine
sends and reads token ids)."""


def _entry(rank: int, fn: Callable[..., Any], world: int, port: int, out: str, args: tuple) -> None:
    os.environ["LOCAL_RANK"] = str(rank)
    result = fn(rank, world, f"tcp://127.0.0.1:{port}", *args)
    torch.save(result, Path(out) / f"rank{rank}.pt")


def spawn(fn: Callable[..., Any], world: int, *args: Any) -> dict[int, Any]:
    """Run `fn(rank, world, init_method, *args)` in `world` spawned processes, one per GPU.

    `fn` must be importable by name (a module-level function). Results travel through files,
    so they may be large.

    Returns:
        Each rank's return value, by rank.
    """
    from ember_megatron_backend.parallel import free_port

    with tempfile.TemporaryDirectory(prefix="ember-gpu-") as out:
        mp.start_processes(
            _entry,
            args=(fn, world, free_port(), out, args),
            nprocs=world,
            start_method="spawn",
        )
        return {
            rank: torch.load(Path(out) / f"rank{rank}.pt", weights_only=False)
            for rank in range(world)
        }


def export_served_model(rank: int, world: int, init_method: str, path: str, seed: int) -> str:
    """Build the served model in Megatron on this GPU (fresh weights from `seed`) and export it
    as a bf16 transformers checkpoint with the toy tokenizer; the path on rank 0."""
    from ember_core.config import AlgorithmConfig, SamplingConfig
    from ember_megatron_backend.config import BackendConfig
    from ember_megatron_backend.parallel import destroy_distributed, init_distributed
    from ember_megatron_backend.worker import MegatronWorker
    from ember_rollout.tokenizer import save_toy_tokenizer

    init_distributed(rank=rank, world_size=world, init_method=init_method)
    try:
        config = BackendConfig(model="tiny-moe", model_overrides=SERVED_MODEL, seed=seed)
        worker = MegatronWorker(
            config, AlgorithmConfig(), SamplingConfig(), with_ref=False, with_critic=False
        )
        worker.export_hf(path, dtype=torch.bfloat16)
    finally:
        destroy_distributed()
    save_toy_tokenizer(path)
    return path


def served_model(root: Path, seed: int) -> Path:
    """The served model with weights from `seed`, written once under `root`."""
    path = root / f"moe-seed{seed}"
    if not (path / "config.json").is_file():
        spawn(export_served_model, 1, str(path), seed)
    return path


def sglang_run(model: Path, log_dir: Path) -> dict[str, Any]:
    """A run config, as read from YAML: the toy task, rollouts from SGLang serving `model`, and
    training that starts from the same checkpoint."""
    return {
        "rollout": {"rollout_batch_size": 32, "n_samples_per_prompt": 8, "max_response_len": 16},
        "algorithm": {"advantage_estimator": "grpo", "use_kl_loss": True, "kl_loss_coef": 0.0},
        "train": {"hf_load": str(model), "micro_batch_size": 64},
        "engine": {
            "kind": "sglang",
            "sglang": {
                "model_path": str(model),
                "mem_fraction_static": 0.3,
                "server_args": list(SGLANG_ARGS),
                "log_dir": str(log_dir),
                "launch_timeout_s": 600,
            },
        },
        "reward": {"reward_fn": "toy"},
    }
