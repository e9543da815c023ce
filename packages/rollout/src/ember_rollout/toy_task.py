"""The toy tasks: copy, reverse, sort or shift a short digit string, with partial credit per
digit."""

from __future__ import annotations

import random

from ember_rollout.config import ToyTaskConfig

TRANSFORMS = {
    "copy": lambda digits: digits,
    "reverse": lambda digits: digits[::-1],
    "sort": lambda digits: "".join(sorted(digits)),
}
"""What each word task asks for, as a function of the prompt's digit string."""
TASKS = (*TRANSFORMS, "shift")
"""Every toy task. `shift` is modular arithmetic: "314 : 2 =" asks for each digit plus 2,
mod 10 ("536"); its prompts carry no task word, the shift digit (1 to 9) after the colon."""


def shifted(digits: str, shift: int) -> str:
    """Each digit plus `shift`, mod 10."""
    return "".join(str((int(d) + shift) % 10) for d in digits)


def toy_prompt(task: str, digits: str, shift: int | None = None) -> dict[str, str]:
    """One prompt record: {"prompt": "copy 314 =", "label": "314"}; for `shift` (which needs
    `shift` in 1..9) {"prompt": "314 : 2 =", "label": "536"}."""
    if task not in TASKS:
        raise ValueError(f"toy task {task!r}: expected one of {', '.join(TASKS)}")
    if not digits.isdigit():
        raise ValueError(f"toy task digits {digits!r}: expected a string of digits")
    if task == "shift":
        if shift is None or not 1 <= shift <= 9:
            raise ValueError(f"toy task shift: shift={shift!r}, expected 1 to 9")
        return {"prompt": f"{digits} : {shift} =", "label": shifted(digits, shift)}
    if shift is not None:
        raise ValueError(f"toy task {task!r}: shift={shift!r} belongs to the shift task only")
    return {"prompt": f"{task} {digits} =", "label": TRANSFORMS[task](digits)}


def make_toy_prompts(config: ToyTaskConfig) -> list[dict[str, str]]:
    """`config.num_prompts` prompt records, the same for the same config (seeded)."""
    rng = random.Random(config.seed)
    records = []
    for _ in range(config.num_prompts):
        length = rng.randint(config.min_digits, config.max_digits)
        digits = "".join(rng.choice("0123456789") for _ in range(length))
        shift = rng.randint(1, 9) if config.task == "shift" else None
        records.append(toy_prompt(config.task, digits, shift))
    return records


_END = object()
"""Stands for the stop token in the position-by-position comparison."""


def toy_score(response: str, label: str, *, stopped: bool = True) -> float:
    """Fraction of correct positions, the stop token counting as one more position.

    The target is the label's characters followed by the end of the response; the prediction
    is the response's characters (whitespace ignored), followed by the end when the response
    stopped by itself (`stopped`) rather than being cut at max_response_len. The score is the
    number of positions where they agree over the longer of the two, so every wrong, missing or
    extra character costs the same, and stopping at the right length earns one position: the
    reward rises smoothly from chance level to 1 for the exact answer followed by EOS.
    """
    target = list("".join(str(label).split()))
    if not target:
        raise ValueError(f"toy_score: empty label {label!r}")
    predicted: list[object] = list("".join(response.split()))
    target_units: list[object] = [*target, _END]
    if stopped:
        predicted.append(_END)
    correct = sum(p == t for p, t in zip(predicted, target_units, strict=False))
    return correct / max(len(target_units), len(predicted))
