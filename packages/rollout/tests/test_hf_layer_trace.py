"""`HFEngine.trace`: the engine's decode path taken again with the sampled tokens forced, every
layer recorded (`ember certify --layers`'s engine side)."""

from __future__ import annotations

import pytest
import torch
from test_hf_engine import PROMPTS, requests

from ember_rollout.config import HFEngineConfig
from ember_rollout.engine import EngineError
from ember_rollout.families import FAMILIES, build_family_model
from ember_rollout.hf_engine import HFEngine
from ember_rollout.layer_trace import LAYER_OPS, LayerTrace

NUM_LAYERS = 3


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_a_trace_decodes_as_the_rollout_did_and_records_every_layer(model_type):
    model = build_family_model(model_type, seed=4)
    engine = HFEngine(HFEngineConfig(dtype="float32"), model=model)
    # Rows that stop at different steps (the EOS of the toy tokenizer is likely early with
    # random weights), two sharing a prompt: the decode batch changes shape as in a rollout.
    asked = requests(temperature=0.9, max_new_tokens=10, routed=True)
    asked.append(requests(temperature=0.9, max_new_tokens=10, routed=True, seed=7)[0])
    outputs = engine.generate_sync(asked)
    sequences = [(r.input_ids, o.output_ids) for r, o in zip(asked, outputs, strict=True)]
    traces, log_probs = engine.trace(sequences, temperature=0.9)

    # The same tokens through the same decode steps: the log-probs the rollout reported, bit
    # for bit, and the experts it recorded.
    for output, traced, trace in zip(outputs, log_probs, traces, strict=True):
        assert traced == output.output_log_probs
        moe = [layer for layer in range(NUM_LAYERS) if (layer, "experts") in trace]
        assert moe
        assert torch.equal(trace[(moe[0], "experts")], output.routed_experts[:, moe[0]].long())
    # Recording only the first two decodes every sequence all the same.
    kept, again = engine.trace(sequences, temperature=0.9, keep=2)
    assert again == log_probs and len(kept) == 2
    assert all(torch.equal(kept[1][k], traces[1][k]) for k in traces[1])
    # Every position forwarded, in order: close to one forward of the whole sequence.
    for (prompt, answer), trace in zip(sequences, traces, strict=True):
        tokens = torch.tensor([[*prompt, *answer[:-1]]])
        with torch.no_grad():
            hidden = model(input_ids=tokens, output_hidden_states=True).hidden_states
        for layer in range(NUM_LAYERS - 1):  # the last entry is after the final norm
            assert trace[(layer, "layer")].shape == (tokens.shape[1], 64)
            torch.testing.assert_close(trace[(layer, "layer")], hidden[layer + 1][0])
        torch.testing.assert_close(trace[(NUM_LAYERS, "final_norm")], hidden[-1][0])
        ops = {op for _, op in trace}
        assert set(LAYER_OPS) <= ops


def test_a_dense_model_records_no_router_rows():
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, vocab_size=32)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, num_key_value_heads=2, **shape))
    engine = HFEngine(HFEngineConfig(dtype="float32"), model=model)
    [trace], [log_probs] = engine.trace([(PROMPTS[0], [5, 6, 7])])
    assert len(log_probs) == 3
    assert not {op for _, op in trace} & {"router_logits", "experts"}
    assert trace[(0, "attention_core")].shape[0] == len(PROMPTS[0]) + 2


def test_rows_leaving_the_batch_and_a_stop_token_inside_an_answer_keep_their_positions():
    """Answers of 1, 3 and 9 tokens, the batch compacted at every step, one answer holding the
    end-of-sequence id in its middle (it is a forced token, not the end)."""
    model = build_family_model("qwen3_moe", seed=4)
    engine = HFEngine(HFEngineConfig(dtype="float32", compact_every=1), model=model)
    eos = model.config.eos_token_id
    sequences = [(PROMPTS[0], [5]), (PROMPTS[1], [6, eos, 7]), (PROMPTS[3], [8, 9, 1, 2, 3] * 2)]
    sequences[2] = (PROMPTS[3], sequences[2][1][:9])
    traces, log_probs = engine.trace(sequences, temperature=0.8)
    for (prompt, answer), trace, traced in zip(sequences, traces, log_probs, strict=True):
        tokens = torch.tensor([[*prompt, *answer]])
        with torch.no_grad():
            out = model(input_ids=tokens[:, :-1], output_hidden_states=True)
        assert len(traced) == len(answer)
        assert trace[(0, "layer")].shape[0] == tokens.shape[1] - 1
        torch.testing.assert_close(trace[(1, "layer")], out.hidden_states[2][0])
        rows = torch.log_softmax(out.logits[0, len(prompt) - 1 :].float() / 0.8, -1)
        expected = rows.gather(1, tokens[0, len(prompt) :, None])[:, 0]
        torch.testing.assert_close(torch.tensor(traced), expected)


def test_what_cannot_be_traced_is_named():
    engine = HFEngine(HFEngineConfig(dtype="float32"), model=build_family_model("mixtral"))
    with pytest.raises(EngineError, match="traced sequence 1: an empty response"):
        engine.trace([(PROMPTS[0], [3]), (PROMPTS[1], [])])
    with pytest.raises(EngineError, match=r"traced sequence 0: response token ids \[999\] are "):
        engine.trace([(PROMPTS[0], [3, 999])])
    with pytest.raises(EngineError, match="traced sequence 0: 4 prompt and 5000 response tokens"):
        engine.trace([(PROMPTS[0], [3] * 5000)])

    class NoLayers(torch.nn.Module):
        pass

    with pytest.raises(ValueError, match="NoLayers: no `model.layers` and `model.norm`"):
        LayerTrace(NoLayers(), 1)
