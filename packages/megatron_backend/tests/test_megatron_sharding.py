"""Weight load/export under TP, EP and PP: two gloo processes on CPU, real megatron-core."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from safetensors import safe_open

from ember_megatron_backend.model import ModelConfig
from ember_megatron_backend.parallel import free_port

pytestmark = pytest.mark.slow

# One pair of processes goes through every layout (imports cost ~10 s per process here).
LAYOUTS = {
    "tp2-ep2": {"tensor_parallel": 2, "expert_parallel": 2, "expert_tensor_parallel": 1},
    "pp2": {"pipeline_parallel": 2},
}


def _worker(rank, port, hf_path, out_root, queue):
    from megatron.core import parallel_state as ps

    from ember_megatron_backend.model import build_model
    from ember_megatron_backend.parallel import ParallelConfig, init_distributed
    from ember_megatron_backend.weights import export_hf_checkpoint, load_hf_checkpoint

    torch.set_num_threads(1)
    cfg = ModelConfig.preset("tiny-moe")
    for name, sizes in LAYOUTS.items():
        init_distributed(
            ParallelConfig(**sizes),
            rank=rank,
            world_size=2,
            init_method=f"tcp://127.0.0.1:{port}",
        )
        model = build_model(cfg, seed=10 + rank)
        load_hf_checkpoint(model, hf_path, cfg)
        export_hf_checkpoint(model, cfg, out_root / name)
        local = {n: tuple(p.shape) for n, p in model.named_parameters()}
        queue.put((name, rank, ps.get_expert_model_parallel_rank(), local))
        ps.destroy_model_parallel()  # keep the process group for the next layout


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from ember_megatron_backend.hf_layout import hf_config

    root = tmp_path_factory.mktemp("sharding")
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(hf_config(ModelConfig.preset("tiny-moe")))
    hf.save_pretrained(root / "hf")
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(
        _worker, args=(free_port(), root / "hf", root, queue), nprocs=2, start_method="spawn"
    )
    runs: dict[str, dict[int, tuple[int, dict]]] = {}
    for _ in range(2 * len(LAYOUTS)):
        name, rank, ep_rank, local = queue.get()
        runs.setdefault(name, {})[rank] = (ep_rank, local)
    return root, hf.state_dict(), runs


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sharded_round_trip_is_bit_exact(sharded_runs, layout):
    from transformers import AutoModelForCausalLM

    root, reference, _ = sharded_runs
    with (
        safe_open(str(root / layout / "model.safetensors"), framework="pt") as mine,
        safe_open(str(root / "hf" / "model.safetensors"), framework="pt") as theirs,
    ):
        assert set(mine.keys()) == set(theirs.keys())
        for key in theirs.keys():
            assert torch.equal(mine.get_tensor(key), theirs.get_tensor(key)), key
    reloaded = AutoModelForCausalLM.from_pretrained(root / layout).state_dict()
    assert all(torch.equal(reloaded[k], v) for k, v in reference.items())


def test_tp2_ep2_local_shapes(sharded_runs):
    cfg = ModelConfig.preset("tiny-moe")
    runs = sharded_runs[2]["tp2-ep2"]
    local = runs[0][1]
    qkv = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * cfg.head_dim // 2
    assert local["decoder.layers.0.self_attention.linear_qkv.weight"] == (qkv, cfg.hidden_size)
    assert local["decoder.layers.0.self_attention.linear_proj.weight"] == (
        cfg.hidden_size,
        cfg.num_attention_heads * cfg.head_dim // 2,
    )
    assert local["embedding.word_embeddings.weight"] == (cfg.vocab_size // 2, cfg.hidden_size)
    # ETP=1: each EP rank holds half of the experts, unsplit.
    fc1 = [n for n in local if ".local_experts." in n and n.endswith("fc1.weight")]
    assert len(fc1) == cfg.num_layers * cfg.num_experts // 2
    assert local[fc1[0]] == (2 * cfg.moe_ffn_hidden_size, cfg.hidden_size)
    assert {runs[r][0] for r in (0, 1)} == {0, 1}


def test_pp2_stages_split_layers(sharded_runs):
    runs = sharded_runs[2]["pp2"]
    first, last = runs[0][1], runs[1][1]
    for stage in (first, last):  # local names: the last stage maps them to layers 2 and 3
        assert {n.split(".")[2] for n in stage if n.startswith("decoder.layers.")} == {"0", "1"}
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
    assert "output_layer.weight" in last and "embedding.word_embeddings.weight" not in last
