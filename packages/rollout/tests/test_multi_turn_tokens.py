"""Token-in-token-out multi-turn: across `ember_generate` turns the model sees exactly the
tokens it produced plus the tokens appended (tool output, template glue), on a real byte-level
BPE chat tokenizer (trained here, ChatML template) and a real tiny model.

Each case also builds the next context the way re-tokenising implementations do (render the
conversation from the decoded text with the chat template, encode it again) and shows the
defect the case is about: a separator dropped at the assistant-to-tool boundary, a think block
written twice, a BPE merge across the boundary.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
from conftest import TINY

from ember_core.config import SamplingConfig
from ember_core.hookspecs import hookimpl
from ember_core.plugins import EmberPlugins
from ember_rollout.config import (
    DataConfig,
    EngineConfig,
    HFEngineConfig,
    RolloutSections,
    ToyTaskConfig,
)
from ember_rollout.hf_engine import HFEngine
from ember_rollout.models import write_tiny_checkpoint
from ember_rollout.rollout import RolloutGenerator
from ember_rollout.turns import TurnTokens, message_ids

# ChatML with two habits of real templates: content is trimmed (as Llama 3's template does),
# and every assistant turn after the last user message carries a think block filled from
# `reasoning_content` (as Qwen3's does), empty when there is none.
TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_user %}"
    "{{- '<think>\\n' + (m.reasoning_content or '') | trim + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{{- m.content | trim + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

SENTENCES = [
    "The answer is 7.",
    "The island is far.",
    "Let me think about the island.",
    "The answer to the question is on the island.",
    "I will call the tool now.",
    "The tool says the answer is 12.",
    "Sure, the answer is here.",
]

QUESTION = "What is 3 + 4?"
TOOL = {"role": "tool", "content": "7"}


def build_chat_tokenizer() -> Any:
    """A byte-level BPE (merges learnt from `SENTENCES`) with ChatML special tokens and
    `<think>` / `</think>` as added ordinary tokens, as Qwen3's tokenizer has them."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(SENTENCES * 20, trainer)
    core.add_tokens([AddedToken(t, normalized=False) for t in ("<think>", "</think>")])
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=TEMPLATE,
    )


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_chat_tokenizer()


def encode(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def rendered(tok: Any, messages: list[dict[str, Any]]) -> list[int]:
    """The conversation through the chat template, next assistant turn opened, encoded."""
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return encode(tok, text)


def prompt_ids(tok: Any) -> list[int]:
    return rendered(tok, [{"role": "user", "content": QUESTION}])


def glue(tok: Any, produced: list[int], tool_text: str) -> list[int]:
    """What must follow an assistant turn before a tool message, written out by hand from
    ChatML: the turn's `<|im_end|>` unless the model wrote it, the newline after it, the tool
    message, and the next assistant turn's opening."""
    end = tok.convert_tokens_to_ids("<|im_end|>")
    text = f"\n<|im_start|>tool\n{tool_text}<|im_end|>\n<|im_start|>assistant\n"
    return ([] if produced[-1:] == [end] else [end]) + encode(tok, text)


def assert_continues(tok: Any, context: list[int], prompt: list[int], produced: list[int]):
    """The context after a tool call is the prompt, the produced tokens as they are, and the
    ChatML glue around the tool's output."""
    assert context[: len(prompt)] == prompt
    assert context[len(prompt) : len(prompt) + len(produced)] == produced, "produced changed"
    assert context[len(prompt) + len(produced) :] == glue(tok, produced, TOOL["content"])


# --------------------------------------------------------------------------------------------
# The two ways of building the next context
# --------------------------------------------------------------------------------------------


def token_context(tok: Any, prompt: list[int], produced: list[int]) -> list[int]:
    """Token in, token out: the helper plugins use."""
    turns = TurnTokens(list(prompt))
    turns.add_completion(_Completion(produced))
    turns.add_messages(tok, [TOOL])
    return turns.ids


def retokenised_context(tok: Any, prompt: list[int], produced: list[int]) -> list[int]:
    """The negative control: the conversation rendered again from the decoded response."""
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": tok.decode(produced, skip_special_tokens=True)},
        TOOL,
    ]
    return rendered(tok, messages)


class _Completion:
    """An engine answer with these output ids (log-probs are not read by the cases)."""

    def __init__(self, output_ids: list[int]) -> None:
        self.output_ids = list(output_ids)
        self.output_log_probs = [-1.0] * len(output_ids)


# --------------------------------------------------------------------------------------------
# The cases
# --------------------------------------------------------------------------------------------


