"""The sglang engine against a real SGLang server on a CUDA GPU (skipped without one)."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util

import pytest
import torch

from ember_rollout.config import SGLangEngineConfig, TinyModelConfig
from ember_rollout.engine import GenerateRequest, SamplingParams
from ember_rollout.models import write_tiny_checkpoint
from ember_rollout.sglang_engine import SGLangEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        importlib.util.find_spec("sglang") is None,
        reason="needs the [sglang] extra (uv sync --extra sglang)",
    ),
]

# Shapes SGLang's attention and fused-MoE kernels accept (head_dim 64, widths multiple of 64).
MODEL = TinyModelConfig(
    vocab_size=128,
    hidden_size=256,
    num_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    intermediate_size=512,
    init_seed=0,
)


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
    return log_probs.gather(1, torch.tensor(tokens[prompt_len:], device="cuda")[:, None])[:, 0]


def test_generate_routed_experts_and_weight_update(tmp_path):
    first = write_tiny_checkpoint(tmp_path / "v0", MODEL, dtype=torch.bfloat16)
    second = write_tiny_checkpoint(
        tmp_path / "v1", dataclasses.replace(MODEL, init_seed=1), dtype=torch.bfloat16
    )
    engine = SGLangEngine(
        SGLangEngineConfig(
            model_path=str(first),
            mem_fraction_static=0.3,
            server_args=["--enable-return-routed-experts", "--disable-cuda-graph"],
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
        assert experts.shape == (len(tokens) - 1, MODEL.num_layers, MODEL.num_experts_per_tok)
        assert 0 <= experts.min() and experts.max() < MODEL.num_experts
        assert all(experts[:, layer].any() for layer in range(MODEL.num_layers))
        reference = reference_log_probs(first, tokens, len(request.input_ids))
        gap = (reference.cpu() - torch.tensor(out.output_log_probs)).abs()
        assert gap.mean() < 0.05, gap  # bf16 kernels differ from transformers' a little
    assert after[0].meta_info.get("weight_version") in ("1", None)
    tokens = requests()[0].input_ids + after[0].output_ids
    reference = reference_log_probs(second, tokens, 4)
    gap = (reference.cpu() - torch.tensor(after[0].output_log_probs)).abs()
    assert gap.mean() < 0.05, "the server must serve the updated weights"
