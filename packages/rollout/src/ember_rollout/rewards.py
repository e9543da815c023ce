"""Reward functions chosen by name: the toy verifier, `math` (math-verify), and user code."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import math
import re
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from ember_core.algorithms.registry import Registry
from ember_core.types import Sample, SampleStatus
from ember_rollout.config import RewardConfig
from ember_rollout.toy_task import toy_score

SampleReward = Callable[[Sample], "float | dict[str, Any] | Awaitable[float | dict[str, Any]]"]
"""Scores one sample: a float, or a dict with a "score" key and extra details."""
GroupReward = Callable[[list[Sample]], "Sequence[float] | Awaitable[Sequence[float]]"]
"""Scores the `n_samples_per_prompt` samples of one prompt together (e.g. ranking)."""

GROUP_MARKER = "ember_group_reward"
"""Attribute that marks a `module:function` reward as a group reward (see `group_reward`)."""


@dataclass(frozen=True, slots=True)
class RewardSpec:
    """A reward function and whether it scores whole groups."""

    fn: Callable[..., Any]
    group: bool = False


REWARDS: Registry[RewardSpec] = Registry("reward function")
"""Built-in and registered reward functions by name."""


def register_reward(name: str, *aliases: str, group: bool = False) -> Callable[[Any], Any]:
    """Decorator registering a reward function (sync or async) under `name`.

    Args:
        name: The name `reward.reward_fn` selects it by.
        aliases: Other names for it.
        group: The function takes a group's samples and returns one score per sample.
    """

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        REWARDS.add(name, RewardSpec(fn, group), *aliases)
        return fn

    return decorator


def group_reward(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a user function (named as `module:function`) as a group reward."""
    setattr(fn, GROUP_MARKER, True)
    return fn


def resolve_reward(name: str) -> RewardSpec:
    """The reward named `name`: a registered name, or `package.module:function`.

    Raises:
        ValueError: Unknown name (the registered names are listed), a module that does not
            import, or an attribute that is not callable.
    """
    if ":" not in name:
        try:
            return REWARDS.get(name)
        except ValueError as exc:
            raise ValueError(
                f"reward.reward_fn: {exc} (or package.module:function for your own)"
            ) from None
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"reward.reward_fn={name!r}: cannot import module {module_name!r} ({exc})"
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward.reward_fn={name!r}: {module_name} has no callable {attr!r}")
    return RewardSpec(fn, bool(getattr(fn, GROUP_MARKER, False)))


async def _call(fn: Callable[..., Any], arg: Any) -> Any:
    result = fn(arg)
    if inspect.isawaitable(result):
        result = await result
    return result


def _score(value: Any, sample: Sample, name: str) -> float:
    """A finite float from a reward function's answer; extra dict entries go to metadata."""
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(
                f"sample {sample.index} (group {sample.group_index}): reward {name!r} returned a "
                f"dict without 'score' (keys: {sorted(value)})"
            )
        sample.metadata["reward_info"] = {k: v for k, v in value.items() if k != "score"}
        value = value["score"]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(
            f"sample {sample.index} (group {sample.group_index}): reward {name!r} returned "
            f"{value!r}, expected a finite number"
        )
    return float(value)


class Scorer:
    """Scores samples with the configured reward function, async and with bounded concurrency."""

    def __init__(self, config: RewardConfig | None = None) -> None:
        self.config = config or RewardConfig()
        self.name = self.config.reward_fn
        self.spec = resolve_reward(self.name)
        set_math_timeout(self.config.math_timeout_s)

    async def score_groups(self, groups: Sequence[list[Sample]]) -> None:
        """Set `sample.reward` on every sample, in place."""
        semaphore = asyncio.Semaphore(self.config.max_concurrency)

        async def one(sample: Sample) -> None:
            async with semaphore:
                sample.reward = _score(await _call(self.spec.fn, sample), sample, self.name)

        async def group(samples: list[Sample]) -> None:
            async with semaphore:
                scores = await _call(self.spec.fn, list(samples))
            if not isinstance(scores, Sequence) or len(scores) != len(samples):
                first = samples[0]
                raise ValueError(
                    f"group {first.group_index}: group reward {self.name!r} returned "
                    f"{scores!r}, expected {len(samples)} scores"
                )
            for sample, score in zip(samples, scores, strict=True):
                sample.reward = _score(score, sample, self.name)

        if self.spec.group:
            await asyncio.gather(*(group(g) for g in groups))
        else:
            await asyncio.gather(*(one(s) for g in groups for s in g))


