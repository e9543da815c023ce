"""Reward functions: toy partial credit, math final answers, user code, groups, async."""

from __future__ import annotations

import asyncio
import math
import textwrap

import pytest

from ember_core.types import Sample, SampleStatus
from ember_rollout.config import RewardConfig
from ember_rollout.rewards import (
    Scorer,
    answers_match,
    extract_final_answer,
    register_reward,
    resolve_reward,
)
from ember_rollout.toy_task import toy_score


def sample(response, label=None, index=0, group=0):
    return Sample(
        tokens=[1, 2],
        response_length=1,
        response=response,
        label=label,
        index=index,
        group_index=group,
    )


@pytest.mark.parametrize(
    ("response", "label", "stopped", "score"),
    [
        ("314", "314", True, 1.0),  # 3 digits + the stop, all right
        ("3 1 4", "314", True, 1.0),
        ("314", "314", False, 3 / 4),  # cut at max_response_len: the stop is missing
        ("31", "314", True, 2 / 4),  # stopped one digit early
        ("3145", "314", True, 3 / 5),  # one digit too many
        ("413", "314", True, 2 / 4),  # middle digit and stop right
        ("?14", "314", True, 3 / 4),
        ("", "314", True, 0.0),
        ("copy", "12", True, 0.0),
    ],
)
def test_toy_score_is_fraction_of_correct_positions(response, label, stopped, score):
    assert toy_score(response, label, stopped=stopped) == pytest.approx(score)


def score(name, samples, groups=None, **config):
    groups = groups or [[s] for s in samples]
    asyncio.run(Scorer(RewardConfig(reward_fn=name, **config)).score_groups(groups))
    return [s.reward for g in groups for s in g]


def test_toy_reward_by_name_reads_the_stop_from_the_status():
    done, cut = sample("12", "12"), sample("1", "12")
    done.status, cut.status = SampleStatus.COMPLETED, SampleStatus.TRUNCATED
    assert score("toy", [done, cut]) == [1.0, pytest.approx(1 / 3)]


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        (r"so the result is \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
        (r"\boxed{1} then \boxed{x^{2}+1}", "x^{2}+1"),
        ("Natalia sold 48 clips.\n#### 72", "72"),
        ("The answer is 1,000.", "1,000"),
        ("I computed 3 then 4 and finally 17 apples", "17"),
        ("no digits here", None),
    ],
)
def test_extract_final_answer(text, answer):
    assert extract_final_answer(text) == answer


@pytest.mark.parametrize(
    ("predicted", "label", "match"),
    [
        ("72", 72, True),
        ("1,000", "1000", True),
        (r"\frac{1}{2}", "0.5", True),
        (r"\dfrac{3}{4}", r"\frac{3}{4}", True),
        ("50%", "0.5", True),
        (r"\text{yes}", "Yes", True),
        ("$ 12 $", "12.0", True),
        ("13", "12", False),
        (None, "12", False),
    ],
)
def test_answers_match(predicted, label, match):
    assert answers_match(predicted, label) is match


@pytest.mark.parametrize(
    ("response", "label", "reward"),
    [
        (r"so it is $\frac{1}{2}$", "0.5", 1.0),
        (r"Therefore \boxed{0.5}", r"\frac{1}{2}", 1.0),
        (r"\boxed{\dfrac{3}{6}}", "1/2", 1.0),
        (r"We get $x = 2$, so \boxed{2}", r"$2$", 1.0),
        (r"\boxed{\sqrt{2}/2}", r"\frac{\sqrt{2}}{2}", 1.0),
        ("The answer is 1,000.", "1000", 1.0),
        (r"\boxed{3}", "4", 0.0),
        (r"\boxed{\frac{1}{3}}", "0.33", 0.0),
        ("I give up", "7", 0.0),
        # math-verify parses nothing from this label: the previous comparison decides.
        (r"\boxed{\text{yes}}", "Yes", 1.0),
    ],
)
def test_math_reward_decides_equivalent_and_wrong_answers_with_math_verify(response, label, reward):
    assert score("math", [sample(response, label)]) == [reward]


