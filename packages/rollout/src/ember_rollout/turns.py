"""Token-in-token-out multi-turn contexts: the tokens an `ember_generate` plugin appends after a
turn the model produced, never a re-encoding of the conversation's decoded text.

Re-rendering a conversation through the chat template and encoding the text again changes the
tokens the model produced: byte-level BPE merges the decoded text differently from how the
model sampled it (" an" + "swer" becomes " answer"), templates trim content (a newline the
model wrote before its end-of-turn token goes) and add think blocks from `reasoning_content`
(a think block the model wrote is then there twice). The model would then be trained on a
sequence it never saw. Here the produced tokens stay as they are and only the appended part is
encoded: its text is the chat template's own rendering of the new messages after an assistant
turn, glue included (ChatML's newline after `<|im_end|>`, the next `<|im_start|>assistant\\n`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ember_core.types import Sample, SampleStatus

__all__ = ["TurnTokens", "message_ids"]

_ASSISTANT = "ember-turn-end-3f9c"
"""Stands in for the content of the assistant turn the appended messages follow: the template's
text after it is what follows a turn (no whitespace or think tags, so no template trims it)."""
_USER = "ember-turn-user-3f9c"


def message_ids(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    produced: Sequence[int] = (),
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> list[int]:
    """Token ids that continue a context ending with an assistant turn the model produced, with
    `messages` (a tool's output, a user's reply), as the chat template renders them.

    The template renders a conversation whose last assistant turn holds a placeholder; the text
    after the placeholder is the turn's closing glue (ChatML: `<|im_end|>` and a newline), the
    new messages, and, with `add_generation_prompt`, the opening of the next assistant turn.
    That text alone is encoded. When the produced turn already ends with the glue's first token
    (the model stopped at `<|im_end|>`), that token is not repeated; a turn cut off by a length
    limit gets the whole glue.

    Args:
        tokenizer: A transformers tokenizer with a chat template.
        messages: The messages to append, as the chat template takes them.
        produced: The tokens of the assistant turn the model produced (only its last token is
            read); they stay in the context as they are.
        add_generation_prompt: Open the next assistant turn after the messages.
        template_kwargs: Passed to `apply_chat_template` (for example `tools`).

    Returns:
        The ids to append after `produced`.

    Raises:
        ValueError: The tokenizer has no chat template, or the template does not render the
            assistant turn's content as it is (so nothing marks where the turn ends).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("message_ids: the tokenizer has no chat template")
    conversation = [
        {"role": "user", "content": _USER},
        {"role": "assistant", "content": _ASSISTANT},
        *[dict(m) for m in messages],
    ]
    text = tokenizer.apply_chat_template(
        conversation,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **template_kwargs,
    )
    if text.count(_ASSISTANT) != 1:
        raise ValueError(
            "message_ids: the chat template does not render an assistant message's content "
            "once, as it is, so the end of the model's turn cannot be found in its text"
        )
    ids = list(tokenizer(text.split(_ASSISTANT)[1], add_special_tokens=False)["input_ids"])
    if produced and ids and int(produced[-1]) == ids[0] and ids[0] in _special_ids(tokenizer):
        ids = ids[1:]
    return ids


def _special_ids(tokenizer: Any) -> set[int]:
    special = set(tokenizer.all_special_ids)
    special |= {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return special


@dataclass(slots=True)
class TurnTokens:
    """One multi-turn sample as it grows: the context is always the prompt, every produced
    token and every appended token, in order, so the next engine call sees exactly them.

    Example, inside an `ember_generate` sample coroutine::

        turns = TurnTokens(prompt_ids)
        first = await client.generate(turns.ids, sample=j)
        turns.add_completion(first)
        turns.add_messages(client.tokenizer, [{"role": "tool", "content": out}])
        second = await client.generate(turns.ids, sample=j)
        turns.add_completion(second)
        sample = turns.sample(status=second.status, routed_experts=second.routed_experts)
    """

    prompt_ids: list[int]
    response: list[int] = field(default_factory=list)
    """Response tokens so far, produced and appended."""
    loss_mask: list[int] = field(default_factory=list)
    """1 on each produced token, 0 on each appended one."""
    log_probs: list[float] = field(default_factory=list)
    """The engine's log-prob of each produced token; NaN on appended ones."""
    last_produced: list[int] = field(default_factory=list)
    """The tokens of the last completion added."""

    @property
    def ids(self) -> list[int]:
        """The whole context: prompt and response so far."""
        return [*self.prompt_ids, *self.response]

    def add_completion(self, completion: Any) -> None:
        """Append an engine answer's `output_ids` as they are, with their log-probs."""
        output = [int(t) for t in completion.output_ids]
        if len(completion.output_log_probs) != len(output):
            raise ValueError(
                f"add_completion: {len(completion.output_log_probs)} log-probs for "
                f"{len(output)} output ids"
            )
        self.response += output
        self.loss_mask += [1] * len(output)
        self.log_probs += [float(v) for v in completion.output_log_probs]
        self.last_produced = output

    def add_inserted(self, ids: Sequence[int]) -> None:
        """Append tokens the model did not generate (loss mask 0), as they are."""
        self.response += [int(t) for t in ids]
        self.loss_mask += [0] * len(ids)
        self.log_probs += [math.nan] * len(ids)

    def add_messages(
        self,
        tokenizer: Any,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """Append `messages` after the last completion with the chat template's glue
        (`message_ids`), masked; returns the ids appended."""
        ids = message_ids(
            tokenizer,
            messages,
            produced=self.last_produced,
            add_generation_prompt=add_generation_prompt,
            **template_kwargs,
        )
        self.add_inserted(ids)
        self.last_produced = []
        return ids

    def add_text(self, tokenizer: Any, text: str) -> list[int]:
        """Append plain text (inside the current turn, no template glue), encoded alone and
        masked: never merged with the tokens before it. Returns the ids appended."""
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        self.add_inserted(ids)
        self.last_produced = []
        return ids

    def sample(
        self,
        *,
        status: SampleStatus,
        routed_experts: torch.Tensor | None = None,
        **fields: Any,
    ) -> Sample:
        """The `Sample` for `ember_generate`: tokens, response length, loss mask, log-probs,
        status, the last call's routed experts, and any other `Sample` fields given."""
        return Sample(
            tokens=self.ids,
            response_length=len(self.response),
            loss_mask=list(self.loss_mask),
            rollout_log_probs=list(self.log_probs),
            rollout_routed_experts=routed_experts,
            status=status,
            **fields,
        )
