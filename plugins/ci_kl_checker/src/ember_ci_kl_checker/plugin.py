"""The ci_kl_checker plugin: exact on-policy checks and a train/rollout mismatch ceiling in CI."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ember_ci_kl_checker.config import SECTION, KLCheckerConfig
from ember_ci_kl_checker.errors import Check, KLCheckError
from ember_core.hookspecs import ConfigSection, ExemptionScope, KLExemption, hookimpl

if TYPE_CHECKING:
    from ember_core.plugins import EmberPlugins

logger = logging.getLogger(__name__)

TOLERANCE = 1e-8
"""An on-policy quantity passes when its absolute value is strictly below this."""

PPO_KL = "train/ppo_kl"
KL_LOSS = "train/kl_loss"
REF_MAX_ABS_DIFF = "rollout/log_probs_ref_max_abs_diff"
"""max |actor - reference| log-prob over a rollout's counted response tokens (all ranks)."""
REF_REPLAYED_MAX_ABS_DIFF = "rollout/ref_replayed_log_probs_max_abs_diff"
"""The same maximum against a check-only reference forward that replays the rollout's routing."""
ROLLOUT_LOG_PROBS = "rollout/rollout_log_probs"
"""Logged when the rollout's samples carry the engine's log-probs."""
TRAIN_MISMATCH = "train/train_rollout_logprob_abs_diff"
ROLLOUT_MISMATCH = "rollout/train_rollout_logprob_abs_diff"
_PPO_KL_REQUIRED = "every actor update logs it"


def _get(node: Any, key: str) -> Any:
    if node is None:
        return None
    return node.get(key) if isinstance(node, Mapping) else getattr(node, key, None)