def test_math_reward_without_a_label_names_the_sample():
    for label in (None, "  "):
        with pytest.raises(ValueError, match=r"sample 0 \(group 0\): the math reward needs"):
            score("math", [sample(r"\boxed{1}", label)])


def test_math_reward_runs_off_the_main_thread_without_its_signal_timeout(caplog):
    import threading

    from ember_rollout.rewards import math_answers_equal

    result = []
    worker = threading.Thread(
        target=lambda: result.append(math_answers_equal("$0.5$", r"\frac{1}{2}"))
    )
    worker.start()
    worker.join()
    assert result == [True]
    assert not [r for r in caplog.records if "Timeout is disabled" in r.getMessage()]


@pytest.mark.parametrize(
    ("response", "label", "reward"),
    [
        ("7 + 5 = 12\n\nThe answer is \\boxed{}.", "12", 0.0),  # right sum, empty box
        ("7 + 5 = 12", "12", 0.0),  # right, but no box at all
        ("7 + 5 = 12, so \\boxed{12}.", "12", 1.0),
        ("\\boxed{11} ... no, \\boxed{12}", "12", 1.0),  # the last box counts
        ("\\boxed{12} ... no, \\boxed{11}", "12", 0.0),
        ("\\boxed{12.0}", "12", 1.0),  # compared by math-verify, not as text
        ("The answer is 12 and \\boxed{13}", "12", 0.0),  # text outside the box is ignored
    ],
)
def test_math_boxed_reward_scores_only_the_last_box(response, label, reward):
    assert score("math_boxed", [sample(response, label)]) == [reward]


def test_math_boxed_reward_without_a_label_names_the_sample():
    with pytest.raises(ValueError, match=r"sample 0 \(group 0\): the math_boxed reward needs"):
        score("math_boxed", [sample(r"\boxed{1}", None)])


def test_math_reward_reads_boxed_labels_and_gsm8k_labels():
    samples = [
        sample(r"... \boxed{42}", r"The result is \boxed{42}"),
        sample("... so 72 in total", "48 + 24 = 72\n#### 72"),
        sample("... 71", "#### 72"),
    ]
    assert score("math", samples) == [1.0, 1.0, 0.0]