def test_the_appended_tokens_are_the_templates_glue_after_the_produced_turn(tok):
    """A turn whose tokens are the canonical encoding: the helper's context is token for token
    the template's rendering of the whole conversation; a turn cut off before `<|im_end|>`
    gets it from the glue."""
    end = tok.convert_tokens_to_ids("<|im_end|>")
    prompt = prompt_ids(tok)
    produced = [*encode(tok, "<think>\n\n</think>\n\nThe answer is 7."), end]
    context = token_context(tok, prompt, produced)
    assert_continues(tok, context, prompt, produced)
    whole = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "The answer is 7."},
        TOOL,
    ]
    assert context == rendered(tok, whole)
    cut = produced[:-1]
    assert message_ids(tok, [TOOL], produced=cut)[:2] == [end, encode(tok, "\n")[0]]
    assert_continues(tok, token_context(tok, prompt, cut), prompt, cut)


def test_a_newline_the_model_wrote_at_the_end_of_its_turn_is_not_dropped(tok):
    """The model ended its turn with a newline before `<|im_end|>`; the template trims content,
    so a re-rendered conversation loses that separator."""
    end, newline = tok.convert_tokens_to_ids("<|im_end|>"), encode(tok, "\n")
    prompt = prompt_ids(tok)
    produced = [*encode(tok, "I will call the tool now.\n"), end]
    context = token_context(tok, prompt, produced)
    assert_continues(tok, context, prompt, produced)
    boundary = len(prompt) + len(produced)
    assert context[boundary - 2 : boundary + 2] == [*newline, end, *newline, 1]

    control = retokenised_context(tok, prompt, produced)
    with pytest.raises(AssertionError, match="produced changed"):
        assert_continues(tok, control, prompt, produced)
    # The newline before the turn's <|im_end|> is gone.
    closing = control.index(end, len(prompt))
    assert control[closing - 1] == encode(tok, ".")[0]
    assert control[closing - 1 :][:3] == [*encode(tok, "."), end, *newline]


def test_a_think_block_the_model_wrote_is_there_once(tok):
    """The model wrote its own think block; the template adds one from `reasoning_content`
    (empty here) to every assistant turn after the last user message, so a re-rendered
    conversation holds two."""
    end, think = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<think>")
    prompt = prompt_ids(tok)
    produced = [
        *encode(tok, "<think>\nThe tool says the answer is 12.\n</think>\n\nThe answer is 12."),
        end,
    ]
    context = token_context(tok, prompt, produced)
    assert_continues(tok, context, prompt, produced)
    assert context.count(think) == 1

    control = retokenised_context(tok, prompt, produced)
    with pytest.raises(AssertionError):
        assert_continues(tok, control, prompt, produced)
    assert control.count(think) == 2


def test_no_bpe_merge_across_the_boundary(tok):
    """Two merges a re-encoding makes: tool text appended inside the turn joins the model's
    last word (" is" + "land" -> " island"), and a word the model spelt in pieces
    (" an" "s" "w" "e" "r") becomes one token. Encoding only the appended part keeps both."""
    prompt = prompt_ids(tok)
    produced = encode(tok, "The answer is")
    turns = TurnTokens(list(prompt))
    turns.add_completion(_Completion(produced))
    appended = turns.add_text(tok, "land")
    assert turns.ids == [*prompt, *produced, *encode(tok, "land")]
    assert turns.loss_mask == [1] * len(produced) + [0] * len(appended)
    assert all(math.isnan(v) for v in turns.log_probs[len(produced) :])
    rejoined = encode(tok, tok.decode([*prompt, *produced]) + "land")
    assert rejoined != turns.ids
    assert tok.convert_tokens_to_ids("Ġisland") in rejoined
    assert tok.convert_tokens_to_ids("Ġisland") not in turns.ids

    end = tok.convert_tokens_to_ids("<|im_end|>")
    spelt = tok.convert_tokens_to_ids(["The", "Ġ", "a", "n", "s", "w", "e", "r", "Ġis", "Ġ7", "."])
    produced = [*spelt, end]
    context = token_context(tok, prompt, produced)
    assert_continues(tok, context, prompt, produced)
    control = retokenised_context(tok, prompt, produced)
    with pytest.raises(AssertionError, match="produced changed"):
        assert_continues(tok, control, prompt, produced)
    assert tok.convert_tokens_to_ids("Ġanswer") in control
    assert tok.convert_tokens_to_ids("Ġanswer") not in context


def test_a_template_that_rewrites_the_content_is_refused(tok):
    """Where the assistant's content is not in the template's text as it is, the end of the
    turn cannot be found: a clear error, not a guess."""
    from transformers import PreTrainedTokenizerFast

    other = PreTrainedTokenizerFast(
        tokenizer_object=tok.backend_tokenizer,
        eos_token="<|im_end|>",
        chat_template="{% for m in messages %}{{ m.content | upper }}{% endfor %}",
    )
    with pytest.raises(ValueError, match="assistant message's content"):
        message_ids(other, [TOOL])


