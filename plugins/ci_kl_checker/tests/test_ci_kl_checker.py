"""The CI on-policy checks through the plugin facade, with the plugin registered explicitly."""

from __future__ import annotations

import logging
import math
import pickle

import pytest
import torch

from ember_ci_kl_checker import Check, KLCheckerConfig, KLCheckError
from ember_ci_kl_checker import plugin as checker_plugin
from ember_core.config import AlgorithmConfig, CIConfig, CoreConfig, SamplingConfig, from_dict
from ember_core.hookspecs import ExemptionScope, KLExemption, hookimpl
from ember_core.plugins import EmberPlugins, installed_plugins

LOGGER = "ember_ci_kl_checker.plugin"

ON_POLICY_STEP = {
    "train/loss": 0.31,
    "train/pg_loss": 0.3,
    "train/ppo_kl": 0.0,
    "train/ppo_kl_abs_max": 0.0,
    "train/pg_clipfrac": 0.0,
    "train/kl_loss": 0.0,
    "train/train_rollout_logprob_abs_diff": 0.004,
    "train/grad_norm": 1.7,
}
ON_POLICY_ROLLOUT = {
    "rollout/rewards": 0.5,
    "rollout/log_probs": -1.234567,
    "rollout/ref_log_probs": -1.234567,
    "rollout/log_probs_ref_max_abs_diff": 0.0,
    "rollout/rollout_log_probs": -1.23,
    "rollout/train_rollout_logprob_abs_diff": 0.004,
    "rollout/train_rollout_logprob_max_abs_diff": 0.009,
    "rollout/routing_agreement": 0.98,
    "rollout/versions_behind_max": 0.0,
    "rollout/audit": 1.0,
}
SHIFTED = "rollout/shifted_replay_agreement"
PROBED = {**ON_POLICY_ROLLOUT, SHIFTED: 1.0}
"""An audit under routing replay: its probe forward replayed the shifted experts exactly."""
WITHOUT_ENGINE_LOG_PROBS = {k: v for k, v in ON_POLICY_ROLLOUT.items() if "rollout_log" not in k}
"""A rollout whose samples carry no engine log-probs (a generator that returns none)."""


class Exempting:
    """Stands in for a plugin that changes the actor's forward relative to the reference's."""

    def __init__(
        self, plugin: str, reason: str, scope: ExemptionScope = ExemptionScope.ANY
    ) -> None:
        self.exemption = KLExemption(plugin, reason, scope)

    @hookimpl
    def ember_kl_check_exemptions(self) -> KLExemption:
        return self.exemption


@pytest.fixture
def host():
    """A facade with the checker registered, and a way to add more plugins; all unregistered."""
    plugins = EmberPlugins()
    names: list[str] = []

    def add(obj: object, name: str) -> None:
        plugins.register(obj, name)
        names.append(name)

    plugins.add = add  # type: ignore[attr-defined]
    add(checker_plugin, "ci_kl_checker")
    try:
        yield plugins
    finally:
        for name in names:
            plugins.unregister(name)
        checker_plugin._checker = None


def configure(
    host: EmberPlugins,
    *,
    ci_test: bool = True,
    reference: bool = True,
    engine_old: bool = False,
    one_step_off: bool = False,
    **section,
) -> None:
    """Configure a CI run; `reference`: the config's KL loss asks for a reference model;
    `engine_old`: the old log-probs are the engine's (`algorithm.use_rollout_log_probs`);
    `one_step_off`: rollout and training overlap (`rollout.async`)."""
    config = CoreConfig(
        plugins=host.enabled,
        ci=CIConfig(test=ci_test),
        algorithm=AlgorithmConfig(use_kl_loss=reference, use_rollout_log_probs=engine_old),
        rollout=SamplingConfig(async_=one_step_off),
    )
    host.configure(config, {"ci_kl_checker": KLCheckerConfig(**section)})


