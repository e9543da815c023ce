"""Weight load/export under TP, EP and PP: two gloo processes on CPU, real megatron-core."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from safetensors import safe_open

from ember_megatron_backend.model import ModelConfig
from ember_megatron_backend.parallel import free_port

pytestmark = pytest.mark.slow

# One pair of processes goes through every family and layout (imports cost ~10 s per process).
LAYOUTS = {
    "tp2-ep2": {"tensor_parallel": 2, "expert_parallel": 2, "expert_tensor_parallel": 1},
    # Dense models: megatron-core refuses expert parallelism without experts.
    "tp2": {"tensor_parallel": 2},
    "pp2": {"pipeline_parallel": 2},
}
FAMILIES = [
    "tiny-moe",
    "tiny-deepseek-v3",
    "tiny-glm4-moe",
    "tiny-qwen2-moe",
    "tiny-mixtral",
    "tiny-llama",  # dense, tied: the last pipeline stage's output layer is the embedding's copy
]


def _layouts(preset: str) -> tuple[str, str]:
    """The tensor-parallel layout (whose log-probs are compared) and the pipeline one."""
    return ("tp2-ep2" if ModelConfig.preset(preset).is_moe else "tp2", "pp2")


RUNS = [(preset, layout) for preset in FAMILIES for layout in _layouts(preset)]
TEMPERATURE = 0.7


def _samples(cfg: ModelConfig) -> list:
    """Samples of different lengths, packed into one batch by the forward."""
    from ember_core.types import Sample

    g = torch.Generator().manual_seed(5)
    shapes = [(9, 4), (6, 1), (13, 7), (8, 5)]  # (total length, response length)
    return [
        Sample(
            tokens=torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist(),
            response_length=r,
            index=i,
        )
        for i, (n, r) in enumerate(shapes)
    ]


def _worker(rank, port, root, queue):
    from megatron.core import parallel_state as ps

    from ember_megatron_backend.forward import forward_only
    from ember_megatron_backend.model import build_model
    from ember_megatron_backend.parallel import ParallelConfig, init_distributed
    from ember_megatron_backend.weights import export_hf_checkpoint, load_hf_checkpoint

    torch.set_num_threads(1)
    for preset, layout in RUNS:
        cfg = ModelConfig.preset(preset).replace(init_method_std=0.15)
        init_distributed(
            ParallelConfig(**LAYOUTS[layout]),
            rank=rank,
            world_size=2,
            init_method=f"tcp://127.0.0.1:{port}",
        )
        model = build_model(cfg, seed=10 + rank)  # each rank draws its own weights
        # Tied under PP: does the last stage's copy start as the first stage's embedding?
        tied = _tied_copies_equal(model) if cfg.tie_word_embeddings and layout == "pp2" else None
        load_hf_checkpoint(model, root / preset / "hf", cfg)
        export_hf_checkpoint(model, cfg, root / preset / layout)
        local = {n: tuple(p.shape) for n, p in model.named_parameters()}
        log_probs = None
        if layout != "pp2":
            out = forward_only(model, _samples(cfg), role="actor", temperature=TEMPERATURE)
            log_probs = [lp.double().tolist() for lp in out.log_probs]
        ep_rank = ps.get_expert_model_parallel_rank()
        queue.put((preset, layout, rank, ep_rank, local, log_probs, tied))
        ps.destroy_model_parallel()  # keep the process group for the next layout


def _tied_copies_equal(model) -> bool:
    """Whether both pipeline stages hold the same embedding / output weight (collective)."""
    from ember_megatron_backend import comm

    both = [None, None]
    comm.all_gather_object(both, model.shared_embedding_or_output_weight().detach().clone())
    return torch.equal(*both)


def _reference_log_probs(model, samples):
    """Per sample, transformers' own forward: log_softmax(logits / T) at the response tokens."""
    out = []
    for s in samples:
        ids = torch.tensor([s.tokens])
        with torch.no_grad():
            logits = model(ids).logits[0].double() / TEMPERATURE
        rows = logits[len(s.tokens) - s.response_length - 1 : -1].log_softmax(-1)
        out.append(rows.gather(1, ids[0, len(s.tokens) - s.response_length :, None])[:, 0])
    return out


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from ember_megatron_backend.hf_layout import hf_config

    root = tmp_path_factory.mktemp("sharding")
    references = {}
    for preset in FAMILIES:
        torch.manual_seed(0)
        cfg = ModelConfig.preset(preset).replace(init_method_std=0.15)
        hf = AutoModelForCausalLM.from_config(hf_config(cfg)).eval()
        with torch.no_grad():  # norms start at 1, biases at 0: perturb them
            for name, p in [*hf.named_parameters(), *hf.named_buffers()]:
                if "norm" in name or "bias" in name:
                    p.add_(0.2 * torch.randn_like(p))
        hf.save_pretrained(root / preset / "hf")
        references[preset] = (hf.state_dict(), _reference_log_probs(hf, _samples(cfg)))
    queue = mp.get_context("spawn").SimpleQueue()
    # Read while the workers run: a pipe holds only so much before a put blocks.
    context = mp.start_processes(
        _worker, args=(free_port(), root, queue), nprocs=2, start_method="spawn", join=False
    )
    runs: dict[tuple[str, str], dict[int, tuple]] = {}
    for _ in range(2 * len(RUNS)):
        preset, layout, rank, ep_rank, local, log_probs, tied = queue.get()
        runs.setdefault((preset, layout), {})[rank] = (ep_rank, local, log_probs, tied)
    while not context.join():
        pass
    return root, references, runs


