"""The ci_kl_checker plugin: exact on-policy checks of a run's first update, in CI mode only."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ember_ci_kl_checker.config import SECTION, KLCheckerConfig
from ember_ci_kl_checker.errors import Check, KLCheckError
from ember_core.hookspecs import ConfigSection, KLExemption, hookimpl

if TYPE_CHECKING:
    from ember_core.plugins import EmberPlugins

logger = logging.getLogger(__name__)

TOLERANCE = 1e-8
"""A checked quantity passes when its absolute value is strictly below this."""

PPO_KL = "train/ppo_kl"
PG_CLIPFRAC = "train/pg_clipfrac"
KL_LOSS = "train/kl_loss"
LOG_PROBS = "rollout/log_probs"
REF_LOG_PROBS = "rollout/ref_log_probs"


def ci_test_enabled(config: Any) -> bool:
    """The core's CI switch `ci.test` of a run config (an object or a mapping); False if absent.

    Raises:
        ValueError: `ci.test` is present but not a bool.
    """

    def get(node: Any, key: str) -> Any:
        return node.get(key) if isinstance(node, Mapping) else getattr(node, key, None)

    ci = get(config, "ci")
    test = get(ci, "test") if ci is not None else None
    if test is None:
        return False
    if not isinstance(test, bool):
        raise ValueError(f"ci.test={test!r}: expected true or false")
    return test


class KLChecker:
    """The checks of one run, its switches resolved once at configure time.

    Args:
        active: Whether checks run at all (`ci.test` and not `ci_kl_checker.disable`).
        exemptions: Returns the enabled plugins' exemptions (the facade's
            `kl_check_exemptions`); asked once, at the first check that can be exempted, so
            every plugin is configured by then.
    """

    def __init__(self, *, active: bool, exemptions: Callable[[], Sequence[KLExemption]]) -> None:
        self.active = active
        self._exemptions_source = exemptions
        self._exemptions: list[KLExemption] | None = None
        self._announced = False

    def exemptions(self) -> list[KLExemption]:
        """The exemptions the enabled plugins reported (asked once, then cached)."""
        if self._exemptions is None:
            self._exemptions = list(self._exemptions_source())
        return self._exemptions

    def after_train_step(
        self, rollout_id: int, step_id: int, accumulated_step_id: int, metrics: Mapping[str, Any]
    ) -> None:
        """Check the first step of each rollout (ppo_kl) and of the run (kl_loss)."""
        if not self.active:
            return
        where = f"rollout {rollout_id}, step {step_id} (accumulated step {accumulated_step_id})"
        # Old and new actor log-probs come from the same weights (and, under routing replay,
        # the same experts) at the first step of a rollout, so their KL is exactly zero.
        if step_id == 0 and PPO_KL in metrics and PG_CLIPFRAC in metrics:
            self._expect_zero(Check.PPO_KL, PPO_KL, metrics[PPO_KL], where, metrics)
        # Actor and reference hold the same weights only before the first update.
        if accumulated_step_id == 0 and KL_LOSS in metrics and not self._exempted():
            self._expect_zero(Check.KL_LOSS, KL_LOSS, metrics[KL_LOSS], where, metrics)

    def after_log_rollout_data(self, rollout_id: int, metrics: Mapping[str, Any]) -> None:
        """Check that actor and reference agree on the first rollout's log-probs."""
        if not self.active or rollout_id != 0:
            return
        if LOG_PROBS not in metrics or REF_LOG_PROBS not in metrics or self._exempted():
            return
        where = f"rollout {rollout_id} (log_rollout_data)"
        try:
            gap = float(metrics[LOG_PROBS]) - float(metrics[REF_LOG_PROBS])
        except (TypeError, ValueError):
            gap = math.nan
        self._expect_zero(
            Check.ROLLOUT_REF_LOG_PROBS, f"{LOG_PROBS} - {REF_LOG_PROBS}", gap, where, metrics
        )

    def _exempted(self) -> bool:
        exemptions = self.exemptions()
        if exemptions and not self._announced:
            self._announced = True
            reasons = "; ".join(f"{e.plugin}: {e.reason}" for e in exemptions)
            logger.info(
                "ci_kl_checker: the initial actor/reference KL checks (%s, %s) stand down, "
                "exempted by %s (%s still checked)",
                Check.KL_LOSS,
                Check.ROLLOUT_REF_LOG_PROBS,
                reasons,
                Check.PPO_KL,
            )
        return bool(exemptions)

    @staticmethod
    def _expect_zero(
        check: Check, name: str, value: Any, where: str, metrics: Mapping[str, Any]
    ) -> None:
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise KLCheckError(check, where, metrics, f"{name}={value!r} is not a number") from None
        # NaN fails too: `abs(nan) < TOLERANCE` is False.
        if not abs(number) < TOLERANCE:
            raise KLCheckError(
                check, where, metrics, f"|{name}| = {abs(number):.3e}, expected < {TOLERANCE:g}"
            )


_checker: KLChecker | None = None


def _current() -> KLChecker:
    if _checker is None:
        raise RuntimeError(
            "ci_kl_checker: a check hook ran before ember_configure; configure the plugins "
            "(EmberPlugins.configure) before training"
        )
    return _checker


# --------------------------------------------------------------------------------------------
# Hooks
# --------------------------------------------------------------------------------------------


@hookimpl
def ember_config_section() -> ConfigSection:
    return ConfigSection(SECTION, KLCheckerConfig)


@hookimpl
def ember_configure(config: Any, sections: dict[str, Any], plugins: EmberPlugins) -> None:
    global _checker
    section = sections.get(SECTION)
    if section is None:
        section = KLCheckerConfig()
    if not isinstance(section, KLCheckerConfig):
        raise TypeError(
            f"sections[{SECTION!r}] must be a KLCheckerConfig, got {type(section).__name__}"
        )
    ci_test = ci_test_enabled(config)
    if section.disable:
        logger.warning(
            "ci_kl_checker: disabled by %s.disable=true; no on-policy KL check runs%s",
            SECTION,
            "" if ci_test else " (ci.test is false, so none would have run anyway)",
        )
    _checker = KLChecker(
        active=ci_test and not section.disable, exemptions=plugins.kl_check_exemptions
    )


@hookimpl
def ember_after_train_step(
    rollout_id: int, step_id: int, accumulated_step_id: int, metrics: dict[str, float]
) -> None:
    _current().after_train_step(rollout_id, step_id, accumulated_step_id, metrics)


@hookimpl
def ember_after_log_rollout_data(rollout_id: int, metrics: dict[str, float]) -> None:
    _current().after_log_rollout_data(rollout_id, metrics)