# --------------------------------------------------------------------------------------------
# Built-in rewards
# --------------------------------------------------------------------------------------------


@register_reward("toy")
def toy_reward(sample: Sample) -> float:
    """The toy task's verifier: fraction of correct positions, EOS included (`toy_score`)."""
    if sample.label is None:
        raise ValueError(
            f"sample {sample.index} (group {sample.group_index}): toy reward needs a label"
        )
    return toy_score(
        sample.response, str(sample.label), stopped=sample.status == SampleStatus.COMPLETED
    )


_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def _boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (braces balanced), if any."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i]
    return None


def extract_final_answer(text: str) -> str | None:
    """The final answer of a solution: the last \\boxed{}, else after '####' or 'answer is',
    else the last number in the text."""
    boxed = _boxed(text)
    if boxed is not None:
        return boxed
    for marker in ("####", "answer is", "Answer:", "answer:"):
        if marker in text:
            tail = text.rsplit(marker, 1)[1].strip()
            line = tail.splitlines()[0] if tail else ""
            if line:
                return line.rstrip(".")
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def normalize_answer(answer: str) -> str:
    """Canonical form for comparison: drops spacing, $, \\left/\\right, \\text{}, a final '.'."""
    s = str(answer).strip()
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\(?:left|right|!|,|;|:)", "", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("$", "")
    s = re.sub(r"\s+", "", s).rstrip(".")
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)
    return s.lower()


def _as_number(answer: str) -> Fraction | None:
    s = normalize_answer(answer)
    frac = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", s)
    try:
        if frac:
            value = Fraction(int(frac[2]), int(frac[3]))
            return -value if frac[1] else value
        if s.endswith("%"):
            return Fraction(s[:-1]) / 100
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(predicted: str | None, label: Any) -> bool:
    """Equal after normalisation, or equal as numbers (fractions, decimals, thousands commas)."""
    if predicted is None or label is None:
        return False
    if normalize_answer(predicted) == normalize_answer(str(label)):
        return True
    a, b = _as_number(predicted), _as_number(str(label))
    return a is not None and b is not None and a == b


MATH_VERIFY_TIMEOUT_S = 5
"""Seconds math-verify may spend parsing or comparing one answer (its SIGALRM timeout, which
only the main thread can set; elsewhere it runs without one)."""


def _drop_timeout_notice(record: logging.LogRecord) -> bool:
    """math-verify warns on every call made without its timeout (off the main thread)."""
    return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_drop_timeout_notice)


def math_answers_equal(response: str, label: Any, *, own_timeout: bool = True) -> bool:
    """Whether a solution's final answer equals the reference answer, decided by math-verify.

    math-verify extracts the final answer of `response` (the last \\boxed{}, else a LaTeX or
    plain expression) and of the label, and compares them symbolically and numerically
    (`\\frac{1}{2}` equals `0.5`, `1,000` equals `1000`); a label that does not parse as it is
    is read again as inline LaTeX. Where math-verify parses nothing from either side, or finds
    the two unequal, the earlier comparison still decides: `answers_match` on
    `extract_final_answer(response)` (equal normalised text, or equal numbers), so an answer
    such as `\\text{yes}` against `Yes` still counts. A GSM8K-style label keeps only what
    follows its last '####'. `own_timeout`: math-verify's own limit per call,
    `MATH_VERIFY_TIMEOUT_S`, where it can set one (the main thread); False for a caller that
    enforces its own (`MathVerifier`'s child).
    """
    from math_verify import parse, verify

    gold_text = str(label)
    if "####" in gold_text:
        gold_text = gold_text.rsplit("####", 1)[1].strip()
    main = threading.current_thread() is threading.main_thread()
    seconds = MATH_VERIFY_TIMEOUT_S if own_timeout and main else None
    gold = parse(gold_text, parsing_timeout=seconds)
    if not gold and "$" not in gold_text:  # bare LaTeX such as \\frac{\\sqrt{2}}{2}
        gold = parse(f"${gold_text}$", parsing_timeout=seconds)
    predicted = parse(response, parsing_timeout=seconds)
    if gold and predicted and verify(gold, predicted, timeout_seconds=seconds):
        return True
    fallback = _boxed(gold_text) or gold_text
    return answers_match(extract_final_answer(response), fallback)