def test_unknown_name_lists_registered_rewards():
    with pytest.raises(ValueError, match=r"unknown reward function 'nope'; known: .*math.*toy"):
        resolve_reward("nope")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        resolve_reward("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="has no callable 'missing'"):
        resolve_reward("math:missing")


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent(
            """
            import asyncio
            from ember_rollout.rewards import group_reward

            def length(sample):
                return float(len(sample.response))

            async def slow(sample):
                await asyncio.sleep(0)
                return {"score": 0.25, "why": "async"}

            @group_reward
            def rank(samples):
                order = sorted(range(len(samples)), key=lambda i: samples[i].response)
                return [float(order.index(i)) for i in range(len(samples))]

            def bad(sample):
                return float("nan")

            def wrong_count(samples):
                return [1.0]
            wrong_count.ember_group_reward = True
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards"


def test_module_function_rewards_sync_async_and_group(user_module):
    assert score(f"{user_module}:length", [sample("abc"), sample("")]) == [3.0, 0.0]
    s = sample("x")
    assert score(f"{user_module}:slow", [s]) == [0.25]
    assert s.metadata["reward_info"] == {"why": "async"}
    group = [sample("b", index=0), sample("c", index=1), sample("a", index=2)]
    assert score(f"{user_module}:rank", group, groups=[group]) == [1.0, 2.0, 0.0]


def test_bad_reward_values_name_the_sample_or_group(user_module):
    with pytest.raises(ValueError, match=r"sample 3 \(group 1\): reward .*bad' returned nan"):
        score(f"{user_module}:bad", [sample("x", index=3, group=1)])
    group = [sample("a", group=5), sample("b", group=5)]
    with pytest.raises(ValueError, match="group 5: group reward .* expected 2 scores"):
        score(f"{user_module}:wrong_count", group, groups=[group])


def test_async_rewards_run_concurrently_within_the_limit():
    state = {"now": 0, "peak": 0}

    @register_reward("test_concurrency_probe")
    async def probe(sample):
        state["now"] += 1
        state["peak"] = max(state["peak"], state["now"])
        await asyncio.sleep(0.01)
        state["now"] -= 1
        return 1.0

    rewards = score("test_concurrency_probe", [sample("x") for _ in range(8)], max_concurrency=3)
    assert rewards == [1.0] * 8 and state["peak"] == 3
    assert not math.isnan(rewards[0])


def test_a_math_answer_over_its_time_limit_scores_0_and_is_counted():
    from fractions import Fraction

    from ember_rollout.rewards import REWARD_TIMEOUT
    from ember_rollout.rollout import RolloutGenerator

    # A sum of 40 fractions no earlier test parsed (math-verify caches parses): parsing and
    # comparing it takes milliseconds, far over 0.1 ms.
    terms = "+".join(rf"\frac{{{i}}}{{{i + 1}}}" for i in range(1, 41))
    total = sum(Fraction(i, i + 1) for i in range(1, 41))  # the right answer
    right = sample(rf"\boxed{{{terms}}}", rf"\frac{{{total.numerator}}}{{{total.denominator}}}")
    assert score("math", [right], math_timeout_s=1e-4) == [0.0]
    assert right.metadata[REWARD_TIMEOUT] is True
    # With time to finish, the same answer is right.
    late = sample(right.response, right.label)
    assert score("math", [late], math_timeout_s=60) == [1.0]
    # The overrunning child was killed; the next answer gets a fresh one, and is decided.
    again = sample(r"\boxed{\frac{1}{2}}", "0.5")
    assert score("math", [again], math_timeout_s=60) == [1.0]
    assert REWARD_TIMEOUT not in again.metadata
    counts = {"zero_std": 0, "groups": 1, "aborted": 0}
    metrics = RolloutGenerator._metrics([right, again], counts, [], 0, 0, 1)
    assert metrics["rollout/reward_timeouts"] == 1.0


@pytest.mark.parametrize("bad", [0, -1.0, float("inf")])
def test_the_math_timeout_must_be_positive_and_finite(bad):
    with pytest.raises(ValueError, match=rf"^math_timeout_s={bad!r}: expected a finite number"):
        RewardConfig(math_timeout_s=bad)


def test_the_math_verify_child_leaves_the_time_limit_to_the_parent(monkeypatch):
    """math-verify's own limit is a fixed 5 s; in the child it would end a long answer before a
    longer `reward.math_timeout_s` and score it without counting the timeout. The child's loop
    runs here in the main thread (where math-verify can set its limit) against the real
    math-verify, whose calls record the limits they were given."""
    import math_verify

    from ember_rollout import rewards

    limits = []

    def recording(fn, key):
        def call(*args, **kwargs):
            limits.append(kwargs[key])
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(math_verify, "parse", recording(math_verify.parse, "parsing_timeout"))
    monkeypatch.setattr(math_verify, "verify", recording(math_verify.verify, "timeout_seconds"))

    class Pipe:  # the child's end: one request, then the parent closes it
        def __init__(self):
            self.requests, self.sent = [("\\boxed{\\frac{1}{2}}", "0.5")], []

        def send(self, message):
            self.sent.append(message)

        def recv(self):
            if not self.requests:
                raise EOFError
            return self.requests.pop()

    pipe = Pipe()
    rewards._verifier_main(pipe)
    assert pipe.sent == ["ready", ("ok", True)]
    assert limits and all(limit is None for limit in limits), limits
    # In-process scoring, in the main thread, keeps math-verify's own limit.
    limits.clear()
    assert rewards.math_answers_equal("\\boxed{\\frac{1}{2}}", "0.5")
    assert limits and all(limit == rewards.MATH_VERIFY_TIMEOUT_S for limit in limits), limits
