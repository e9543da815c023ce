"""The calc task: add two digits by calling a calculator, then copy its answer; its reward and
its files (tokenizer, prompts)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CALC = "calc"
"""Ends a call: the model writes an expression and `calc`, as one presses a calculator's
equals key (`3 + 4 calc`), and the calculator's output follows."""
PLUS = "+"
"""The one operator the calculator knows."""
WORDS = (CALC, PLUS)
"""What the task adds to the toy tokenizer's vocabulary (the digits and `=` are in it)."""
UNKNOWN = "?"
"""The calculator's output for an expression it cannot read (a toy token)."""
SECTION = "calc_tool"
"""The metadata key the plugin writes on each sample (and the plugin's name)."""


def make_prompts() -> list[dict[str, str]]:
    """Every prompt of the task: `a + b =` for the digits a, b from 0 to 4, labelled with the
    sum (25 prompts; every sum is one digit)."""
    pairs = [(a, b) for a in range(5) for b in range(5)]
    return [{"prompt": f"{a} {PLUS} {b} =", "label": str(a + b)} for a, b in pairs]


def calculate(expression: str) -> str:
    """The calculator: the sum of `+`-separated non-negative integers, as text, or `UNKNOWN`
    when the expression is anything else ("3+4" -> "7", "3++4" -> "?")."""
    terms = expression.replace(" ", "").split(PLUS)
    if not all(term.isdigit() for term in terms):
        return UNKNOWN
    return str(sum(int(term) for term in terms))


def ideal_call(prompt: str) -> list[str]:
    """The tokens of the right call for a prompt: "3 + 4 =" -> ["3", "+", "4", "calc"]."""
    return [*prompt.removesuffix("=").split(), CALC]


def calc_reward(sample: Any) -> dict[str, float]:
    """The fraction of a perfect sample's tokens that the sample generated right.

    A perfect sample for "3 + 4 =" generates five tokens: the call `3 + 4 calc` and, after the
    calculator's output `7`, the answer `7`. The call is compared token by token with the right
    one (over the longer of the two, so extra tokens cost too), as the toy task compares
    digits; the answer counts only after the right call: then the output it can copy is the
    sum, and a right answer after a wrong call would not have come from the calculator. Partial
    credit lets an untrained model's samples differ in reward; 1.0 takes the right call and the
    right answer.

    Raises:
        ValueError: The sample has no calc_tool record (the plugin did not generate it) or no
            label; the message names the sample.
    """
    where = f"sample {sample.index} (group {sample.group_index})"
    info = sample.metadata.get(SECTION)
    if not isinstance(info, dict):
        raise ValueError(
            f"{where}: no {SECTION!r} record in its metadata; the calc reward scores samples "
            f"the {SECTION} plugin generated (enable it: plugins: [{SECTION}])"
        )
    if sample.label is None:
        raise ValueError(f"{where}: no label; the calc reward needs the sum as the label")
    target = ideal_call(str(sample.prompt))
    call, answer = info["call"], info["answer"]
    right = sum(a == b for a, b in zip(call, target, strict=False))
    answered = call == target and answer == [str(sample.label)]
    score = (right + answered) / (max(len(call), len(target)) + 1)
    return {"score": score, "right_call": float(call == target), "right_answer": float(answered)}


def write_task_files(directory: str | Path) -> Path:
    """Write the task's tokenizer (`tokenizer/`: the toy tokenizer with `WORDS` added) and
    prompts (`prompts.jsonl`) under `directory`; returns it."""
    from ember_rollout.tokenizer import save_toy_tokenizer

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_toy_tokenizer(directory / "tokenizer", extra_words=WORDS)
    lines = [json.dumps(record) + "\n" for record in make_prompts()]
    (directory / "prompts.jsonl").write_text("".join(lines))
    return directory