@pytest.mark.parametrize("preset", FAMILIES)
def test_tp2_ep2_log_probs_match_transformers(sharded_runs, preset):
    """Megatron fp32 log-probs under TP = 2 x EP = 2 (TP = 2 for a dense model; a packed batch
    of samples of different lengths) against transformers' forward of the same checkpoint, on
    both ranks."""
    _, references, runs = sharded_runs
    expected = references[preset][1]
    for rank in (0, 1):
        mine = runs[preset, _layouts(preset)[0]][rank][2]
        for i, (a, b) in enumerate(zip(mine, expected, strict=True)):
            a = torch.tensor(a, dtype=torch.float64)
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0, msg=f"rank {rank} sample {i}")
    assert torch.cat(expected).std() > 0.5, "logits too uniform for the comparison to mean much"


@pytest.mark.parametrize(("preset", "layout"), RUNS)
def test_sharded_round_trip_is_bit_exact(sharded_runs, preset, layout):
    from transformers import AutoModelForCausalLM

    root, references, _ = sharded_runs
    with (
        safe_open(str(root / preset / layout / "model.safetensors"), framework="pt") as mine,
        safe_open(str(root / preset / "hf" / "model.safetensors"), framework="pt") as theirs,
    ):
        assert set(mine.keys()) == set(theirs.keys())
        for key in theirs.keys():
            assert torch.equal(mine.get_tensor(key), theirs.get_tensor(key)), key
    reloaded = AutoModelForCausalLM.from_pretrained(root / preset / layout).state_dict()
    assert all(torch.equal(reloaded[k], v) for k, v in references[preset][0].items())


def test_tp2_ep2_local_shapes(sharded_runs):
    cfg = ModelConfig.preset("tiny-moe")
    runs = sharded_runs[2]["tiny-moe", "tp2-ep2"]
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
    runs = sharded_runs[2]["tiny-moe", "pp2"]
    first, last = runs[0][1], runs[1][1]
    for stage in (first, last):  # local names: the last stage maps them to layers 2 and 3
        assert {n.split(".")[2] for n in stage if n.startswith("decoder.layers.")} == {"0", "1"}
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
    assert "output_layer.weight" in last and "embedding.word_embeddings.weight" not in last


def test_pp2_tied_output_layer_starts_as_the_first_stages_embedding(sharded_runs):
    """megatron-core zeroes the last stage's copy and all-reduces it with the embedding over
    the embedding group (on CPU through ``cpu`` spot 11); it holds no weight of its own."""
    runs = sharded_runs[2]["tiny-llama", "pp2"]
    assert runs[0][3] is True and runs[1][3] is True
    assert "output_layer.weight" in runs[1][1] and "output_layer.weight" not in runs[0][1]
