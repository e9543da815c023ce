"""The CI on-policy checks through the plugin facade, with the plugin registered explicitly."""

from __future__ import annotations

import logging
import math
import pickle

import pytest

from ember_ci_kl_checker import Check, KLCheckerConfig, KLCheckError
from ember_ci_kl_checker import plugin as checker_plugin
from ember_core.config import CIConfig, CoreConfig, from_dict
from ember_core.hookspecs import KLExemption, hookimpl
from ember_core.plugins import EmberPlugins, installed_plugins

LOGGER = "ember_ci_kl_checker.plugin"

ON_POLICY_STEP = {
    "train/loss": 0.31,
    "train/pg_loss": 0.3,
    "train/ppo_kl": 0.0,
    "train/pg_clipfrac": 0.0,
    "train/kl_loss": 0.0,
    "train/grad_norm": 1.7,
}
ON_POLICY_ROLLOUT = {
    "rollout/rewards": 0.5,
    "rollout/log_probs": -1.234567,
    "rollout/ref_log_probs": -1.234567,
}


class Exempting:
    """Stands in for a plugin that changes the actor's forward relative to the reference's."""

    def __init__(self, plugin: str, reason: str) -> None:
        self.exemption = KLExemption(plugin, reason)

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


def configure(host: EmberPlugins, *, ci_test: bool = True, disable: bool = False) -> None:
    config = CoreConfig(plugins=host.enabled, ci=CIConfig(test=ci_test))
    host.configure(config, {"ci_kl_checker": KLCheckerConfig(disable=disable)})


def test_passes_when_the_first_update_is_exactly_on_policy(host, caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    configure(host)
    host.after_log_rollout_data(0, ON_POLICY_ROLLOUT)
    host.after_train_step(0, 0, 0, ON_POLICY_STEP)
    host.after_train_step(1, 0, 4, ON_POLICY_STEP)
    assert caplog.records == []


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


def test_ppo_kl_is_checked_only_when_pg_clipfrac_is_logged_too(host):
    configure(host)
    metrics = {**ON_POLICY_STEP, "train/ppo_kl": 0.01}
    del metrics["train/pg_clipfrac"]
    host.after_train_step(0, 0, 0, metrics)


def test_first_step_kl_loss_fails_with_the_metric_dict(host):
    configure(host)
    metrics = {**ON_POLICY_STEP, "train/kl_loss": 4e-8}
    with pytest.raises(
        KLCheckError, match=r"\|train/kl_loss\| = 4\.000e-08, expected < 1e-08"
    ) as info:
        host.after_train_step(0, 0, 0, metrics)
    assert info.value.check == Check.KL_LOSS
    assert info.value.metrics == metrics


def test_first_rollout_ref_log_probs_fail_with_the_metric_dict(host):
    configure(host)
    metrics = {**ON_POLICY_ROLLOUT, "rollout/ref_log_probs": -1.2346}
    with pytest.raises(KLCheckError) as info:
        host.after_log_rollout_data(0, metrics)
    assert info.value.check == Check.ROLLOUT_REF_LOG_PROBS
    assert info.value.step == "rollout 0 (log_rollout_data)"
    assert info.value.metrics == metrics
    assert "|rollout/log_probs - rollout/ref_log_probs| = 3.300e-05" in str(info.value)


def test_later_steps_and_rollouts_are_not_checked(host):
    configure(host)
    drifted_step = {**ON_POLICY_STEP, "train/ppo_kl": 0.02, "train/kl_loss": 0.03}
    drifted_rollout = {**ON_POLICY_ROLLOUT, "rollout/ref_log_probs": -0.9}
    host.after_train_step(0, 1, 1, drifted_step)  # not the first step of the rollout
    host.after_train_step(5, 3, 23, drifted_step)
    host.after_log_rollout_data(1, drifted_rollout)
    host.after_log_rollout_data(7, drifted_rollout)
    # The first step of a later rollout is on-policy again for ppo_kl, but not for kl_loss.
    host.after_train_step(1, 0, 2, {**ON_POLICY_STEP, "train/kl_loss": 0.03})
    with pytest.raises(KLCheckError, match="first_step_ppo_kl"):
        host.after_train_step(1, 0, 2, drifted_step)


def test_missing_metrics_are_not_checked(host):
    configure(host)
    host.after_train_step(0, 0, 0, {"train/loss": 1.0, "train/pg_loss": 1.0})
    host.after_log_rollout_data(0, {"rollout/log_probs": -1.0})  # no reference model


def test_exemptions_stand_the_actor_ref_checks_down_with_one_log_line(host, caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    host.add(Exempting("replayer", "the actor replays recorded decisions"), "replayer")
    host.add(Exempting("adapter", "only the actor carries the adapter"), "adapter")
    configure(host)
    host.after_log_rollout_data(0, {**ON_POLICY_ROLLOUT, "rollout/ref_log_probs": -1.3})
    host.after_train_step(0, 0, 0, {**ON_POLICY_STEP, "train/kl_loss": 0.002})
    host.after_train_step(1, 0, 1, {**ON_POLICY_STEP, "train/kl_loss": 0.002})
    assert len(caplog.records) == 1
    line = caplog.records[0].getMessage()
    assert caplog.records[0].levelno == logging.INFO
    assert "replayer: the actor replays recorded decisions" in line
    assert "adapter: only the actor carries the adapter" in line
    assert "first_step_kl_loss" in line and "first_rollout_ref_log_probs" in line
    # ppo_kl compares the actor with itself, so no exemption covers it.
    with pytest.raises(KLCheckError, match="first_step_ppo_kl"):
        host.after_train_step(0, 0, 0, {**ON_POLICY_STEP, "train/ppo_kl": 0.002})
    assert len(caplog.records) == 1


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
    drifted_step = {**ON_POLICY_STEP, "train/ppo_kl": 0.1, "train/kl_loss": 0.1}
    host.after_train_step(0, 0, 0, drifted_step)
    host.after_log_rollout_data(0, {**ON_POLICY_ROLLOUT, "rollout/ref_log_probs": 0.0})
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (
            logging.WARNING,
            "ci_kl_checker: disabled by ci_kl_checker.disable=true; no on-policy KL check runs",
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
    host.after_log_rollout_data(0, {**ON_POLICY_ROLLOUT, "rollout/log_probs": 0.0})
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
