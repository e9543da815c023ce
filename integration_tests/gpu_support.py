"""Helpers of the GPU tests and of `tools/device_check.py`: spawned CUDA processes, the MoE
model the SGLang tests serve, synthetic rollouts, and the worker settings both drive.

megatron-core keeps its parallel state in the process, and NCCL wants one process per GPU, so
every Megatron step of these tests runs in freshly spawned processes (rank r on GPU r). The
device check runs the same helpers in its own single process.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.multiprocessing as mp

if TYPE_CHECKING:
    from ember_core.types import Sample
    from ember_megatron_backend.worker import MegatronWorker

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


ROLLOUT_TEMPERATURE = 0.8
"""Sampling temperature of `megatron_worker`: policy logits are divided by it."""


def synthetic_samples(
    rollout_id: int,
    part: int = 0,
    parts: int = 1,
    *,
    vocab: int = 256,
    layers: int = 4,
    experts: int = 8,
    topk: int = 2,
) -> list[Sample]:
    """Data-parallel rank `part` of `parts`: its share of a rollout of 16 synthetic samples
    (8 prompt groups of 2; random tokens below `vocab`, rewards, rollout log-probs and routed
    experts [length - 1, layers, topk]). The same `rollout_id` gives the same samples."""
    from ember_core.types import Sample

    g = torch.Generator().manual_seed(10 + rollout_id)
    samples = []
    for k in range(16):
        length = int(torch.randint(12, 40, (1,), generator=g))
        response = int(torch.randint(4, length - 4, (1,), generator=g))
        samples.append(
            Sample(
                tokens=torch.randint(0, vocab, (length,), generator=g).tolist(),
                response_length=response,
                index=k,
                group_index=k // 2,
                reward=float(torch.rand(1, generator=g)),
                rollout_log_probs=(-3 * torch.rand(response, generator=g)).tolist(),
                rollout_routed_experts=torch.randint(
                    0, experts, (length - 1, layers, topk), generator=g
                ),
            )
        )
    share = len(samples) // parts
    return samples[part * share : (part + 1) * share]


def megatron_worker(
    layout: dict[str, Any] | None = None,
    dtype: str = "float32",
    *,
    model_overrides: dict[str, Any] | None = None,
    **algorithm_changes: Any,
) -> MegatronWorker:
    """A tiny-moe worker (weights far from uniform, lr 1e-4, 2 steps of 2-sample micro-batches
    per rollout) with a KL loss against its reference and TIS, sampling at 0.8.

    Args:
        layout: ParallelConfig fields.
        dtype: Parameter dtype (bfloat16 trains with megatron-core's optimizer on a GPU).
        model_overrides: ModelConfig fields over the preset.
        algorithm_changes: AlgorithmConfig fields (e.g. advantage_estimator="ppo").
    """
    from ember_core.config import AlgorithmConfig, SamplingConfig
    from ember_megatron_backend.config import BackendConfig, OptimizerConfig
    from ember_megatron_backend.parallel import ParallelConfig
    from ember_megatron_backend.worker import MegatronWorker

    config = BackendConfig(
        model_overrides={"init_method_std": 0.1, **(model_overrides or {})},
        parallel=ParallelConfig(**(layout or {})),
        optimizer=OptimizerConfig(lr=1e-4),
        num_steps_per_rollout=2,
        micro_batch_size=2,
        dtype=dtype,
    )
    algorithm = AlgorithmConfig(
        use_kl_loss=True, kl_loss_coef=0.1, use_tis=True, **algorithm_changes
    )
    return MegatronWorker(config, algorithm, SamplingConfig(temperature=ROLLOUT_TEMPERATURE))


def critic_values(
    worker: MegatronWorker, samples: list[Sample], temperatures: tuple[float, ...]
) -> dict[float, tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """(values, actor log-probs) of `samples` scored at each rollout temperature, by one
    critic. Its value layer starts at zero, which predicts 0 at any temperature, so it is
    drawn at random first."""
    assert worker.critic is not None, "the worker has no critic (advantage_estimator='ppo')"
    with torch.no_grad():
        worker.critic.module.output_layer.weight.normal_()
    out = {}
    for temperature in temperatures:
        worker.sampling.temperature = temperature
        batch = worker.prepare(0, samples)
        out[temperature] = (batch.values, batch.log_probs)
    return out


@torch.no_grad()
def hf_log_probs(model: Any, samples: list[Sample], temperature: float) -> list[torch.Tensor]:
    """Per sample, [R] log-probs of the response tokens under a transformers causal LM at the
    rollout temperature, through the ember-core head the trainer uses."""
    from ember_core.heads import PolicyHead

    head = PolicyHead(temperature)
    device = next(model.parameters()).device
    out = []
    for sample in samples:
        ids = torch.tensor(sample.tokens, device=device)
        logits = model(input_ids=ids[None]).logits.float()  # [1, L, V]
        lengths = [len(sample.tokens)], [sample.response_length]
        out.append(head.log_probs(logits, ids, *lengths).log_probs[0].cpu())
    return out


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


def colocated_sglang_run(model: Path, log_dir: Path, plugins: list[str]) -> dict[str, Any]:
    """`sglang_run` in CI mode on one shared GPU: rank 0 and the SGLang engine take half each,
    the server with the memory saver a colocated layout needs (`ember.placement`), two
    steps a rollout, a checkpoint after each."""
    from ember.placement import MEMORY_SAVER_FLAG

    config = sglang_run(model, log_dir)
    config["engine"]["sglang"]["server_args"].append(MEMORY_SAVER_FLAG)
    config["train"].update(dtype="bfloat16", num_steps_per_rollout=2, optimizer={"lr": 1e-4})
    config.update(
        plugins=plugins,
        ci={"test": True},
        run={"name": "sglang", "save_interval": 1},
        ray={"data_parallel": 1, "gpus_per_rank": 0.5, "gpus_per_engine": 0.5, "colocate": True},
    )
    return config
