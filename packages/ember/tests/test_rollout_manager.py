"""The rollout manager over an engine pool, one-step-off-policy mode and weight versions:
group assignment, staleness, threads, the `rollout.async` key, and a real Ray run."""

from __future__ import annotations

import asyncio
import json
import subprocess

import pytest
import yaml
from ember_runs import ember_command

from ember.config import RaySection, load_config
from ember.driver import summary_line
from ember.rollout_manager import assign_groups
from ember.runtimes import actor_threads
from ember.versions import beyond_bound, staleness_metrics
from ember_core.types import Sample
from ember_rollout.rollout import RolloutBatch

# --------------------------------------------------------------------------------------------
# Whole groups, least-loaded engine first
# --------------------------------------------------------------------------------------------


def test_groups_alternate_over_idle_engines_and_stay_whole():
    assert assign_groups([4] * 6, [0, 0]) == [0, 1, 0, 1, 0, 1]
    assert assign_groups([4] * 5, [0, 0, 0]) == [0, 1, 2, 0, 1]


def test_a_busy_engine_gets_groups_only_once_the_others_catch_up():
    # Engine 0 still has 8 requests in flight: the first two groups go to engine 1.
    assert assign_groups([4, 4, 4, 4], [8, 0]) == [1, 1, 0, 1]


def test_uneven_groups_go_to_the_engine_with_the_fewest_requests():
    # After 6 -> e0 and 2 -> e1, e1 (2) takes the next until it passes e0 (6).
    assert assign_groups([6, 2, 2, 2, 2], [0, 0]) == [0, 1, 1, 1, 0]


def test_one_engine_takes_every_group_and_no_engine_is_an_error():
    assert assign_groups([3, 3, 3], [0]) == [0, 0, 0]
    with pytest.raises(ValueError, match="no engines"):
        assign_groups([3], [])


# --------------------------------------------------------------------------------------------
# Weight versions and rollout/staleness
# --------------------------------------------------------------------------------------------


def sample(version: str | None, index: int = 0) -> Sample:
    return Sample(tokens=[1, 2, 3], response_length=1, index=index, weight_version=version)


def test_staleness_is_the_trainer_version_minus_each_samples():
    def mean(samples, trainer):
        return staleness_metrics(samples, trainer, 1)["rollout/staleness"]

    # Rollout 0 from the initial weights (-1) while the trainer holds them too.
    assert mean([sample("-1"), sample("-1")], -1) == 0.0
    # Rollout 5 of an async run: generated from version 3 while the trainer holds 4.
    assert mean([sample("3"), sample("3")], 4) == 1.0
    assert mean([sample("3"), sample("4")], 4) == 0.5


def test_the_staleness_histogram_counts_samples_by_their_oldest_span():
    """Trainer at version 6, bound 2: samples from 6, 5, 4, 4 and one whose response began
    under version 4 and ended under 6 (partial rollout): it counts as 4, its oldest."""
    partial = Sample(
        tokens=[1, 2, 3, 4],
        response_length=3,
        weight_version="4",
        weight_versions=[(0, "4"), (2, "6")],
    )
    samples = [sample("6"), sample("5"), sample("4"), sample("4"), partial]
    metrics = staleness_metrics(samples, 6, 2)
    assert metrics == {
        "rollout/staleness": (0 + 1 + 2 + 2 + 2) / 5,
        "rollout/staleness_max": 2.0,
        "rollout/staleness_0": 1 / 5,
        "rollout/staleness_1": 1 / 5,
        "rollout/staleness_2": 3 / 5,
        "rollout/multi_version_samples": 1 / 5,
    }
    # Rollout 7 is trained by version 6: with a bound of 1 the three from version 4 are
    # beyond it; with 2, none is.
    assert beyond_bound(samples, 7, 1) == 3
    assert beyond_bound(samples, 7, 2) == 0


