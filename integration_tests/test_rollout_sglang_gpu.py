"""The sglang engine and R3 against real SGLang servers on a CUDA GPU (skipped without one).

The served model is the suite's own: a small MoE built in Megatron and exported in the
transformers layout (gpu_support.served_model), so nothing is downloaded.
"""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
import torch
from gpu_support import SERVED_MODEL, SGLANG_ARGS, served_model, sglang_run, spawn

from ember_rollout.config import SGLangEngineConfig
from ember_rollout.engine import GenerateRequest, SamplingParams
from ember_rollout.sglang_engine import SGLangEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        importlib.util.find_spec("sglang") is None,
        reason="needs the [sglang] extra (uv sync --extra sglang)",
    ),
]

LAYERS, EXPERTS, TOPK = (SERVED_MODEL[k] for k in ("num_layers", "num_experts", "moe_router_topk"))


def requests(n=4, routed=True):
    return [
        GenerateRequest(
            input_ids=[12, 2 + i, 5, 16],
            sampling=SamplingParams(max_new_tokens=16, temperature=1.0, ignore_eos=True),
            fields={"return_routed_experts": True} if routed else {},
            name=f"sample {i}",
        )
        for i in range(n)
    ]


def reference_log_probs(path, tokens, prompt_len):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens], device="cuda")).logits[0].float()
    log_probs = torch.log_softmax(logits[prompt_len - 1 : -1], dim=-1)
    picked = log_probs.gather(1, torch.tensor(tokens[prompt_len:], device="cuda")[:, None])
    del model
    torch.cuda.empty_cache()  # the next test's server counts on this memory
    return picked[:, 0].cpu()


def test_generate_routed_experts_and_weight_update(served_root, tmp_path):
    first = served_model(served_root, seed=0)
    second = served_model(served_root, seed=1)
    engine = SGLangEngine(
        SGLangEngineConfig(
            model_path=str(first),
            mem_fraction_static=0.3,
            server_args=["--enable-return-routed-experts", *SGLANG_ARGS],
            log_dir=str(tmp_path / "logs"),
            launch_timeout_s=600,
        )
    )

    async def run():
        async with engine:
            before = await engine.generate(requests())
            await engine.update_weights_from_disk(second, weight_version="1")
            after = await engine.generate(requests(routed=False))
        return before, after

    before, after = asyncio.run(run())
    for request, out in zip(requests(), before, strict=True):
        tokens = request.input_ids + out.output_ids
        assert len(out.output_ids) == 16 and out.finish_reason == "length"
        experts = out.routed_experts
        assert experts.shape == (len(tokens) - 1, LAYERS, TOPK)
        assert 0 <= experts.min() and experts.max() < EXPERTS
        assert all(experts[:, layer].any() for layer in range(LAYERS))
        reference = reference_log_probs(first, tokens, len(request.input_ids))
        gap = (reference - torch.tensor(out.output_log_probs)).abs()
        assert gap.mean() < 0.05, gap  # bf16 kernels differ from transformers' a little
    # sglang 0.5.23 tokenizer_manager.py: every /generate meta_info carries weight_version, and
    # /update_weights_from_disk sets it when the request names one.
    assert after[0].meta_info["weight_version"] == "1"
    tokens = requests()[0].input_ids + after[0].output_ids
    reference = reference_log_probs(second, tokens, 4)
    gap = (reference - torch.tensor(after[0].output_log_probs)).abs()
    assert gap.mean() < 0.05, "the server must serve the updated weights"


def _score(rank: int, world: int, init_method: str, run: dict, samples: list) -> dict:
    """rollout/* metrics of the same samples from an fp32 actor without and with replay."""
    from ember.config import load_config
    from ember_megatron_backend.parallel import destroy_distributed, init_distributed
    from ember_megatron_backend.worker import MegatronWorker

    init_distributed(rank=rank, world_size=world, init_method=init_method)
    metrics = {}
    try:
        for name, plugins in (("off", []), ("on", ["r3_routing"])):
            config, host = load_config(run, plugins=plugins)
            worker = MegatronWorker(config.train, config.algorithm, config.rollout, host)
            metrics[name] = worker.log_rollout_data(0, worker.prepare(0, samples))
            del worker
    finally:
        destroy_distributed()
    return metrics


def test_replay_lowers_the_train_rollout_gap_of_the_same_rollout(served_root, tmp_path):
    from ember.config import load_config
    from ember_rollout import RolloutGenerator, build_engine

    model = served_model(served_root, seed=0)
    run = sglang_run(model, tmp_path / "logs")
    config, plugins = load_config(run, plugins=["r3_routing"])
    engine = build_engine(config.engine, plugins=plugins)

    async def rollout():
        async with engine:
            generator = RolloutGenerator.from_config(
                engine=engine, sampling=config.rollout, sections=config, plugins=plugins
            )
            return await generator.generate(0)

    samples = asyncio.run(rollout()).samples
    assert len(samples) == 32 * 8
    for sample in samples:
        assert sample.rollout_routed_experts.shape == (len(sample.tokens) - 1, LAYERS, TOPK)

    # The same samples scored by the fp32 trainer, its routers on their own and replaying.
    scores = spawn(_score, 1, run, samples)[0]
    off, on = scores["off"], scores["on"]
    assert off["rollout/routing_agreement"] < 1.0  # SGLang's bf16 routes some tokens otherwise
    assert "rollout/replay_agreement" not in off
    assert on["rollout/replay_agreement"] == 1.0
    gap = "rollout/train_rollout_logprob_abs_diff"
    assert on[gap] < off[gap], (on[gap], off[gap])