def said(caplog) -> list[str]:
    """The checker's log lines, less the audit reports of passed checks."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == LOGGER and " passed: " not in r.getMessage()
    ]


def reports(caplog) -> list[str]:
    """The audit reports of passed checks."""
    return [r.getMessage() for r in caplog.records if " passed: " in r.getMessage()]


AUDITS = (
    "ci_kl_checker: audits at rollout 0 and every 50 rollouts (ci_kl_checker.audit_interval); "
    "the per-token mismatch ceiling is 2 (engine dtype unknown, trainer dtype float32: below "
    "float32, the two round differently)"
)


def test_passes_when_the_first_update_is_exactly_on_policy(host, caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    configure(host)
    assert said(caplog) == []  # said at the first check, by the process that checks
    host.after_log_rollout_data(0, ON_POLICY_ROLLOUT)
    host.after_train_step(0, 0, 0, ON_POLICY_STEP)
    host.after_log_rollout_data(1, without(ON_POLICY_ROLLOUT, "rollout/audit"))
    host.after_train_step(1, 0, 4, ON_POLICY_STEP)
    assert said(caplog) == [AUDITS]
    # Rollout 0 is an audit: every check that ran says what it measured, once.
    prefix = "ci_kl_checker: audit rollout 0"
    assert reports(caplog) == [
        f"{prefix} (log_rollout_data): first_rollout_ref_log_probs passed: "
        "|rollout/log_probs_ref_max_abs_diff| = 0.000e+00, expected < 1e-08",
        f"{prefix} (log_rollout_data): train_rollout_mismatch_max passed: "
        "rollout/train_rollout_logprob_max_abs_diff = 9.000e-03, expected <= 2 "
        "(ci_kl_checker.train_rollout_logprob_max_abs_diff_threshold)",
        f"{prefix} (log_rollout_data): train_rollout_mismatch_ceiling passed: "
        "rollout/train_rollout_logprob_abs_diff = 4.000e-03, expected <= 0.1 "
        "(ci_kl_checker.train_rollout_logprob_abs_diff_threshold)",
        f"{prefix}, step 0 (accumulated step 0): first_step_ppo_kl passed: "
        "|train/ppo_kl| = 0.000e+00, expected < 1e-08",
        f"{prefix}, step 0 (accumulated step 0): first_step_ppo_kl_max passed: "
        "|train/ppo_kl_abs_max| = 0.000e+00, expected < 1e-08",
        f"{prefix}, step 0 (accumulated step 0): first_step_kl_loss passed: "
        "|train/kl_loss| = 0.000e+00, expected < 1e-08",
        f"{prefix}, step 0 (accumulated step 0): train_rollout_mismatch_ceiling passed: "
        "train/train_rollout_logprob_abs_diff = 4.000e-03, expected <= 0.1 "
        "(ci_kl_checker.train_rollout_logprob_abs_diff_threshold)",
    ]


def test_an_audit_the_run_did_not_carry_out_fails(host):
    configure(host, audit_interval=3)
    host.after_log_rollout_data(0, ON_POLICY_ROLLOUT)
    host.after_log_rollout_data(2, without(ON_POLICY_ROLLOUT, "rollout/audit"))
    with pytest.raises(KLCheckError) as info:
        host.after_log_rollout_data(3, without(ON_POLICY_ROLLOUT, "rollout/audit"))
    assert info.value.check == Check.AUDIT
    assert info.value.detail == (
        "rollout/audit is not logged; it must be: the checker asked for an audit iteration at "
        "rollout 3 (rollout 0 and every 3: ci_kl_checker.audit_interval)"
    )
    assert [host.audit_rollout(i) for i in range(7)] == [True, False, False, True] + [
        False,
        False,
        True,
    ]


@pytest.mark.parametrize(("ci_test", "disable"), [(False, False), (True, True)])
def test_no_audit_is_asked_for_when_the_checker_is_off(host, ci_test, disable):
    configure(host, ci_test=ci_test, disable=disable)
    assert not any(host.audit_rollout(i) for i in range(101))


MISMATCH_MAX = "rollout/train_rollout_logprob_max_abs_diff"
SGLANG_FP32 = {"kind": "sglang", "sglang": {"dtype": "float32"}}
ATTACHED_FP32 = {"kind": "sglang", "sglang": {"dtype": "float32", "urls": ["http://h:1"]}}


@pytest.mark.parametrize(
    ("engine", "trainer", "ceiling"),
    [
        ({"kind": "hf", "hf": {"dtype": "float32"}}, "float32", 5e-4),
        ({"kind": "hf", "hf": {"dtype": "bfloat16"}}, "float32", 2.0),
        ({"kind": "sglang"}, "float32", 2.0),  # SGLang's auto: its own rule picks the dtype
        (SGLANG_FP32, "float32", 5e-4),  # launched servers in the trainer's dtype
        (SGLANG_FP32, "bfloat16", 2.0),
        (ATTACHED_FP32, "float32", 2.0),  # an attached server runs as it was started
    ],
)
def test_the_per_token_ceiling_fits_the_dtypes(host, engine, trainer, ceiling):
    config = {
        "ci": {"test": True},
        "train": {"dtype": trainer},
        "engine": engine,
        "plugins": host.enabled,
    }
    host.configure(config, {"ci_kl_checker": KLCheckerConfig()})
    at = {**ON_POLICY_ROLLOUT, "rollout/train_rollout_logprob_max_abs_diff": ceiling}
    host.after_log_rollout_data(0, at)  # inclusive
    # One token 2^-10 off: over the float32 ceiling, within slime's.
    off = {**at, "rollout/train_rollout_logprob_max_abs_diff": 2.0**-10}
    if ceiling < 2.0**-10:
        with pytest.raises(KLCheckError) as info:
            host.after_log_rollout_data(0, off)
        assert info.value.check == Check.TRAIN_ROLLOUT_MISMATCH_MAX
    else:
        host.after_log_rollout_data(0, off)
    # The section's value wins over the dtypes.
    host.configure(
        config,
        {"ci_kl_checker": KLCheckerConfig(train_rollout_logprob_max_abs_diff_threshold=1e-3)},
    )
    host.after_log_rollout_data(0, off)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_under_true_on_policy_any_per_token_difference_fails_an_audit(host, dtype):
    config = {
        "ci": {"test": True},
        "train": {"dtype": dtype},
        "engine": {"kind": "hf", "hf": {"dtype": dtype}},
        "rollout": {"true_on_policy": True},
        "plugins": host.enabled,
    }
    host.configure(config, {"ci_kl_checker": KLCheckerConfig()})
    host.after_log_rollout_data(0, {**ON_POLICY_ROLLOUT, MISMATCH_MAX: 0.0})
    smallest = {**ON_POLICY_ROLLOUT, MISMATCH_MAX: float(torch.finfo(torch.float32).tiny)}
    with pytest.raises(KLCheckError) as info:
        host.after_log_rollout_data(0, smallest)
    assert info.value.check == Check.TRAIN_ROLLOUT_MISMATCH_MAX
    ceiling, why = checker_plugin.max_ceiling(config, KLCheckerConfig())
    assert ceiling == 0.0 and why.startswith("rollout.true_on_policy")


@pytest.mark.parametrize("value", [1e-8, 3e-7, -2e-5, math.nan])
def test_first_step_ppo_kl_fails_with_the_metric_dict(host, value):
    configure(host)
    metrics = {**ON_POLICY_STEP, "train/ppo_kl": value}
    with pytest.raises(KLCheckError) as info:
        host.after_train_step(2, 0, 8, metrics)
    error = info.value
    assert error.check == Check.PPO_KL
    assert error.step == "rollout 2, step 0 (accumulated step 8)"
    assert error.metrics == metrics
    assert "first_step_ppo_kl failed at rollout 2, step 0 (accumulated step 8)" in str(error)
    assert repr(metrics) in str(error)
    assert isinstance(error, AssertionError)


def test_ppo_kl_is_checked_without_pg_clipfrac(host):
    configure(host)
    metrics = {**ON_POLICY_STEP, "train/ppo_kl": 0.01}
    del metrics["train/pg_clipfrac"]
    with pytest.raises(KLCheckError, match=r"\|train/ppo_kl\| = 1\.000e-02"):
        host.after_train_step(0, 0, 0, metrics)


def test_a_per_token_gap_fails_where_the_signed_mean_cancels(host):
    """Old and training log-probs of one sample permuted: the mean of their differences is 0,
    the largest per-token difference is not."""
    configure(host)
    host.after_log_rollout_data(0, ON_POLICY_ROLLOUT)
    step = {**ON_POLICY_STEP, "train/ppo_kl": 0.0, "train/ppo_kl_abs_max": 0.25}
    with pytest.raises(KLCheckError) as info:
        host.after_train_step(0, 0, 0, step)
    assert info.value.check == Check.PPO_KL_MAX
    assert "|train/ppo_kl_abs_max| = 2.500e-01, expected < 1e-08" in str(info.value)
    with pytest.raises(KLCheckError, match=r"train/ppo_kl_abs_max is not logged"):
        host.after_train_step(0, 0, 0, without(ON_POLICY_STEP, "train/ppo_kl_abs_max"))


def test_first_step_kl_loss_fails_with_the_metric_dict(host):
    configure(host)
    metrics = {**ON_POLICY_STEP, "train/kl_loss": 4e-8}
    with pytest.raises(
        KLCheckError, match=r"\|train/kl_loss\| = 4\.000e-08, expected < 1e-08"
    ) as info:
        host.after_train_step(0, 0, 0, metrics)
    assert info.value.check == Check.KL_LOSS
    assert info.value.metrics == metrics


def test_first_rollout_compares_actor_and_reference_per_token(host):
    configure(host)
    # +d on one token and -d on another: the means agree exactly, so comparing
    # rollout/log_probs with rollout/ref_log_probs (the old check) passes; the maximum does not.
    metrics = {**ON_POLICY_ROLLOUT, "rollout/log_probs_ref_max_abs_diff": 2e-3}
    assert metrics["rollout/log_probs"] == metrics["rollout/ref_log_probs"]
    with pytest.raises(KLCheckError) as info:
        host.after_log_rollout_data(0, metrics)
    assert info.value.check == Check.ROLLOUT_REF_LOG_PROBS
    assert info.value.step == "rollout 0 (log_rollout_data)"
    assert info.value.metrics == metrics
    assert "|rollout/log_probs_ref_max_abs_diff| = 2.000e-03, expected < 1e-08" in str(info.value)


def test_later_steps_and_rollouts_are_not_checked_on_policy(host):
    configure(host)
    drifted_step = {**ON_POLICY_STEP, "train/ppo_kl": 0.02, "train/kl_loss": 0.03}
    drifted_rollout = {**ON_POLICY_ROLLOUT, "rollout/log_probs_ref_max_abs_diff": 0.9}
    host.after_train_step(0, 1, 1, drifted_step)  # not the first step of the rollout
    host.after_train_step(5, 3, 23, drifted_step)
    host.after_log_rollout_data(1, drifted_rollout)
    host.after_log_rollout_data(7, drifted_rollout)
    # The first step of a later rollout is on-policy again for ppo_kl, but not for kl_loss.
    host.after_train_step(1, 0, 2, {**ON_POLICY_STEP, "train/kl_loss": 0.03})
    with pytest.raises(KLCheckError, match="first_step_ppo_kl"):
        host.after_train_step(1, 0, 2, drifted_step)


def without(metrics: dict, *keys: str) -> dict:
    return {k: v for k, v in metrics.items() if k not in keys}


MISSING = {
    "ppo_kl": (
        "step",
        without(ON_POLICY_STEP, "train/ppo_kl"),
        Check.PPO_KL,
        "train/ppo_kl is not logged; it must be: every actor update logs it",
    ),
    "kl_loss": (
        "step",
        without(ON_POLICY_STEP, "train/kl_loss"),
        Check.KL_LOSS,
        "train/kl_loss is not logged; it must be: the config uses a reference model "
        "(algorithm.use_kl_loss=true)",
    ),
    "ref max": (
        "rollout",
        without(ON_POLICY_ROLLOUT, "rollout/log_probs_ref_max_abs_diff"),
        Check.ROLLOUT_REF_LOG_PROBS,
        "rollout/log_probs_ref_max_abs_diff is not logged; it must be: the config uses a "
        "reference model (algorithm.use_kl_loss=true)",
    ),
    "rollout mismatch": (
        "rollout",
        without(ON_POLICY_ROLLOUT, "rollout/train_rollout_logprob_abs_diff"),
        Check.TRAIN_ROLLOUT_MISMATCH,
        "rollout/train_rollout_logprob_abs_diff is not logged; it must be: rollout 0 carries "
        "the engine's log-probs (rollout/rollout_log_probs)",
    ),
    "train mismatch": (
        "step",
        without(ON_POLICY_STEP, "train/train_rollout_logprob_abs_diff"),
        Check.TRAIN_ROLLOUT_MISMATCH,
        "train/train_rollout_logprob_abs_diff is not logged; it must be: rollout 0 carries "
        "the engine's log-probs (rollout/rollout_log_probs)",
    ),
}


@pytest.mark.parametrize("case", list(MISSING))
def test_a_check_that_applies_fails_naming_its_missing_metric(host, case):
    hook, metrics, check, detail = MISSING[case]
    configure(host)
    with pytest.raises(KLCheckError) as info:
        host.after_log_rollout_data(0, metrics if hook == "rollout" else ON_POLICY_ROLLOUT)
        host.after_train_step(0, 0, 0, metrics)
    assert info.value.check == check
    assert info.value.detail == detail
    assert info.value.metrics == metrics


def test_a_later_rollout_with_engine_log_probs_needs_the_train_mismatch_too(host):
    configure(host)
    host.after_log_rollout_data(0, ON_POLICY_ROLLOUT)
    host.after_train_step(0, 0, 0, ON_POLICY_STEP)
    host.after_log_rollout_data(1, WITHOUT_ENGINE_LOG_PROBS)
    host.after_train_step(1, 1, 5, without(ON_POLICY_STEP, "train/train_rollout_logprob_abs_diff"))
    host.after_log_rollout_data(2, ON_POLICY_ROLLOUT)
    with pytest.raises(KLCheckError, match="rollout 2 carries the engine's log-probs"):
        host.after_train_step(
            2, 1, 9, without(ON_POLICY_STEP, "train/train_rollout_logprob_abs_diff")
        )


def test_engine_old_log_probs_audit_exactly_and_stand_down_between_audits(host, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    configure(host, engine_old=True, audit_interval=2)
    # Rollout 0 is an audit: the trainer scored it, and every check is exact.
    host.after_log_rollout_data(0, ON_POLICY_ROLLOUT)
    with pytest.raises(KLCheckError) as info:
        host.after_train_step(0, 0, 0, {**ON_POLICY_STEP, "train/ppo_kl": 3e-8})
    assert info.value.check == Check.PPO_KL
    with pytest.raises(KLCheckError) as info:
        host.after_log_rollout_data(
            0, without(ON_POLICY_ROLLOUT, "rollout/log_probs_ref_max_abs_diff")
        )
    assert info.value.check == Check.ROLLOUT_REF_LOG_PROBS
    # Rollout 1 is not: no trainer log-probs before training, the engine's alone.
    rollout = without(
        ON_POLICY_ROLLOUT,
        "rollout/audit",
        "rollout/log_probs",
        "rollout/log_probs_ref_max_abs_diff",
        "rollout/train_rollout_logprob_abs_diff",
        "rollout/train_rollout_logprob_max_abs_diff",
    )
    host.after_log_rollout_data(1, rollout)
    first = {**ON_POLICY_STEP, "train/ppo_kl": 3e-4}  # the mismatch, signed
    host.after_train_step(1, 0, 4, first)
    # Later steps compare weights the step already moved with the engine's: not a mismatch.
    moved = {**first, "train/train_rollout_logprob_abs_diff": 0.4}
    host.after_train_step(1, 1, 5, moved)
    with pytest.raises(KLCheckError) as info:
        host.after_train_step(1, 0, 4, moved)
    assert info.value.check == Check.TRAIN_ROLLOUT_MISMATCH
    # Rollout 2 is an audit again: its missing trainer metrics fail.
    with pytest.raises(KLCheckError) as info:
        host.after_log_rollout_data(2, {**rollout, "rollout/audit": 1.0})
    assert info.value.check == Check.TRAIN_ROLLOUT_MISMATCH_MAX
    with pytest.raises(KLCheckError) as info:
        host.after_train_step(2, 0, 8, first)
    assert info.value.check == Check.PPO_KL
    (between,) = [m for m in said(caplog) if "between audits" in m]
    assert between == (
        "ci_kl_checker: between audits, first_step_ppo_kl, first_step_ppo_kl_max and "
        "train_rollout_mismatch_max stand down: algorithm.use_rollout_log_probs=true takes the "
        "old log-probs from the engine, so the trainer computes none to compare; "
        "train_rollout_mismatch_ceiling is checked at each rollout's first step only (later "
        "steps compare the rollout's own updates with the engine's log-probs)"
    )


@pytest.mark.parametrize("as_mapping", [False, True])
def test_one_step_off_runs_bound_the_mismatch_at_audits_only(host, caplog, as_mapping):
    caplog.set_level(logging.INFO, logger=LOGGER)
    if as_mapping:
        config = {"ci": {"test": True}, "rollout": {"async": True}, "plugins": host.enabled}
        host.configure(config, {"ci_kl_checker": KLCheckerConfig(audit_interval=4)})
    else:
        configure(host, reference=False, one_step_off=True, audit_interval=4)
    lagging = {**ON_POLICY_STEP, "train/train_rollout_logprob_abs_diff": 0.3}
    lagging_rollout = {**ON_POLICY_ROLLOUT, "rollout/train_rollout_logprob_abs_diff": 0.3}
    # Between audits the engine's weights are one update behind the trainer's.
    host.after_log_rollout_data(1, without(lagging_rollout, "rollout/audit"))
    host.after_train_step(1, 0, 4, lagging)
    assert any("rollout.async=true samples each rollout" in m for m in said(caplog))
    for rollout_id in (0, 4):
        with pytest.raises(KLCheckError) as info:
            host.after_train_step(rollout_id, 0, 4 * rollout_id, lagging)
        assert info.value.check == Check.TRAIN_ROLLOUT_MISMATCH
        with pytest.raises(KLCheckError) as info:
            host.after_log_rollout_data(rollout_id, lagging_rollout)
        assert info.value.check == Check.TRAIN_ROLLOUT_MISMATCH
    with pytest.raises(KLCheckError) as info:
        host.after_train_step(1, 0, 4, {**lagging, "train/ppo_kl": 1e-3})  # still exact
    assert info.value.check == Check.PPO_KL


def test_replay_agreement_must_be_exactly_one_under_a_routing_exemption(host):
    host.add(Exempting("r", "routes as the rollout did", ExemptionScope.ROUTING), "r")
    configure(host, reference=False)
    replayed = {**ON_POLICY_STEP, "train/replay_agreement": 1.0}
    host.after_train_step(0, 0, 0, replayed)
    host.after_train_step(3, 2, 14, replayed)  # every step of every rollout
    for value in (1.0 - 2.0**-20, math.nan):
        with pytest.raises(KLCheckError) as info:
            host.after_train_step(3, 2, 14, {**replayed, "train/replay_agreement": value})
        assert info.value.check == Check.REPLAY_AGREEMENT
        assert "expected exactly 1.0" in info.value.detail
    with pytest.raises(KLCheckError) as info:
        host.after_train_step(3, 2, 14, ON_POLICY_STEP)
    assert info.value.detail.startswith("train/replay_agreement is not logged; it must be: a ")


def test_checks_the_config_rules_out_are_said_once_and_need_no_metric(host, caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    configure(host, reference=False)
    no_ref_step = without(ON_POLICY_STEP, "train/kl_loss")
    no_ref_rollout = without(ON_POLICY_ROLLOUT, "rollout/log_probs_ref_max_abs_diff")
    host.after_log_rollout_data(0, without(no_ref_rollout, "rollout/ref_log_probs"))
    host.after_train_step(0, 0, 0, no_ref_step)
    # No engine log-probs in the rollout: the mismatch metrics are not needed either.
    host.after_log_rollout_data(1, without(WITHOUT_ENGINE_LOG_PROBS, "rollout/ref_log_probs"))
    host.after_train_step(1, 0, 1, without(no_ref_step, "train/train_rollout_logprob_abs_diff"))
    assert said(caplog) == [
        AUDITS,
        "ci_kl_checker: first_step_kl_loss and first_rollout_ref_log_probs do not apply: the "
        "config uses no reference model (algorithm.use_kl_loss=false, algorithm.kl_coef=0, "
        "no train.ref_load); they run only if their metrics are logged anyway",
    ]
    # A metric that is logged anyway is checked.
    with pytest.raises(KLCheckError, match="first_step_kl_loss"):
        host.after_train_step(0, 0, 0, {**ON_POLICY_STEP, "train/kl_loss": 0.5})
    with pytest.raises(KLCheckError, match="first_rollout_ref_log_probs"):
        host.after_log_rollout_data(
            0, {**ON_POLICY_ROLLOUT, "rollout/log_probs_ref_max_abs_diff": 0.5}
        )


@pytest.mark.parametrize(
    ("config", "reasons"),
    [
        ({}, []),
        ({"algorithm": {"use_kl_loss": True}}, ["algorithm.use_kl_loss=true"]),
        ({"algorithm": {"kl_coef": 0.05}}, ["algorithm.kl_coef=0.05"]),
        ({"algorithm": {"kl_coef": 0.0}, "train": {"ref_load": None}}, []),
        ({"train": {"ref_load": "/ckpt/ref"}}, ["train.ref_load='/ckpt/ref'"]),
        (CoreConfig(algorithm=AlgorithmConfig(use_kl_loss=True)), ["algorithm.use_kl_loss=true"]),
    ],
)
def test_the_reference_rule_is_read_from_the_run_config(config, reasons):
    assert checker_plugin.reference_reasons(config) == reasons


@pytest.mark.parametrize("rollout_id", [0, 3])
def test_a_mismatch_over_the_ceiling_fails_at_every_rollout_and_step(host, rollout_id):
    configure(host)
    over = {**ON_POLICY_ROLLOUT, "rollout/train_rollout_logprob_abs_diff": 0.13}
    with pytest.raises(KLCheckError) as info:
        host.after_log_rollout_data(rollout_id, over)
    assert info.value.check == Check.TRAIN_ROLLOUT_MISMATCH
    assert info.value.detail == (
        "rollout/train_rollout_logprob_abs_diff = 1.300e-01, expected <= 0.1 "
        "(ci_kl_checker.train_rollout_logprob_abs_diff_threshold)"
    )
    step = {**ON_POLICY_STEP, "train/train_rollout_logprob_abs_diff": 0.13}
    with pytest.raises(KLCheckError, match=r"train/train_rollout_logprob_abs_diff = 1\.300e-01"):
        host.after_train_step(rollout_id, 2, 4 * rollout_id + 2, step)


def test_the_ceiling_is_configurable_inclusive_and_fails_nan(host):
    configure(host, train_rollout_logprob_abs_diff_threshold=0.25)
    at = {**ON_POLICY_ROLLOUT, "rollout/train_rollout_logprob_abs_diff": 0.25}
    host.after_log_rollout_data(0, at)  # slime's rule: value <= ceiling passes
    host.after_train_step(0, 1, 1, {**ON_POLICY_STEP, "train/train_rollout_logprob_abs_diff": 0.25})
    with pytest.raises(KLCheckError, match=r"= 2\.501e-01, expected <= 0\.25"):
        host.after_log_rollout_data(0, {**at, "rollout/train_rollout_logprob_abs_diff": 0.2501})
    with pytest.raises(KLCheckError, match=r"= nan, expected <= 0\.25"):
        host.after_train_step(
            0, 1, 1, {**ON_POLICY_STEP, "train/train_rollout_logprob_abs_diff": math.nan}
        )


def test_exemptions_stand_the_actor_ref_checks_down_with_one_log_line(host, caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    host.add(Exempting("replayer", "the actor replays recorded decisions"), "replayer")
    host.add(Exempting("adapter", "only the actor carries the adapter"), "adapter")
    configure(host)
    host.after_log_rollout_data(0, {**ON_POLICY_ROLLOUT, "rollout/log_probs_ref_max_abs_diff": 0.3})
    host.after_train_step(0, 0, 0, {**ON_POLICY_STEP, "train/kl_loss": 0.002})
    host.after_train_step(1, 0, 1, {**ON_POLICY_STEP, "train/kl_loss": 0.002})
    # An exempted check needs no metric.
    host.after_log_rollout_data(0, without(ON_POLICY_ROLLOUT, "rollout/log_probs_ref_max_abs_diff"))
    host.after_train_step(0, 0, 0, without(ON_POLICY_STEP, "train/kl_loss"))
    assert len(said(caplog)) == 2 and said(caplog)[0] == AUDITS
    line = said(caplog)[1]
    assert "replayer: the actor replays recorded decisions" in line
    assert "adapter: only the actor carries the adapter" in line
    assert "first_step_kl_loss" in line and "first_rollout_ref_log_probs" in line
    # ppo_kl compares the actor with itself, so no exemption covers it; nor the mismatch.
    with pytest.raises(KLCheckError, match="first_step_ppo_kl"):
        host.after_train_step(0, 0, 0, {**ON_POLICY_STEP, "train/ppo_kl": 0.002})
    with pytest.raises(KLCheckError, match="train_rollout_mismatch_ceiling"):
        host.after_train_step(
            0, 1, 1, {**ON_POLICY_STEP, "train/train_rollout_logprob_abs_diff": 1}
        )
    assert len(said(caplog)) == 2


REPLAYED = "rollout/ref_replayed_log_probs_max_abs_diff"


@pytest.mark.parametrize(
    ("scopes", "reference", "asks"),
    [
        ([ExemptionScope.ROUTING], True, True),
        ([ExemptionScope.ROUTING, ExemptionScope.ROUTING], True, True),
        ([ExemptionScope.ROUTING, ExemptionScope.ANY], True, False),
        ([ExemptionScope.ANY], True, False),
        ([], True, False),
        ([ExemptionScope.ROUTING], False, False),
    ],
    ids=["routing", "two_routing", "routing_and_any", "any", "none", "no_reference"],
)
def test_a_routing_only_exemption_asks_for_the_replayed_reference_at_rollout_0(
    host, scopes, reference, asks
):
    for k, scope in enumerate(scopes):
        host.add(Exempting(f"p{k}", "routes differently", scope), f"p{k}")
    configure(host, reference=reference)
    assert host.replayed_reference_forward(0) is asks
    assert host.replayed_reference_forward(1) is False
    rollout = {**PROBED, "rollout/log_probs_ref_max_abs_diff": 0.3}
    if asks:
        with pytest.raises(KLCheckError, match=f"{REPLAYED} is not logged") as info:
            host.after_log_rollout_data(0, rollout)
        assert info.value.check == Check.ROLLOUT_REF_REPLAYED_LOG_PROBS
        with pytest.raises(KLCheckError) as info:
            host.after_log_rollout_data(0, {**rollout, REPLAYED: 2e-8})
        assert info.value.detail == f"|{REPLAYED}| = 2.000e-08, expected < 1e-08"
        host.after_log_rollout_data(0, {**rollout, REPLAYED: 0.0})
    elif scopes:
        host.after_log_rollout_data(0, rollout)  # exempted, and nothing replaces the check
    # A later rollout never needs it; a logged one is still checked at rollout 0.
    host.after_log_rollout_data(1, rollout)
    with pytest.raises(KLCheckError, match=Check.ROLLOUT_REF_REPLAYED_LOG_PROBS):
        host.after_log_rollout_data(0, {**ON_POLICY_ROLLOUT, REPLAYED: float("nan")})


@pytest.mark.parametrize("switch", ["disable", "not_ci"])
def test_no_replayed_reference_is_asked_for_when_the_checker_is_off(host, switch):
    host.add(Exempting("r", "routes differently", ExemptionScope.ROUTING), "r")
    if switch == "disable":
        configure(host, disable=True)
    else:
        configure(host, ci_test=False)
    assert host.replayed_reference_forward(0) is False
    host.after_log_rollout_data(0, {**ON_POLICY_ROLLOUT, REPLAYED: 5.0})


def test_plugins_that_report_no_exemption_change_nothing(host):
    class Quiet:
        @hookimpl
        def ember_kl_check_exemptions(self):
            return None

    host.add(Quiet(), "quiet")
    configure(host)
    with pytest.raises(KLCheckError, match="first_step_kl_loss"):
        host.after_train_step(0, 0, 0, {**ON_POLICY_STEP, "train/kl_loss": 0.5})


def test_disable_turns_every_check_off_with_one_warning(host, caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    host.add(Exempting("replayer", "replays"), "replayer")
    configure(host, disable=True)
    drifted_step = {
        **ON_POLICY_STEP,
        "train/ppo_kl": 0.1,
        "train/kl_loss": 0.1,
        "train/train_rollout_logprob_abs_diff": 3.0,
    }
    host.after_train_step(0, 0, 0, drifted_step)
    host.after_train_step(0, 0, 0, {"train/loss": 1.0})  # nothing is required either
    host.after_log_rollout_data(0, {**ON_POLICY_ROLLOUT, "rollout/log_probs_ref_max_abs_diff": 1.0})
    host.after_log_rollout_data(0, {"rollout/rollout_log_probs": -1.0})
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (
            logging.WARNING,
            "ci_kl_checker: disabled by ci_kl_checker.disable=true; none of its checks runs",
        )
    ]


def test_nothing_is_checked_outside_ci_mode(host, caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    asked = []

    class Counting:
        @hookimpl
        def ember_kl_check_exemptions(self):
            asked.append(1)

    host.add(Counting(), "counting")
    configure(host, ci_test=False)
    host.after_train_step(0, 0, 0, {**ON_POLICY_STEP, "train/ppo_kl": 1.0, "train/kl_loss": 1.0})
    host.after_train_step(0, 0, 0, {"train/loss": 1.0})
    host.after_log_rollout_data(0, {**ON_POLICY_ROLLOUT, "rollout/log_probs_ref_max_abs_diff": 1})
    host.after_log_rollout_data(0, {"rollout/rollout_log_probs": -1.0})
    assert caplog.records == [] and asked == []


def test_ci_switch_is_read_from_mappings_too(host):
    host.configure({"ci": {"test": True}}, {})
    with pytest.raises(KLCheckError):
        host.after_train_step(0, 0, 0, {**ON_POLICY_STEP, "train/ppo_kl": 1.0})
    host.configure({"rollout": {}}, {})  # no `ci` section: CI mode is off
    host.after_train_step(0, 0, 0, {**ON_POLICY_STEP, "train/ppo_kl": 1.0})
    with pytest.raises(ValueError, match=r"ci\.test='yes': expected true or false"):
        host.configure({"ci": {"test": "yes"}}, {})


def test_a_check_before_configure_is_an_error(host):
    with pytest.raises(RuntimeError, match="before ember_configure"):
        host.after_train_step(0, 0, 0, ON_POLICY_STEP)


def test_config_section_parses_and_validates():
    assert sections_of_checker() == {"ci_kl_checker": KLCheckerConfig}
    assert from_dict(KLCheckerConfig, {"disable": "true"}, prefix="ci_kl_checker").disable
    assert from_dict(KLCheckerConfig, {}).disable is False
    with pytest.raises(ValueError, match=r"ci_kl_checker\.disable: expected true or false"):
        from_dict(KLCheckerConfig, {"disable": "maybe"}, prefix="ci_kl_checker")
    with pytest.raises(ValueError, match=r"disable='yes': expected true or false"):
        KLCheckerConfig(disable="yes")  # type: ignore[arg-type]
    ceiling = "train_rollout_logprob_abs_diff_threshold"
    assert KLCheckerConfig().train_rollout_logprob_abs_diff_threshold == 0.1
    assert (
        from_dict(KLCheckerConfig, {ceiling: "1e-3"}).train_rollout_logprob_abs_diff_threshold
        == 1e-3
    )
    assert from_dict(KLCheckerConfig, {ceiling: 0}).train_rollout_logprob_abs_diff_threshold == 0.0
    for bad in (-0.1, math.inf, math.nan):
        with pytest.raises(
            ValueError, match=rf"ci_kl_checker\.{ceiling}={bad!r}: expected a finite number >= 0"
        ):
            from_dict(KLCheckerConfig, {ceiling: bad}, prefix="ci_kl_checker")
    with pytest.raises(ValueError, match=rf"{ceiling}=True: expected a finite number >= 0"):
        KLCheckerConfig(train_rollout_logprob_abs_diff_threshold=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=rf"ci_kl_checker\.{ceiling}: expected a number"):
        from_dict(KLCheckerConfig, {ceiling: "low"}, prefix="ci_kl_checker")


def sections_of_checker() -> dict[str, type]:
    plugins = EmberPlugins()
    plugins.register(checker_plugin, "ci_kl_checker")
    try:
        return plugins.config_sections()
    finally:
        plugins.unregister("ci_kl_checker")


def test_error_survives_pickling_with_its_fields():
    error = KLCheckError(Check.KL_LOSS, "rollout 0, step 0", {"train/kl_loss": 0.5}, "too big")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is KLCheckError
    assert (copy.check, copy.step, copy.metrics, str(copy)) == (
        "first_step_kl_loss",
        "rollout 0, step 0",
        {"train/kl_loss": 0.5},
        str(error),
    )


def test_installed_entry_point_loads_the_plugin():
    found = installed_plugins()
    assert found["ci_kl_checker"].distribution == "ember-ci-kl-checker"
    assert found["ci_kl_checker"].value == "ember_ci_kl_checker.plugin"
    plugins = EmberPlugins.load(["ci_kl_checker"])
    try:
        assert plugins.config_sections() == {"ci_kl_checker": KLCheckerConfig}
        sections = {"ci_kl_checker": from_dict(KLCheckerConfig, {})}
        plugins.configure(CoreConfig(plugins=["ci_kl_checker"], ci=CIConfig(test=True)), sections)
        plugins.after_train_step(0, 0, 0, ON_POLICY_STEP)
        with pytest.raises(KLCheckError, match="first_step_kl_loss"):
            plugins.after_train_step(0, 0, 0, {**ON_POLICY_STEP, "train/kl_loss": 1e-3})
    finally:
        plugins.unregister("ci_kl_checker")
        checker_plugin._checker = None


REBUILT = "rollout/ref_rebuilt_log_probs_max_abs_diff"


def test_the_first_audit_after_a_resume_checks_the_reference_against_its_source(host):
    # A trainer process whose first audit is rollout 4 (audit_interval 2) started from a
    # checkpoint: its reference came from there.
    configure(host, audit_interval=2)
    later = without(ON_POLICY_ROLLOUT, "rollout/log_probs_ref_max_abs_diff")
    assert host.rebuilt_reference_forward(3) is False  # not an audit
    assert host.rebuilt_reference_forward(4) is True
    with pytest.raises(KLCheckError, match=f"{REBUILT} is not logged") as info:
        host.after_log_rollout_data(4, later)
    assert info.value.check == Check.RESUMED_REF_LOG_PROBS
    assert "first audit after a resume" in info.value.detail
    with pytest.raises(KLCheckError) as info:
        host.after_log_rollout_data(4, {**later, REBUILT: 3e-7})
    assert info.value.detail == f"|{REBUILT}| = 3.000e-07, expected < 1e-08"
    host.after_log_rollout_data(4, {**later, REBUILT: 0.0})
    # Once: the next audit's reference is the same model.
    assert host.rebuilt_reference_forward(6) is False
    host.after_log_rollout_data(6, later)


@pytest.mark.parametrize("case", ["from_rollout_0", "no_reference", "disable", "not_ci"], ids=str)
def test_no_rebuilt_reference_is_asked_for_a_run_from_the_start_or_without_one(host, case):
    configure(
        host,
        audit_interval=2,
        reference=case != "no_reference",
        ci_test=case != "not_ci",
        disable=case == "disable",
    )
    if case == "from_rollout_0":
        assert host.rebuilt_reference_forward(0) is False  # rollout 0 compares with the actor
    assert host.rebuilt_reference_forward(2) is False
    assert host.rebuilt_reference_forward(4) is False


ROUTING = "rollout/routing_agreement"


def test_audits_under_replay_check_the_recorded_experts_against_the_trainers_routing(host):
    """Replay agreement is 1.0 with whatever experts were recorded; the audit's scoring, before
    replay, says whether they are the ones the trainer's routers pick."""
    host.add(Exempting("r3", "replays the rollout's routing", ExemptionScope.ROUTING), "r3")
    configure(host, audit_interval=2)
    rollout = without(PROBED, "rollout/log_probs_ref_max_abs_diff")
    rollout["rollout/ref_replayed_log_probs_max_abs_diff"] = 0.0
    with pytest.raises(KLCheckError, match=f"{ROUTING} is not logged") as info:
        host.after_log_rollout_data(0, without(rollout, ROUTING))
    assert info.value.check == Check.RECORDED_ROUTING
    with pytest.raises(KLCheckError) as info:
        host.after_log_rollout_data(2, {**rollout, ROUTING: 0.04})  # about chance for 8 choose 2
    assert info.value.check == Check.RECORDED_ROUTING
    assert info.value.detail == (
        f"{ROUTING} = 0.0400, expected >= 0.5 (ci_kl_checker.recorded_routing_agreement_min)"
    )
    with pytest.raises(KLCheckError, match=Check.RECORDED_ROUTING):
        host.after_log_rollout_data(2, {**rollout, ROUTING: float("nan")})
    host.after_log_rollout_data(2, {**rollout, ROUTING: 0.5})
    # Between audits the samples may come from older weights: no floor there.
    host.after_log_rollout_data(3, without({**rollout, ROUTING: 0.04}, "rollout/audit"))