def test_spans_of_weight_versions_are_checked():
    with pytest.raises(ValueError, match=r"weight_versions=\[\(1, '4'\)\]: expected"):
        Sample(tokens=[1, 2, 3], response_length=2, weight_versions=[(1, "4")])
    with pytest.raises(ValueError, match="ascending from 0"):
        Sample(tokens=[1, 2, 3], response_length=2, weight_versions=[(0, "4"), (2, "5")])
    with pytest.raises(ValueError, match="is not the first span's version"):
        Sample(tokens=[1, 2, 3], response_length=2, weight_version="5", weight_versions=[(0, "4")])
    # A later span from older weights: a mislabelled sample, named with its spans.
    with pytest.raises(ValueError) as info:
        Sample(
            tokens=[1, 2, 3, 4],
            response_length=3,
            index=5,
            group_index=2,
            weight_versions=[(0, "4"), (1, "6"), (2, "5")],
        )
    assert str(info.value) == (
        "sample 5 (group 2): weight_versions=[(0, '4'), (1, '6'), (2, '5')]: expected versions "
        "that never decrease from one span to the next"
    )
    # Numerically, not as strings: "10" follows "9"; a repeated version is allowed.
    Sample(tokens=[1, 2, 3, 4], response_length=3, weight_versions=[(0, "9"), (1, "10"), (2, "10")])


@pytest.mark.parametrize("bad", [None, "default"])
def test_a_sample_without_a_numeric_version_is_named(bad):
    with pytest.raises(ValueError, match=rf"sample 7 \(group 0\): weight_version={bad!r}; every"):
        staleness_metrics([sample("0"), sample(bad, index=7)], 0, 1)


# --------------------------------------------------------------------------------------------
# Threads: actors that compute at the same time share the cores
# --------------------------------------------------------------------------------------------


def test_engines_share_the_cores_and_overlap_shares_them_with_training():
    one = RaySection()
    assert actor_threads(one, overlap=False, cores=8) == (8, 8)
    two = RaySection(num_engines=2)
    assert actor_threads(two, overlap=False, cores=8) == (8, 4)
    assert actor_threads(two, overlap=True, cores=8) == (2, 2)  # 1 rank + 2 engines
    assert actor_threads(one, overlap=True, cores=2) == (1, 1)
    assert actor_threads(RaySection(num_engines=4), overlap=True, cores=2) == (1, 1)
    assert actor_threads(RaySection(threads_per_actor=3), overlap=True, cores=8) == (3, 3)


# --------------------------------------------------------------------------------------------
# The rollout.async key
# --------------------------------------------------------------------------------------------


TRAINER_OLD = "algorithm.use_rollout_log_probs=false"


def test_rollout_async_turns_tis_on_unless_use_tis_is_set():
    # The default run overlaps rollout and training with the engine's log-probs as the old
    # policy's: the ratio is already against the sampling policy, so TIS stays off.
    config, _ = load_config("default")
    assert config.rollout.async_ is True and config.algorithm.use_rollout_log_probs is True
    assert config.algorithm.use_tis is False
    config, _ = load_config("default", overrides=[TRAINER_OLD])
    assert config.rollout.async_ is True and config.algorithm.use_tis is True
    config, _ = load_config("default", overrides=[TRAINER_OLD, "algorithm.use_tis=false"])
    assert config.algorithm.use_tis is False
    config, _ = load_config("default", overrides=["rollout.async=false", TRAINER_OLD])
    assert config.rollout.async_ is False and config.algorithm.use_tis is False
    config, _ = load_config(
        "default", overrides=["rollout.async=false", TRAINER_OLD, "algorithm.use_tis=true"]
    )
    assert config.algorithm.use_tis is True
    # With the engine's log-probs as the old policy, TIS weighs pi_theta / pi_rollout.
    config, _ = load_config("default", overrides=["algorithm.use_tis=true"])
    assert config.algorithm.use_tis is True and config.algorithm.use_rollout_log_probs is True


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["rollout.top_k=1", "rollout.temperature=0.7"],
            "rollout.top_k=1 with engine.kind=sglang and rollout.temperature=0.7: ",
        ),
        (
            ["rollout.temperature=1e-07"],
            "rollout.temperature=1e-07 with engine.kind=sglang: ",
        ),
    ],
)
def test_sglang_settings_that_return_untempered_log_probs_are_refused(overrides, message):
    """sglang 0.5.23 answers greedy requests with log-probs before the temperature (and makes a
    temperature below 1e-6 greedy), while rollout log-probs mean the tempered ones."""
    sglang = ["engine.kind=sglang"]
    with pytest.raises(ValueError) as info:
        load_config("default", overrides=[*sglang, *overrides])
    assert str(info.value).startswith(message) and "\n" not in str(info.value)
    # Greedy at temperature 1 is the same number; the embedded engine reports tempered ones.
    load_config("default", overrides=[*sglang, "rollout.top_k=1", "rollout.temperature=1.0"])
    load_config("default", overrides=overrides)


