"""The calc_tool plugin: two-turn rollouts in which the model calls a calculator
(`ember_generate`), the calculator's output inserted with loss mask 0."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from ember_calc_tool.task import CALC, SECTION, calculate
from ember_core.config import check
from ember_core.hookspecs import ConfigSection, EngineClient, GenerateSettings, hookimpl
from ember_core.types import Sample, SampleStatus

ANSWER_TOKENS = 1
"""The answer is the one token after the calculator's output: every sum of the task is a digit."""


@dataclass(kw_only=True, slots=True)
class CalcToolConfig:
    """How long a call may be."""

    max_call_tokens: int = 6
    """Most tokens of the model's first turn; a call (`3 + 4 calc`) ends at `calc`, and a turn
    cut off here ends the sample, truncated."""

    def __post_init__(self) -> None:
        value = self.max_call_tokens
        valid = isinstance(value, int) and not isinstance(value, bool)
        check(valid and value >= 2, "max_call_tokens", value, "an integer >= 2")


_config: CalcToolConfig | None = None


def _current() -> CalcToolConfig:
    if _config is None:
        raise RuntimeError(
            f"{SECTION}: ember_generate ran before ember_configure; configure the plugins "
            "(EmberPlugins.configure) before generating rollouts"
        )
    return _config


def calc_id(tokenizer: Any) -> int:
    """The id of `calc` in the run's tokenizer.

    Raises:
        ValueError: The tokenizer has no such token (the run does not use the task's).
    """
    vocab = tokenizer.get_vocab()
    if CALC not in vocab:
        raise ValueError(
            f"{SECTION}: the tokenizer has no {CALC!r} token; set data.tokenizer_path to the "
            "task's tokenizer (examples/plugins/calc_tool/data/tokenizer)"
        )
    return vocab[CALC]


# --------------------------------------------------------------------------------------------
# Hooks
# --------------------------------------------------------------------------------------------


@hookimpl
def ember_config_section() -> ConfigSection:
    return ConfigSection(SECTION, CalcToolConfig)


@hookimpl
def ember_configure(config: Any, sections: dict[str, Any]) -> None:
    global _config
    section = sections.get(SECTION) or CalcToolConfig()
    room = section.max_call_tokens + 2 * ANSWER_TOKENS  # the call, the output, the answer
    limit = config.rollout.max_response_len
    check(
        limit >= room,
        "rollout.max_response_len",
        limit,
        f">= {room} with {SECTION}.max_call_tokens={section.max_call_tokens} (the call, the "
        "calculator's output and the answer)",
    )
    _config = section


@hookimpl
async def ember_generate(
    client: EngineClient, prompt_ids: list[int], sampling: GenerateSettings
) -> list[Sample]:
    config, calc = _current(), calc_id(client.tokenizer)
    samples = (
        generate_one(client, j, prompt_ids, sampling, calc, config) for j in range(sampling.n)
    )
    return list(await asyncio.gather(*samples))


async def generate_one(
    client: EngineClient,
    j: int,
    prompt_ids: list[int],
    sampling: GenerateSettings,
    calc: int,
    config: CalcToolConfig,
) -> Sample:
    """Sample `j` of a group: the model's call, the calculator's output, the model's answer.

    The first turn stops at `calc`: then it is a call, its expression goes to the calculator,
    whose output is inserted (loss mask 0, log-prob 0) and the model generates the answer from
    the whole context. A first turn that ends otherwise (the stop token, or cut off) is the
    sample's end. Every engine call asks for routed experts when the run does; the sample keeps
    the last call's, whose prefill covered every earlier token, the inserted ones included.
    """
    tokenizer = client.tokenizer
    first = await client.generate(
        prompt_ids,
        sample=j,
        max_new_tokens=config.max_call_tokens,
        stop_token_ids=[*sampling.stop_token_ids, calc],
    )
    call = list(first.output_ids)
    tokens = [*prompt_ids, *call]
    mask, log_probs = [1] * len(call), list(first.output_log_probs)
    record: dict[str, Any] = {"call": tokenizer.convert_ids_to_tokens(call), "answer": []}
    last = first
    if first.finish_reason == "length":
        status = SampleStatus.TRUNCATED
    elif first.finish_reason == "abort":
        status = SampleStatus.ABORTED
    elif call[-1] != calc:
        status = SampleStatus.COMPLETED  # answered (or stopped) without the calculator
    else:
        record["output"] = calculate(tokenizer.decode(call[:-1], skip_special_tokens=True))
        output = tokenizer.encode(record["output"], add_special_tokens=False)
        if len(mask) + len(output) + ANSWER_TOKENS > sampling.max_new_tokens:
            # A long sum of long numbers: no room for its output and an answer.
            status = SampleStatus.TRUNCATED
            return _sample(tokens, mask, log_probs, last, status, record)
        tokens += output
        mask += [0] * len(output)
        log_probs += [0.0] * len(output)
        last = await client.generate(tokens, sample=j, max_new_tokens=ANSWER_TOKENS)
        answer = list(last.output_ids)
        tokens += answer
        mask += [1] * len(answer)
        log_probs += last.output_log_probs
        record["answer"] = tokenizer.convert_ids_to_tokens(answer)
        status = SampleStatus.ABORTED if last.finish_reason == "abort" else SampleStatus.COMPLETED
    return _sample(tokens, mask, log_probs, last, status, record)


def _sample(
    tokens: list[int],
    mask: list[int],
    log_probs: list[float],
    last: Any,
    status: SampleStatus,
    record: dict[str, Any],
) -> Sample:
    return Sample(
        tokens=tokens,
        response_length=len(mask),
        loss_mask=mask,
        rollout_log_probs=log_probs,
        rollout_routed_experts=last.routed_experts,
        status=status,
        metadata={SECTION: record},
    )