def test_the_routing_floor_is_configurable_and_needs_replay(host):
    configure(host, recorded_routing_agreement_min=0.99)  # no plugin replays
    host.after_log_rollout_data(0, {**ON_POLICY_ROLLOUT, ROUTING: 0.04})
    checker_plugin._checker = None
    host.add(Exempting("r3", "replays the rollout's routing", ExemptionScope.ROUTING), "r3")
    configure(host, reference=False, recorded_routing_agreement_min=0.99)
    with pytest.raises(KLCheckError, match="expected >= 0.99"):
        host.after_log_rollout_data(0, {**ON_POLICY_ROLLOUT, ROUTING: 0.98})
    for bad in (1.5, -0.1, True, "high"):
        with pytest.raises(ValueError, match="recorded_routing_agreement_min"):
            KLCheckerConfig(recorded_routing_agreement_min=bad)


BEHIND = "rollout/versions_behind_max"


def test_a_loop_that_runs_ahead_has_an_off_policy_audit_after_each_audit(host, caplog):
    """With generation ahead (max_staleness 1 here), the first rollout after an audit that holds
    stale samples reports their recorded versions and its replay agreement; every rollout's
    versions stay within the bound."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    host.add(Exempting("r3", "replays the rollout's routing", ExemptionScope.ROUTING), "r3")
    configure(host, reference=False, one_step_off=True, audit_interval=4)
    between = without(ON_POLICY_ROLLOUT, "rollout/audit")
    replayed = {**ON_POLICY_STEP, "train/replay_agreement": 1.0}
    host.after_log_rollout_data(0, PROBED)
    host.after_train_step(0, 0, 0, replayed)
    for rollout_id in (1, 2):
        host.after_log_rollout_data(rollout_id, {**between, BEHIND: 1.0})
        host.after_train_step(rollout_id, 0, rollout_id, replayed)
    lines = reports(caplog)
    assert (
        "ci_kl_checker: off-policy audit rollout 1 (log_rollout_data): recorded_versions "
        f"passed: {BEHIND} = 1, expected <= 1 (rollout.max_staleness), with stale samples"
    ) in lines
    assert (
        "ci_kl_checker: off-policy audit rollout 1, step 0 (accumulated step 1): "
        "replay_agreement passed: train/replay_agreement = 1.0, expected exactly 1.0"
    ) in lines
    assert not [line for line in lines if "rollout 2" in line]  # one per audit
    assert any("first rollout with stale samples is an off-policy audit" in m for m in said(caplog))
    # An on-policy rollout after the audit does not count; the next stale one does.
    host.after_log_rollout_data(4, PROBED)
    host.after_log_rollout_data(5, {**between, BEHIND: 0.0})
    host.after_log_rollout_data(6, {**between, BEHIND: 1.0})
    assert [line for line in reports(caplog) if "off-policy audit rollout 6 " in line]
    assert not [line for line in reports(caplog) if "rollout 5 " in line]
    # A sample staler than the bound fails wherever it is, and the metric is required.
    for bad in (2.0, math.nan):
        with pytest.raises(KLCheckError) as info:
            host.after_log_rollout_data(7, {**between, BEHIND: bad})
        assert info.value.check == Check.RECORDED_VERSIONS
    with pytest.raises(KLCheckError, match=f"{BEHIND} is not logged; it must be: rollout"):
        host.after_log_rollout_data(7, without(between, BEHIND))


def test_a_loop_in_turn_has_no_off_policy_audit(host, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    configure(host, reference=False)
    host.after_log_rollout_data(0, ON_POLICY_ROLLOUT)
    host.after_log_rollout_data(1, without(ON_POLICY_ROLLOUT, "rollout/audit"))
    assert not [line for line in reports(caplog) if "off-policy" in line]
    with pytest.raises(KLCheckError, match="expected <= 0"):  # logged, so checked
        host.after_log_rollout_data(2, {**without(ON_POLICY_ROLLOUT, "rollout/audit"), BEHIND: 1})
    host.after_log_rollout_data(3, without(ON_POLICY_ROLLOUT, "rollout/audit", BEHIND))


def configure_reference_from(host: EmberPlugins, ref_load: str, hf_load: str | None) -> None:
    """Configure a CI run whose reference is `train.ref_load` and the actor's start
    `train.hf_load` (a mapping of the run file: the checker reads either)."""
    config = {
        "plugins": host.enabled,
        "ci": {"test": True},
        "algorithm": {"use_kl_loss": True},
        "train": {"ref_load": ref_load, "hf_load": hf_load},
    }
    host.configure(config, {"ci_kl_checker": KLCheckerConfig()})


def test_a_reference_with_a_checkpoint_of_its_own_is_checked_against_that_checkpoint(host, caplog):
    """An SFT model as reference (RL continued from a checkpoint): the actor cannot equal it at
    rollout 0; the reference must be the model train.ref_load holds."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    configure_reference_from(host, "/ckpt/sft", hf_load="/ckpt/rl-step-300")
    apart = {**ON_POLICY_ROLLOUT, "rollout/log_probs_ref_max_abs_diff": 0.7}
    assert host.rebuilt_reference_forward(0) is True
    assert host.replayed_reference_forward(0) is False  # nothing compares with the actor
    with pytest.raises(KLCheckError, match=f"{REBUILT} is not logged") as info:
        host.after_log_rollout_data(0, apart)
    assert info.value.check == Check.ROLLOUT_REF_REBUILT_LOG_PROBS
    with pytest.raises(KLCheckError) as info:  # a reference that is not train.ref_load's model
        host.after_log_rollout_data(0, {**apart, REBUILT: 0.01})
    assert (info.value.check, info.value.detail) == (
        Check.ROLLOUT_REF_REBUILT_LOG_PROBS,
        f"|{REBUILT}| = 1.000e-02, expected < 1e-08",
    )
    host.after_log_rollout_data(0, {**apart, REBUILT: 0.0})
    host.after_train_step(0, 0, 0, {**ON_POLICY_STEP, "train/kl_loss": 0.02})  # KL to the SFT
    assert any(
        "do not apply: train.ref_load='/ckpt/sft' is the reference's own checkpoint" in line
        for line in said(caplog)
    )
    assert host.rebuilt_reference_forward(50) is False  # the audits after: nothing to rebuild