@pytest.mark.parametrize("filters", [["rollout.top_p=0.9"], ["rollout.top_k=5"]])
def test_engine_old_log_probs_under_a_filter_are_accepted(filters):
    """Every engine reports the unfiltered tempered log-prob the trainer computes, so the engine
    as the old policy measures the same quantity as the trainer's scoring forward."""
    config, _ = load_config("default", overrides=filters)
    assert config.algorithm.use_rollout_log_probs is True


def test_the_run_says_which_loop_and_old_log_probs_it_uses(tmp_path):
    """`ember train` (examples/default.yaml) and a YAML of one's own start from different
    defaults; the line printed at start tells them apart."""
    from ember.config import describe_loop

    config, _ = load_config("default")
    assert describe_loop(config) == (
        "loop: overlapped (rollout.max_staleness=1: rollout i+1 generates from weights one "
        "update old); old log-probs: the engine's (algorithm.use_rollout_log_probs=true); TIS off "
        "(algorithm.use_tis)"
    )
    path = tmp_path / "mine.yaml"
    path.write_text("run:\n  num_rollouts: 3\n")
    config, _ = load_config(path)
    assert describe_loop(config) == (
        "loop: rollout, then training (rollout.max_staleness=0); old log-probs: the trainer's "
        "scoring forward (algorithm.use_rollout_log_probs=false); TIS off (algorithm.use_tis)"
    )
    config, _ = load_config(path, overrides=["rollout.async=true"])
    assert describe_loop(config).endswith("TIS on (algorithm.use_tis)")