def _flag(config: Any, section: str, key: str) -> bool:
    value = _get(_get(config, section), key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ValueError(f"{section}.{key}={value!r}: expected true or false")
    return value


def ci_test_enabled(config: Any) -> bool:
    """The core's CI switch `ci.test` of a run config (an object or a mapping); False if absent.

    Raises:
        ValueError: `ci.test` is present but not a bool.
    """
    return _flag(config, "ci", "test")


def reference_reasons(config: Any) -> list[str]:
    """What in a run config (an object or a mapping) makes the trainer build a reference model:
    the rule of ``MegatronWorker`` (a KL loss, a KL reward penalty, or ``train.ref_load``).

    Returns:
        One ``key=value`` per reason; empty when the run has no reference model.
    """
    reasons = []
    if _flag(config, "algorithm", "use_kl_loss"):
        reasons.append("algorithm.use_kl_loss=true")
    kl_coef = _get(_get(config, "algorithm"), "kl_coef")
    if kl_coef is not None and float(kl_coef) > 0:
        reasons.append(f"algorithm.kl_coef={kl_coef}")
    ref_load = _get(_get(config, "train"), "ref_load")
    if ref_load is not None:
        reasons.append(f"train.ref_load={ref_load!r}")
    return reasons


class KLChecker:
    """The checks of one run, its switches resolved once at configure time.

    A check that applies runs or fails naming the metric it misses. Whether it applies comes
    from the run config (the actor/reference checks need a reference model), from the rollout
    (the mismatch ceiling needs the engine's log-probs), or from the exemptions other plugins
    report. A metric that is logged is checked even where the check is not required.

    Args:
        active: Whether checks run at all (`ci.test` and not `ci_kl_checker.disable`).
        exemptions: Returns the enabled plugins' exemptions (the facade's
            `kl_check_exemptions`); asked once, at the first check that can be exempted, so
            every plugin is configured by then.
        reference: Why the config uses a reference model (`reference_reasons`); empty: none.
        ceiling: The mismatch ceiling (`train_rollout_logprob_abs_diff_threshold`).
        engine_old_log_probs: The config takes the old log-probs from the engine
            (`algorithm.use_rollout_log_probs`): the trainer computes none before training, so
            the first-step ppo_kl holds the train/rollout mismatch instead of an exact zero,
            and the actor/reference log-prob comparison of rollout 0 is not logged. Those two
            checks stand down; the mismatch ceiling is checked at each rollout's first step,
            where train/train_rollout_logprob_abs_diff is the trainer's log-probs at the
            rollout's weights against the engine's.
        one_step_off: The config overlaps rollout and training (`rollout.async`): after rollout
            0 the engine samples from weights one update older than the trainer's, so the
            train/rollout comparison holds that update too, and the ceiling is checked at
            rollout 0 only.
    """

    def __init__(
        self,
        *,
        active: bool,
        exemptions: Callable[[], Sequence[KLExemption]],
        reference: Sequence[str] = (),
        ceiling: float = KLCheckerConfig().train_rollout_logprob_abs_diff_threshold,
        engine_old_log_probs: bool = False,
        one_step_off: bool = False,
    ) -> None:
        self.active = active
        self.engine_old_log_probs = engine_old_log_probs
        self.one_step_off = one_step_off
        self.reference = list(reference)
        self.ceiling = ceiling
        self._exemptions_source = exemptions
        self._exemptions: list[KLExemption] | None = None
        self._announced = False
        self._engine_log_probs: set[int] = set()
        """Rollouts whose `log_rollout_data` showed the engine's log-probs."""

    def exemptions(self) -> list[KLExemption]:
        """The exemptions the enabled plugins reported (asked once, then cached)."""
        if self._exemptions is None:
            self._exemptions = list(self._exemptions_source())
        return self._exemptions

    def after_train_step(
        self, rollout_id: int, step_id: int, accumulated_step_id: int, metrics: Mapping[str, Any]
    ) -> None:
        """Check ppo_kl at the first step of each rollout, kl_loss at the first step of the run,
        and the mismatch ceiling at every step."""
        if not self.active:
            return
        where = f"rollout {rollout_id}, step {step_id} (accumulated step {accumulated_step_id})"
        # Old and new actor log-probs come from the same weights (and, under routing replay,
        # the same experts) at the first step of a rollout, so their KL is exactly zero.
        if step_id == 0 and not self.engine_old_log_probs:
            self._expect_zero(Check.PPO_KL, PPO_KL, metrics, where, _PPO_KL_REQUIRED)
        # Actor and reference hold the same weights only before the first update.
        if accumulated_step_id == 0 and self._applies(KL_LOSS, metrics):
            self._expect_zero(Check.KL_LOSS, KL_LOSS, metrics, where, self._reference_reason())
        self._engine_log_probs = {r for r in self._engine_log_probs if r >= rollout_id}
        engine = rollout_id in self._engine_log_probs
        if (self.engine_old_log_probs and step_id > 0) or (self.one_step_off and rollout_id > 0):
            return  # the metric then includes updates the engine has not seen
        if engine or TRAIN_MISMATCH in metrics:
            self._expect_ceiling(TRAIN_MISMATCH, metrics, where, self._engine_reason(rollout_id))

    def wants_replayed_reference(self, rollout_id: int) -> bool:
        """Whether to ask for the check-only reference forward that replays the rollout's
        routing: at rollout 0 of a CI run with a reference, when plugins exempted the
        actor/reference checks for routing alone."""
        return (
            self.active
            and rollout_id == 0
            and bool(self.reference)
            and not self.engine_old_log_probs
            and self._routing_only()
        )

    def after_log_rollout_data(self, rollout_id: int, metrics: Mapping[str, Any]) -> None:
        """At rollout 0, check that actor and reference agree on every counted token's
        log-prob (under a routing-only exemption, the reference that replays the rollout's
        routing); at every rollout, check the mismatch ceiling."""
        if not self.active:
            return
        where = f"rollout {rollout_id} (log_rollout_data)"
        if (
            rollout_id == 0
            and self._applies(REF_MAX_ABS_DIFF, metrics)
            and not (self.engine_old_log_probs and REF_MAX_ABS_DIFF not in metrics)
        ):
            self._expect_zero(
                Check.ROLLOUT_REF_LOG_PROBS,
                REF_MAX_ABS_DIFF,
                metrics,
                where,
                self._reference_reason(),
            )
        if rollout_id == 0 and (
            self.wants_replayed_reference(rollout_id) or REF_REPLAYED_MAX_ABS_DIFF in metrics
        ):
            self._expect_zero(
                Check.ROLLOUT_REF_REPLAYED_LOG_PROBS,
                REF_REPLAYED_MAX_ABS_DIFF,
                metrics,
                where,
                f"{self._reference_reason()} and every exemption excuses routing only, so the "
                "checker asked for the reference forward that replays the rollout's routing",
            )
        if ROLLOUT_LOG_PROBS in metrics:
            self._engine_log_probs.add(rollout_id)
        if self.one_step_off and rollout_id > 0:
            return
        if (
            ROLLOUT_LOG_PROBS in metrics and not self.engine_old_log_probs
        ) or ROLLOUT_MISMATCH in metrics:
            self._expect_ceiling(ROLLOUT_MISMATCH, metrics, where, self._engine_reason(rollout_id))

    def _applies(self, name: str, metrics: Mapping[str, Any]) -> bool:
        """Whether an actor/reference check runs: a reference by config (or its metric logged
        anyway), and no plugin's exemption."""
        return (bool(self.reference) or name in metrics) and not self._exempted()

    def _reference_reason(self) -> str:
        return f"the config uses a reference model ({', '.join(self.reference)})"

    @staticmethod
    def _engine_reason(rollout_id: int) -> str:
        return f"rollout {rollout_id} carries the engine's log-probs ({ROLLOUT_LOG_PROBS})"

    def _routing_only(self) -> bool:
        """Plugins exempted the actor/reference checks, each for routing alone."""
        exemptions = self.exemptions()
        return bool(exemptions) and all(e.scope == ExemptionScope.ROUTING for e in exemptions)

    def _exempted(self) -> bool:
        exemptions = self.exemptions()
        if exemptions and not self._announced:
            self._announced = True
            reasons = "; ".join(f"{e.plugin}: {e.reason}" for e in exemptions)
            still = [str(Check.PPO_KL)]
            if self.reference and self._routing_only():
                still.append(f"{Check.ROLLOUT_REF_REPLAYED_LOG_PROBS} at rollout 0")
            logger.info(
                "ci_kl_checker: the initial actor/reference KL checks (%s, %s) stand down, "
                "exempted by %s (%s still checked)",
                Check.KL_LOSS,
                Check.ROLLOUT_REF_LOG_PROBS,
                reasons,
                " and ".join(still),
            )
        return bool(exemptions)

    @staticmethod
    def _number(
        check: Check, name: str, metrics: Mapping[str, Any], where: str, required: str
    ) -> float:
        if name not in metrics:
            raise KLCheckError(
                check, where, metrics, f"{name} is not logged; it must be: {required}"
            )
        try:
            return float(metrics[name])
        except (TypeError, ValueError):
            detail = f"{name}={metrics[name]!r} is not a number"
            raise KLCheckError(check, where, metrics, detail) from None

    def _expect_zero(
        self, check: Check, name: str, metrics: Mapping[str, Any], where: str, required: str
    ) -> None:
        number = self._number(check, name, metrics, where, required)
        # NaN fails too: `abs(nan) < TOLERANCE` is False.
        if not abs(number) < TOLERANCE:
            raise KLCheckError(
                check, where, metrics, f"|{name}| = {abs(number):.3e}, expected < {TOLERANCE:g}"
            )

    def _expect_ceiling(
        self, name: str, metrics: Mapping[str, Any], where: str, required: str
    ) -> None:
        check = Check.TRAIN_ROLLOUT_MISMATCH
        number = self._number(check, name, metrics, where, required)
        if not number <= self.ceiling:  # NaN fails
            raise KLCheckError(
                check,
                where,
                metrics,
                f"{name} = {number:.3e}, expected <= {self.ceiling:g} "
                f"({SECTION}.train_rollout_logprob_abs_diff_threshold)",
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
    reference = reference_reasons(config)
    engine_old = _flag(config, "algorithm", "use_rollout_log_probs")
    rollout = _get(config, "rollout")
    # A RunConfig holds `async_` (a keyword otherwise); a mapping of the file holds `async`.
    one_step_off = bool(_get(rollout, "async_") or _get(rollout, "async"))
    if ci_test and one_step_off and not section.disable:
        logger.info(
            "ci_kl_checker: rollout.async=true: after rollout 0 the engine samples from weights "
            "one update older than the trainer's, so %s is checked at rollout 0 only",
            Check.TRAIN_ROLLOUT_MISMATCH,
        )
    if ci_test and engine_old and not section.disable:
        logger.info(
            "ci_kl_checker: %s and %s stand down: algorithm.use_rollout_log_probs=true takes the "
            "old log-probs from the engine, so the trainer computes none to compare; %s is "
            "checked at the first step of each rollout",
            Check.PPO_KL,
            Check.ROLLOUT_REF_LOG_PROBS,
            Check.TRAIN_ROLLOUT_MISMATCH,
        )
    if section.disable:
        logger.warning(
            "ci_kl_checker: disabled by %s.disable=true; none of its checks runs%s",
            SECTION,
            "" if ci_test else " (ci.test is false, so none would have run anyway)",
        )
    elif ci_test and not reference:
        logger.info(
            "ci_kl_checker: %s and %s do not apply: the config uses no reference model "
            "(algorithm.use_kl_loss=false, algorithm.kl_coef=0, no train.ref_load); they run "
            "only if their metrics are logged anyway",
            Check.KL_LOSS,
            Check.ROLLOUT_REF_LOG_PROBS,
        )
    _checker = KLChecker(
        active=ci_test and not section.disable,
        exemptions=plugins.kl_check_exemptions,
        reference=reference,
        ceiling=section.train_rollout_logprob_abs_diff_threshold,
        engine_old_log_probs=engine_old,
        one_step_off=one_step_off,
    )


@hookimpl
def ember_replayed_reference_forward(rollout_id: int) -> bool:
    return _current().wants_replayed_reference(rollout_id)


@hookimpl
def ember_after_train_step(
    rollout_id: int, step_id: int, accumulated_step_id: int, metrics: dict[str, float]
) -> None:
    _current().after_train_step(rollout_id, step_id, accumulated_step_id, metrics)


@hookimpl
def ember_after_log_rollout_data(rollout_id: int, metrics: dict[str, float]) -> None:
    _current().after_log_rollout_data(rollout_id, metrics)
