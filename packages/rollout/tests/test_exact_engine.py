"""The embedded engine's model under `rollout.true_on_policy` (`ember_rollout.true_on_policy`):
its KV cache keeps each row's keys at their positions, and a model that would not let the
engine say so is refused. (That its log-probs are the trainer's bit for bit is
packages/ember/tests/test_true_on_policy.py.)"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from ember_rollout.true_on_policy import PositionCache, exact_model


def _llama(dtype: torch.dtype = torch.float32):
    """A small random Llama (two query heads per key head)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(1)
    return LlamaForCausalLM(config).to(dtype).eval()


LENGTHS = (9, 70, 33)
"""Left-padded rows: one in the first key block, one past it, one between."""


def _left_padded(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, width - n :] = torch.randint(1, vocab, (n,), generator=g)
        mask[b, width - n :] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_keys_at_their_positions_give_the_left_padded_caches_bits(dtype):
    """The same prefill and decode steps with transformers' left-padded `DynamicCache` and
    with a `PositionCache`: every logit the same bits, and the position cache holds row b's
    key of position p at index p, zeros past what was written."""
    model = exact_model(_llama(dtype))
    vocab = model.config.vocab_size
    ids, mask, positions = _left_padded(LENGTHS, vocab)
    width = ids.shape[1]
    left, placed = DynamicCache(config=model.config), PositionCache(model.config.num_hidden_layers)
    kwargs = placed.at(torch.where(mask.bool(), positions, -1))
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=left)
        b = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=placed,
            **kwargs,
        )
        real = mask.bool()
        assert torch.equal(a.logits[real], b.logits[real])
        for layer_a, layer_b in zip(left.layers, placed.layers, strict=True):
            for row, n in enumerate(LENGTHS):
                start = width - n
                assert torch.equal(layer_b.keys[row, :, :n], layer_a.keys[row, :, start:])
                assert torch.equal(layer_b.values[row, :, :n], layer_a.values[row, :, start:])
                assert not layer_b.keys[row, :, n:].any()
        last = positions[:, -1]
        g = torch.Generator().manual_seed(1)
        for _ in range(3):  # decode steps of rows in two key blocks
            token = torch.randint(1, vocab, (len(LENGTHS), 1), generator=g)
            mask = torch.cat([mask, mask.new_ones(len(LENGTHS), 1)], 1)
            last = last + 1
            step = {"attention_mask": mask, "position_ids": last[:, None], "input_ids": token}
            a = model(**step, past_key_values=left)
            b = model(**step, past_key_values=placed, **placed.at(last[:, None]))
            assert torch.equal(a.logits, b.logits)
    assert placed.get_seq_length() == left.get_seq_length() == width + 3


def test_a_model_whose_attention_does_not_see_the_forwards_keywords_is_refused(monkeypatch):
    """The engine tells the attention where a `PositionCache` keeps the keys through the
    forward's keyword arguments; a model that drops them on the way is refused at the start,
    not left to read keys from the wrong places."""
    from transformers.models.llama import modeling_llama

    forward = modeling_llama.LlamaAttention.forward

    def dropping(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        return forward(self, hidden_states, position_embeddings, attention_mask)

    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", dropping)
    with pytest.raises(ValueError, match="keyword arguments to the attention of 0 of its"):
        exact_model(_llama())