def test_the_key_is_async_in_files_and_resolved_configs(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  async: true\n")
    config, _ = load_config(path)
    resolved = config.to_dict()
    assert resolved["rollout"]["async"] is True and "async_" not in resolved["rollout"]
    assert resolved["algorithm"]["use_tis"] is True
    again, _ = load_config(yaml.safe_load(yaml.safe_dump(resolved)))
    assert again.rollout.async_ is True
    with pytest.raises(ValueError, match=r"rollout.async_: unknown key; known keys here: async,"):
        load_config("default", overrides=["rollout.async_=true"])
    with pytest.raises(ValueError, match=r"rollout.async: expected true or false, got 'soon'"):
        load_config("default", overrides=["rollout.async=soon"])


# --------------------------------------------------------------------------------------------
# A real Ray run: two engines, one step off policy
# --------------------------------------------------------------------------------------------

TINY = [
    "--set", "train.model_overrides.num_layers=2",
    "--set", "rollout.rollout_batch_size=4",
    "--set", "rollout.n_samples_per_prompt=2",
    "--set", "rollout.max_response_len=6",
    "--set", "train.num_steps_per_rollout=1",
    "--set", "run.save_interval=0",
    "--set", "run.plot=false",
    "--set", "run.tensorboard=false",
    "--set", "run.dump_rollouts=true",
]  # fmt: skip


def train_tiny(run_dir, *settings: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """`ember train` on the TINY settings plus `settings` (key=value) into `run_dir`: the
    finished command and the run's metrics records. A run that fits one process runs in this
    one, any other on the session's Ray (`ember_runs.ember_command`)."""
    sets = [arg for setting in (*settings, f"run.dir={run_dir}") for arg in ("--set", setting)]
    run = ember_command(["train", *TINY, *sets], timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return run, [json.loads(line) for line in lines]


@pytest.mark.slow
def test_two_engines_one_step_off_policy_on_ray(tmp_path):
    _, records = train_tiny(
        tmp_path, "ray.num_engines=2", "rollout.async=true", TRAINER_OLD, "run.num_rollouts=3"
    )
    rollouts = [r for r in records if r["kind"] == "rollout"]
    assert [r["rollout_id"] for r in rollouts] == [0, 1, 2]
    # Every rollout used both engines; 4 groups of 2 split whole, 2 groups each.
    assert [(r["rollout/engine0_requests"], r["rollout/engine1_requests"]) for r in rollouts] == [
        (4.0, 4.0)
    ] * 3
    # Rollout 0 comes from the initial weights while the trainer holds them; rollout i >= 1
    # was generated during rollout i - 1's training, from the weights of rollout i - 2.
    assert [r["rollout/staleness"] for r in rollouts] == [0.0, 1.0, 1.0]
    for rollout_id in range(3):
        dump = (tmp_path / "rollouts" / f"{rollout_id:06d}.jsonl").read_text().splitlines()
        versions = {json.loads(line)["weight_version"] for line in dump[1:]}  # after the header
        assert versions == {str(max(rollout_id - 2, -1))}
    resolved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert resolved["rollout"]["async"] is True and resolved["algorithm"]["use_tis"] is True
    assert all("perf/iteration_time" in r for r in rollouts)


def test_the_summary_line_shows_the_mismatch_from_the_rollout_or_else_the_first_step():
    steps = [
        {"train/train_rollout_logprob_abs_diff": 3e-9},
        {"train/train_rollout_logprob_abs_diff": 0.2},
    ]
    scored = {"rollout/rewards": 0.5, "rollout/train_rollout_logprob_abs_diff": 1e-3}
    assert summary_line(7, scored, steps) == "rollout    7 | reward 0.500 | mismatch 1.00e-03"
    # Old log-probs from the engine: no rollout-level comparison, the first step's instead.
    engine = {"rollout/rewards": 0.5, "perf/rollout_tokens_per_s": 1234.4}
    line = summary_line(7, engine, steps)
    assert line == "rollout    7 | reward 0.500 | mismatch 3.00e-09 | 1234 tok/s"
    assert summary_line(7, engine, []) == "rollout    7 | reward 0.500 | 1234 tok/s"
    # Samples from older weights (the overlapped default after rollout 0): the stale metric.
    stale = [{"train/stale_rollout_logprob_abs_diff": 2e-3}, {}]
    line = summary_line(7, engine, stale)
    assert line == "rollout    7 | reward 0.500 | mismatch 2.00e-03 | 1234 tok/s"


def test_evaluation_reads_every_eval_key_of_the_run_section():
    from ember.config import RunSection
    from ember.rollout_manager import evaluate_sets

    class Recording:
        def __init__(self):
            self.calls = []

        async def evaluate(self, name, records, **kwargs):
            self.calls.append((name, list(records), kwargs))
            return {f"eval/{name}/reward": 0.5}

    run = RunSection(eval_interval=3, eval_temperature=0.3, eval_samples_per_prompt=4)
    gen = Recording()
    metrics = asyncio.run(evaluate_sets(gen, {"a": [1, 2], "b": [3]}, run, 8))
    assert gen.calls == [
        ("a", [1, 2], dict(rollout_id=8, temperature=0.3, samples_per_prompt=4)),
        ("b", [3], dict(rollout_id=8, temperature=0.3, samples_per_prompt=4)),
    ]
    assert metrics["eval/a/reward"] == 0.5 and metrics["perf/eval_time"] >= 0


@pytest.mark.slow
def test_eval_interval_evaluates_during_and_after_the_run(tmp_path):
    run, records = train_tiny(
        tmp_path,
        "run.num_rollouts=5",
        "run.eval_interval=2",
        "run.eval_prompts=3",
        "run.eval_samples_per_prompt=2",
        "run.plot=true",
    )
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["rollout_id"] for r in evals] == [1, 3, 4]  # every 2nd rollout, and the last
    for record in evals:
        assert record["eval/toy/samples"] == 3 * 2
        assert 0.0 <= record["eval/toy/reward"] <= 1.0 and 0.0 <= record["eval/toy/pass@2"] <= 1.0
    assert "eval       4 | toy/reward" in run.stdout + run.stderr
    assert (tmp_path / "plots" / "reward.png").is_file()


def test_max_staleness_decides_the_loop_and_async_is_its_shorthand(tmp_path):
    """`rollout.async` true/false is max_staleness 1/0; a given max_staleness wins, and the
    resolved config holds both, consistent."""
    from ember.config import describe_loop

    path = tmp_path / "mine.yaml"
    path.write_text("rollout:\n  async: true\n")
    config, _ = load_config(path)
    assert (config.rollout.max_staleness, config.rollout.async_) == (1, True)
    config, _ = load_config(path, overrides=["rollout.max_staleness=0"])
    assert (config.rollout.max_staleness, config.rollout.async_) == (0, False)
    config, _ = load_config(path, overrides=["rollout.async=false", "rollout.max_staleness=3"])
    assert (config.rollout.max_staleness, config.rollout.async_) == (3, True)
    assert describe_loop(config).startswith(
        "loop: 3 rollouts ahead (rollout.max_staleness=3: rollout i+3 generates from weights 3 "
        "updates old);"
    )
    again, _ = load_config(config.to_dict())
    assert (again.rollout.max_staleness, again.rollout.async_) == (3, True)


@pytest.mark.parametrize(
    ("overrides", "start"),
    [
        (["rollout.max_staleness=-1"], "rollout.max_staleness=-1: expected an integer >= 0"),
        (
            ["rollout.max_staleness=0", "rollout.partial_rollouts=true"],
            "rollout.partial_rollouts=True: expected false with max_staleness=0",
        ),
        (
            ["rollout.max_staleness=2", "rollout.partial_rollouts=true", "engine.kind=plugged"],
            "rollout.partial_rollouts=true with engine.kind=plugged: only the hf and sglang "
            "engines take new weights mid-generation",
        ),
    ],
)
def test_bad_staleness_settings_get_one_line_naming_them(overrides, start, monkeypatch):
    from ember_rollout.engine import engine_registry

    # An engine a plugin registers, which takes weights only between requests.
    monkeypatch.setitem(engine_registry()._entries, "plugged", engine_registry().get("hf"))
    with pytest.raises(ValueError) as info:
        load_config("default", overrides=overrides)
    message = str(info.value)
    assert message.startswith(start), message
    assert "\n" not in message


class _Audits:
    """The plugins facade as far as `Driver._start_ahead` asks it: which rollouts are audits."""

    def __init__(self, audited: set[int]) -> None:
        self.audited = audited

    def audit_rollout(self, rollout_id: int) -> bool:
        return rollout_id in self.audited


@pytest.mark.parametrize(
    ("k", "audited", "started"),
    [
        (0, set(), {0: [], 1: [], 2: []}),
        (1, set(), {0: [1], 1: [2], 2: [3]}),
        (3, set(), {0: [1, 2, 3], 1: [4], 2: [5]}),
        # An audit generates in its own iteration from the trainer's weights: nothing starts
        # into it or past it until then.
        (3, {2}, {0: [1], 1: [], 2: [3, 4, 5]}),
        (2, {5}, {0: [1, 2], 1: [3], 2: [4]}),
    ],
)
def test_the_driver_starts_up_to_k_rollouts_ahead_and_none_into_an_audit(
    tmp_path, k, audited, started
):
    from ember.driver import Actors, Driver

    config, _ = load_config(
        "default", overrides=[f"rollout.max_staleness={k}", f"run.dir={tmp_path}"]
    )
    driver = Driver(config, tmp_path, plugins=_Audits(audited))
    calls: list[int] = []

    class Manager:
        class generate:  # noqa: N801 - stands in for a Ray method
            @staticmethod
            def remote(rollout_id: int) -> str:
                calls.append(rollout_id)
                return f"ref {rollout_id}"

    driver.actors = Actors(train=[], engines=[], manager=Manager())
    for rollout_id, expected in started.items():
        driver.loop.start(rollout_id)  # as `take` does, unless started ahead
        driver.loop.pending.pop(rollout_id)
        calls.clear()
        driver.loop.start_ahead(rollout_id)
        assert calls == expected, rollout_id


def _restored(rollout_id: int, version: int) -> RolloutBatch:
    """Rollout `rollout_id` as a checkpoint holds it after generating it ahead: two groups of
    two samples from weight version `version`, each group with its own prompt."""
    samples = [
        Sample(
            tokens=[10 * rollout_id + g, 7, 8, 9],
            response_length=2,
            index=2 * g + j,
            group_index=g,
            prompt=f"prompt {rollout_id}.{g}",
            label=str(g),
            weight_version=str(version),
            metadata={"source": f"toy:{g}", "finish_reason": "stop", "difficulty": g},
        )
        for g in range(2)
        for j in range(2)
    ]
    return RolloutBatch(samples=samples, metrics={"rollout/restored": 1.0})


@pytest.mark.parametrize(
    ("k", "audited", "again"),
    [
        (2, set(), {}),
        # The checker switched on (or audit_interval changed) at resume: rollout 3 would reach
        # its audit with samples older than the trainer's weights, which the backend refuses.
        (2, {3}, {3}),
        # A lower bound at resume: rollout 3 would be 2 versions old, more than 1.
        (1, set(), {3}),
        (1, {2, 3}, {2, 3}),
    ],
)
def test_a_restored_rollout_that_cannot_be_trained_is_generated_again_from_its_prompts(
    tmp_path, k, audited, again
):
    """The checkpoint of rollout 1 in a max_staleness=2 run holds rollouts 2 and 3, both from
    version 0. Resumed, a restored rollout that is audited, or staler than this run's bound,
    is generated again from the current weights with the same prompts (the stream has moved
    past them), its samples counted in `rollout/regenerated`; the others are trained as
    restored."""
    from ember.driver import Actors, Driver
    from ember_rollout.rollout import prompts_of

    config, _ = load_config(
        "default", overrides=[f"rollout.max_staleness={k}", f"run.dir={tmp_path}"]
    )
    driver = Driver(config, tmp_path, plugins=_Audits(audited))
    calls: list[tuple[int, object]] = []

    class Manager:
        class generate:  # noqa: N801 - stands in for a Ray method
            @staticmethod
            def remote(rollout_id: int, prompts=None) -> RolloutBatch:
                calls.append((rollout_id, prompts))
                return _restored(rollout_id, rollout_id - 1)

    driver.actors = Actors(train=[], engines=[], manager=Manager())
    restored = {2: _restored(2, 0), 3: _restored(3, 0)}
    driver.loop.pending.update(restored)
    for rollout_id in (2, 3):
        batch = driver.loop.take(rollout_id)
        if rollout_id in again:
            assert calls == [(rollout_id, prompts_of(restored[rollout_id].samples))]
            assert {s.weight_version for s in batch.samples} == {str(rollout_id - 1)}
            assert driver.loop.regenerated.pop(rollout_id) == 4
        else:
            assert calls == [] and batch is restored[rollout_id]
        calls.clear()
    assert driver.loop.regenerated == {}
