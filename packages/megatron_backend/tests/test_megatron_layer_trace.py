"""`MegatronWorker.trace_layers`: the trainer's old-log-prob forward with every layer's ops
recorded (`ember certify --layers`'s trainer side), against transformers' own forward of the
exported weights."""

from __future__ import annotations

import pytest
import torch
from megatron_samples import algorithm, backend, make_samples, sampling

from ember_megatron_backend.worker import MegatronWorker


def test_the_trace_is_the_log_prob_forward_and_matches_transformers_layer_by_layer(
    dist_env, tmp_path
):
    from transformers import AutoModelForCausalLM

    from ember_megatron_backend.weights import export_hf_checkpoint

    # Two optimizer steps of micro-batches of 2 (shuffled): the trace runs prepare's plan.
    config = backend(micro_batch_size=2, num_steps_per_rollout=2, shuffle_mini_batches=True)
    worker = MegatronWorker(config, algorithm(), sampling(0.8))
    samples = make_samples(3, seed=3, experts=False)
    traces, log_probs = worker.trace_layers(0, samples, keep=4)
    assert len(traces) == 4 and len(log_probs) == len(samples)
    scored = worker.prepare(0, samples).log_probs
    for traced, old in zip(log_probs, scored, strict=True):
        assert torch.equal(traced, old)  # the forward the old log-probs come from

    cfg = backend().model_config()
    export_hf_checkpoint(worker.actor, cfg, tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    for sample, trace in zip(samples[:4], traces, strict=True):
        tokens = torch.tensor([sample.tokens[:-1]])
        with torch.no_grad():
            hidden = model(input_ids=tokens, output_hidden_states=True).hidden_states
        for layer in range(cfg.num_layers - 1):
            assert trace[(layer, "layer")].shape == (tokens.shape[1], cfg.hidden_size)
            torch.testing.assert_close(trace[(layer, "layer")], hidden[layer + 1][0])
        torch.testing.assert_close(trace[(cfg.num_layers, "final_norm")], hidden[-1][0])
        moe = cfg.moe_layers[0]
        experts = trace[(moe, "experts")]
        assert experts.shape == (tokens.shape[1], cfg.moe_router_topk)
        assert torch.all(experts[:, :-1] < experts[:, 1:])  # sorted ids, none twice


def test_norms_fused_into_linear_layers_are_refused_by_name(dist_env):
    """Transformer Engine's layer spec fuses the input norm into the attention's first linear
    layer (an IdentityOp in its place): the trace would read the residual as the norm."""
    from megatron.core.transformer.identity_op import IdentityOp

    from ember_megatron_backend.layer_trace import trace_forward
    from ember_megatron_backend.model import build_model

    model = build_model(backend().model_config(), seed=1)
    model.decoder.layers[0].input_layernorm = IdentityOp()
    with pytest.raises(ValueError, match="layer 0: input_layernorm is fused into the next linear"):
        trace_forward(model, make_samples(1, seed=1, experts=False), temperature=1.0)