REWARD_TIMEOUT = "reward_timeout"
"""`Sample.metadata` key set to True when the reward ran out of time and scored 0
(`rollout/reward_timeouts` counts them)."""


def _verifier_main(conn: Any) -> None:
    """The math-verify child: answer (response, label) pairs until the pipe closes. The one
    time limit is the parent's (`reward.math_timeout_s`, by killing this process): math-verify
    runs here without its own, which would otherwise end a long answer first, at its fixed
    5 s, and score it without counting it as timed out."""
    import math_verify  # noqa: F401  (imported before saying ready: the import is slow)

    conn.send("ready")
    while True:
        try:
            response, label = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", math_answers_equal(response, label, own_timeout=False)))
        except Exception as exc:  # sent back and raised in the scoring process
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class MathVerifier:
    """math-verify in a child process, so that one answer can be cut off after a time limit
    from any thread (SIGALRM works only in the main thread, and a thread cannot be stopped):
    the child is killed and a fresh one starts at the next answer. Calls are serialised."""

    START_TIMEOUT_S = 300.0
    """How long the child may take to start and import math-verify (not part of any answer's
    time)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: Any = None
        self._conn: Any = None

    def _start(self) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # no fork of a threaded process
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_verifier_main, args=(child,), daemon=True)
        proc.start()
        child.close()
        if not parent.poll(self.START_TIMEOUT_S) or parent.recv() != "ready":
            proc.kill()
            raise RuntimeError("the math-verify process did not start")
        self._proc, self._conn = proc, parent

    def equal(self, response: str, label: Any, timeout_s: float) -> bool | None:
        """`math_answers_equal(response, label)`, or None when it took more than `timeout_s`."""
        with self._lock:
            if self._proc is None or not self._proc.is_alive():
                self._start()
            self._conn.send((response, label))
            if not self._conn.poll(timeout_s):
                self.close()
                return None
            kind, value = self._conn.recv()
            if kind == "error":
                raise RuntimeError(f"math-verify failed: {value}")
            return bool(value)

    def close(self) -> None:
        """Stop the child (a later call starts a new one)."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.join()
            self._conn.close()
        self._proc = self._conn = None


_verifier = MathVerifier()
_math_timeout_s = RewardConfig().math_timeout_s


def set_math_timeout(seconds: float) -> None:
    """Set the per-answer time limit of the math reward in this process (`Scorer` does)."""
    global _math_timeout_s
    _math_timeout_s = seconds


@register_reward("math")
def math_reward(sample: Sample) -> float:
    """1.0 when the response's final answer equals the label (`math_answers_equal`), else 0.0.

    The comparison runs in a child process (`MathVerifier`) and gets `reward.math_timeout_s`
    seconds; an answer that takes longer scores 0.0 and is marked in
    `sample.metadata[REWARD_TIMEOUT]`.

    Raises:
        ValueError: The sample has no label (naming it): a math reward needs the reference.
    """
    return _verified(sample, sample.response, _reference(sample, "math"))


def _reference(sample: Sample, reward: str) -> Any:
    """The sample's label, which a math reward compares with; a missing or blank one is an
    error naming the sample."""
    label = sample.label
    if label is None or (isinstance(label, str) and not label.strip()):
        raise ValueError(
            f"sample {sample.index} (group {sample.group_index}): the {reward} reward needs "
            f"the reference answer as its label, got {label!r} (data.label_key names the key "
            "of the prompt file that holds it)"
        )
    return label


def _verified(sample: Sample, answer: str, label: Any) -> float:
    """1.0 when math-verify finds `answer` equal to `label`, 0.0 when not or out of time."""
    equal = _verifier.equal(answer, label, _math_timeout_s)
    if equal is None:
        sample.metadata[REWARD_TIMEOUT] = True
        return 0.0
    return 1.0 if equal else 0.0


@register_reward("math_boxed")
def math_boxed_reward(sample: Sample) -> float:
    """As `math`, but only the response's last \\boxed{} counts: a response without one, or
    whose last box is empty, scores 0.0 however right its text is. For prompts that ask for
    the answer in a box, this rewards following the format as well as the arithmetic.

    Raises:
        ValueError: The sample has no label (naming it).
    """
    label = _reference(sample, "math_boxed")
    boxed = _boxed(sample.response)
    if boxed is None or not boxed.strip():
        return 0.0
    return _verified(sample, f"\\boxed{{{boxed}}}", label)