# --------------------------------------------------------------------------------------------
# Through the hook, on a real engine
# --------------------------------------------------------------------------------------------

SAMPLING = SamplingConfig(rollout_batch_size=2, n_samples_per_prompt=2, max_response_len=40)
FIRST_TURN = 6


class ToolTurn:
    """One tool call per sample: the first turn (stopping at `<|im_end|>` or after
    `FIRST_TURN` tokens), the tool's output, the answer. `context` builds the second turn's
    context from the prompt and the first turn's tokens."""

    def __init__(self, context) -> None:
        self.context = context

    @hookimpl
    async def ember_generate(self, client, prompt_ids, sampling):
        tok = client.tokenizer
        end = tok.convert_tokens_to_ids("<|im_end|>")

        async def one(j: int):
            first = await client.generate(
                prompt_ids, sample=j, max_new_tokens=FIRST_TURN, stop_token_ids=[end]
            )
            produced = list(first.output_ids)
            context = self.context(tok, prompt_ids, produced)
            used = len(context) - len(prompt_ids)
            second = await client.generate(
                context, sample=j, max_new_tokens=sampling.max_new_tokens - used
            )
            turns = TurnTokens(list(prompt_ids))
            turns.add_completion(first)
            turns.add_inserted(context[len(prompt_ids) + len(produced) :])
            turns.add_completion(second)
            return turns.sample(status=second.status)

        return await asyncio.gather(*(one(j) for j in range(sampling.n)))


@pytest.fixture(scope="module")
def chat_engine(tmp_path_factory, tok) -> HFEngine:
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("chat-model"), TINY, tokenizer=tok)
    engine = HFEngine(HFEngineConfig(model_path=str(path), dtype="float32"))
    engine.load()
    return engine


def run_turns(engine: HFEngine, context, monkeypatch) -> tuple[list[Any], dict[str, Any]]:
    """The rollout's samples and, per sample, its engine calls as (request, output) pairs in
    call order."""
    calls: dict[str, list[tuple[Any, Any]]] = {}
    generate = engine.generate

    async def recording(batch):
        outputs = await generate(batch)
        for request, output in zip(batch, outputs, strict=True):
            sample, call = request.name.rsplit(" call ", 1)
            assert int(call) == len(calls.setdefault(sample, []))
            calls[sample].append((request, output))
        return outputs

    monkeypatch.setattr(engine, "generate", recording)
    host = EmberPlugins()
    host.register(ToolTurn(context), "tool_turn")
    sections = RolloutSections(
        engine=EngineConfig(kind="hf", hf=HFEngineConfig(model_path=engine.config.model_path)),
        data=DataConfig(toy=ToyTaskConfig(num_prompts=8, seed=3)),
    )
    generator = RolloutGenerator.from_config(
        engine=engine, sampling=SAMPLING, sections=sections, plugins=host
    )
    try:
        batch = asyncio.run(generator.generate(0))
    finally:
        host.unregister(name="tool_turn")
    assert len(calls) == len(batch.samples) == 4
    assert all(len(c) == 2 for c in calls.values())
    return batch.samples, calls


def test_through_the_hook_the_engine_sees_the_produced_tokens_and_the_glue(
    chat_engine, tok, monkeypatch
):
    """The second call's input is the first call's input, its output as the engine returned
    it, and the glue; the sample is that context and the second output, masked 0 on the glue."""
    samples, calls = run_turns(chat_engine, token_context, monkeypatch)
    for sample, ((first, out1), (second, out2)) in zip(samples, calls.values(), strict=True):
        produced = list(out1.output_ids)
        assert_continues(tok, second.input_ids, first.input_ids, produced)
        assert sample.tokens == [*second.input_ids, *out2.output_ids]
        inserted = len(second.input_ids) - len(first.input_ids) - len(produced)
        assert sample.loss_mask == [1] * len(produced) + [0] * inserted + [1] * len(out2.output_ids)


def test_through_the_hook_a_retokenising_plugin_is_caught(chat_engine, tok, monkeypatch):
    """The same check on the same engine fails for every sample when the plugin renders the
    conversation again from the decoded response (here at least the empty think block the
    template adds is new)."""
    _, calls = run_turns(chat_engine, retokenised_context, monkeypatch)
    for (first, out1), (second, _) in calls.values():
        with pytest.raises(AssertionError):
            assert_continues(tok, second.input_ids, first.input_ids, list(out1.output_ids))