@pytest.mark.parametrize("ref_load", ["/ckpt/base", "/ckpt/base/"])
def test_a_reference_loaded_from_the_actors_start_is_still_the_actor_at_rollout_0(host, ref_load):
    configure_reference_from(host, ref_load, hf_load="/ckpt/base")
    assert host.rebuilt_reference_forward(0) is False
    with pytest.raises(KLCheckError) as info:
        host.after_log_rollout_data(
            0, {**ON_POLICY_ROLLOUT, "rollout/log_probs_ref_max_abs_diff": 0.7}
        )
    assert info.value.check == Check.ROLLOUT_REF_LOG_PROBS


def test_every_audit_under_replay_needs_the_shifted_experts_replayed_exactly(host, caplog):
    """Replaying the engine's own experts agrees without replay too wherever the trainer routes
    as the engine did (float32, in turn): each audit's probe replays experts no router picks."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    host.add(Exempting("r3", "replays the rollout's routing", ExemptionScope.ROUTING), "r3")
    configure(host, reference=False, audit_interval=2)
    with pytest.raises(
        KLCheckError, match=f"{SHIFTED} is not logged; it must be: a plugin"
    ) as info:
        host.after_log_rollout_data(0, ON_POLICY_ROLLOUT)  # the engine's own experts agree
    assert info.value.check == Check.SHIFTED_REPLAY
    for bad in (0.0, 0.999, math.nan):  # a forward that does not replay: about 0
        with pytest.raises(KLCheckError) as info:
            host.after_log_rollout_data(2, {**PROBED, SHIFTED: bad})
        assert info.value.check == Check.SHIFTED_REPLAY
        assert info.value.detail == f"{SHIFTED} = {bad!r}, expected exactly 1.0"
    host.after_log_rollout_data(2, PROBED)
    assert (
        "ci_kl_checker: audit rollout 2 (log_rollout_data): shifted_replay_agreement passed: "
        f"{SHIFTED} = 1.0, expected exactly 1.0"
    ) in reports(caplog)
    host.after_log_rollout_data(3, without(ON_POLICY_ROLLOUT, "rollout/audit"))  # no audit


@pytest.mark.parametrize(
    ("quantization", "qat", "ceiling"),
    [("fp8_block", False, 8.0), ("fp8_block", True, 8.0), ("int4_w4a16", False, 60.0),
     ("int4_w4a16", True, 5e-4)],
)  # fmt: skip
def test_a_quantized_engine_takes_the_certificates_ceiling_of_its_scheme(
    quantization, qat, ceiling
):
    """The checker's per-token ceiling follows `ember certify`'s bars: a quantized engine
    without QAT is measured against its scheme's, not the float32 one its weights cannot meet."""
    config = {
        "train": {"dtype": "float32", "qat": qat},
        "engine": {"kind": "hf", "hf": {"dtype": "float32"}, "quantization": quantization},
        "rollout": {"true_on_policy": False},
    }
    found, why = checker_plugin.max_ceiling(config, KLCheckerConfig())
    assert found == ceiling
    assert (quantization in why) == (found != 5e-4), why
