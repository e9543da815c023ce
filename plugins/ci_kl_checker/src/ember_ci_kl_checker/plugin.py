"""The ci_kl_checker plugin: exact on-policy checks and a train/rollout mismatch ceiling in CI."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ember_ci_kl_checker.config import SECTION, KLCheckerConfig
from ember_ci_kl_checker.errors import Check, KLCheckError
from ember_core.certify import (
    LOW_PRECISION_BARS,
    TOLERANCE,
    at_least,
    at_most,
    exactly_one,
    exactly_zero,
    mismatch_ceiling,
    reference_source,
)
from ember_core.hookspecs import ConfigSection, ExemptionScope, KLExemption, hookimpl

if TYPE_CHECKING:
    from ember_core.plugins import EmberPlugins

logger = logging.getLogger(__name__)

PPO_KL = "train/ppo_kl"
PPO_KL_MAX = "train/ppo_kl_abs_max"
"""max |old - training| log-prob over a step's counted tokens (all ranks)."""
KL_LOSS = "train/kl_loss"
REF_MAX_ABS_DIFF = "rollout/log_probs_ref_max_abs_diff"
"""max |actor - reference| log-prob over a rollout's counted response tokens (all ranks)."""
REF_REPLAYED_MAX_ABS_DIFF = "rollout/ref_replayed_log_probs_max_abs_diff"
"""The same maximum against a check-only reference forward that replays the rollout's routing."""
REF_REBUILT_MAX_ABS_DIFF = "rollout/ref_rebuilt_log_probs_max_abs_diff"
"""The same maximum between the reference the run holds and one rebuilt from its source."""
ROLLOUT_LOG_PROBS = "rollout/rollout_log_probs"
"""Logged when the rollout's samples carry the engine's log-probs."""
TRAIN_MISMATCH = "train/train_rollout_logprob_abs_diff"
ROLLOUT_MISMATCH = "rollout/train_rollout_logprob_abs_diff"
MISMATCH_MAX = "rollout/train_rollout_logprob_max_abs_diff"
"""max |trainer - engine| log-prob over a rollout's counted response tokens (all ranks)."""
REPLAY_AGREEMENT = "train/replay_agreement"
"""Fraction of (token, MoE layer) routings of a step's training forwards that used the
rollout's experts."""
SHIFTED_REPLAY_AGREEMENT = "rollout/shifted_replay_agreement"
"""Fraction of (token, MoE layer) routings of an audit's probe forward, given the rollout's
experts each moved to the next expert id, that used those experts."""
ROUTING_AGREEMENT = "rollout/routing_agreement"
"""Fraction of (token, MoE layer) routings of the scoring forward whose own top-k expert set,
before replay, equals the engine's recorded one."""
AUDIT = "rollout/audit"
"""1.0 on an audit iteration."""
VERSIONS_BEHIND = "rollout/versions_behind_max"
"""The most updates the trainer is ahead of the recorded weight version of a sample."""
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
    from the run config (the actor/reference checks need a reference model; the loop decides
    which rollouts are exact), from the rollout (the mismatch ceilings need the engine's
    log-probs), or from the exemptions other plugins report. A metric that is logged is checked
    even where the check is not required.

    Audits: rollout 0 and every `audit_interval` rollouts, the checker asks the run for an audit
    iteration (`wants_audit`): the engine samples from the weights the trainer holds and the
    trainer scores the rollout itself, so every check is exact there whatever the loop. Between
    audits, the loop decides what is exact: with `engine_old_log_probs` the trainer computes no
    old log-probs (the first-step ppo_kl then holds the mismatch, not an exact zero); with
    `one_step_off` the engine samples from weights one update older than the trainer's (a
    train/rollout gap then holds that update too). Those checks stand down between audits.

    Args:
        active: Whether checks run at all (`ci.test` and not `ci_kl_checker.disable`).
        exemptions: Returns the enabled plugins' exemptions (the facade's
            `kl_check_exemptions`); asked once, at the first check that can be exempted, so
            every plugin is configured by then.
        reference: Why the config uses a reference model (`reference_reasons`); empty: none.
        source: The reference's own checkpoint where it is not the actor's start
            (`ember_core.certify.reference_source`): actor and reference then need not agree
            at rollout 0, and the reference is checked against a second one built from it.
        ceiling: The ceiling of the mean mismatch metrics
            (`train_rollout_logprob_abs_diff_threshold`).
        max_ceiling: The ceiling of the per-token maximum (`MISMATCH_MAX`); default: the bar
            below float32, as `max_ceiling()` gives for an engine of unknown dtype.
        audit_interval: Audit rollout 0 and every this many rollouts.
        routing_floor: The smallest routing agreement with the recorded experts that passes at
            audits under routing replay (`recorded_routing_agreement_min`).
        engine_old_log_probs: The config takes the old log-probs from the engine
            (`algorithm.use_rollout_log_probs`).
        one_step_off: The config overlaps rollout and training (`rollout.async`).
        staleness_bound: How many updates generation may run ahead (`rollout.max_staleness`,
            resolved); from 1 on, each audit is followed by an off-policy audit.
        announcements: INFO lines logged once, at the first check of this process.
    """

    def __init__(
        self,
        *,
        active: bool,
        exemptions: Callable[[], Sequence[KLExemption]],
        reference: Sequence[str] = (),
        source: str | None = None,
        ceiling: float = KLCheckerConfig().train_rollout_logprob_abs_diff_threshold,
        max_ceiling: float = LOW_PRECISION_BARS.max,
        audit_interval: int = KLCheckerConfig().audit_interval,
        routing_floor: float = KLCheckerConfig().recorded_routing_agreement_min,
        engine_old_log_probs: bool = False,
        one_step_off: bool = False,
        staleness_bound: int = 0,
        announcements: Sequence[str] = (),
    ) -> None:
        self.active = active
        self._announcements = list(announcements)
        """INFO lines on what runs when, logged at the first check: only the processes that
        check (the training ranks) say it, once each."""
        self.engine_old_log_probs = engine_old_log_probs
        self.one_step_off = one_step_off
        self.reference = list(reference)
        self.source = source
        self.ceiling = ceiling
        self.max_ceiling = max_ceiling
        self.audit_interval = audit_interval
        self.routing_floor = routing_floor
        self._exemptions_source = exemptions
        self._exemptions: list[KLExemption] | None = None
        self._announced = False
        self._engine_log_probs: set[int] = set()
        """Rollouts whose `log_rollout_data` showed the engine's log-probs."""
        self.staleness_bound = staleness_bound
        self._off_policy_due = False
        """An audit passed and the off-policy audit after it has not run yet."""
        self._off_policy_audit: int | None = None
        """The rollout of the latest off-policy audit (its steps report the replay too)."""
        self._first_audit: int | None = None
        """The first audit rollout this process scored: 0 in a run from the start, a later one
        in a run resumed from a checkpoint."""

    def exemptions(self) -> list[KLExemption]:
        """The exemptions the enabled plugins reported (asked once, then cached)."""
        if self._exemptions is None:
            self._exemptions = list(self._exemptions_source())
        return self._exemptions

    def _announce(self) -> None:
        for line in self._announcements:
            logger.info("%s", line)
        self._announcements = []

    def wants_audit(self, rollout_id: int) -> bool:
        """Whether rollout `rollout_id` is an audit iteration: rollout 0 and every
        `audit_interval` rollouts of a CI run."""
        return self.active and rollout_id % self.audit_interval == 0

    def _scored(self, rollout_id: int) -> bool:
        """The trainer's own log-probs are the rollout's old ones."""
        return not self.engine_old_log_probs or self.wants_audit(rollout_id)

    def _same_weights(self, rollout_id: int) -> bool:
        """The engine sampled the rollout from the weights the trainer holds."""
        return not self.one_step_off or self.wants_audit(rollout_id)

    def after_train_step(
        self, rollout_id: int, step_id: int, accumulated_step_id: int, metrics: Mapping[str, Any]
    ) -> None:
        """Check ppo_kl at the first step of each exact rollout, kl_loss at the first step of
        the run, the replay agreement at every step, and the mean mismatch where the step's
        old log-probs and the engine's come from the same weights."""
        if not self.active:
            return
        self._announce()
        where = f"rollout {rollout_id}, step {step_id} (accumulated step {accumulated_step_id})"
        audit = self.wants_audit(rollout_id)
        # Old and new actor log-probs come from the same weights (and, under routing replay,
        # the same experts) at the first step of a rollout, so their KL is exactly zero.
        if step_id == 0 and self._scored(rollout_id):
            self._expect_zero(Check.PPO_KL, PPO_KL, metrics, where, _PPO_KL_REQUIRED, audit)
            # Per token: a mean of signed differences can cancel (tokens of a sample permuted).
            self._expect_zero(Check.PPO_KL_MAX, PPO_KL_MAX, metrics, where, _PPO_KL_REQUIRED, audit)
        # Actor and reference hold the same weights only before the first update.
        if accumulated_step_id == 0 and self._applies(KL_LOSS, metrics):
            reason = self._reference_reason()
            self._expect_zero(Check.KL_LOSS, KL_LOSS, metrics, where, reason, audit)
        if self._replaying() or REPLAY_AGREEMENT in metrics:
            off_policy = rollout_id == self._off_policy_audit
            kind = "off-policy audit" if off_policy else "audit"
            self._expect_replayed(metrics, where, (audit or off_policy) and step_id == 0, kind)
        self._engine_log_probs = {r for r in self._engine_log_probs if r >= rollout_id}
        engine = rollout_id in self._engine_log_probs
        if not self._same_weights(rollout_id):
            return  # the metric is then train/stale_rollout_logprob_abs_diff
        if not self._scored(rollout_id) and step_id > 0:
            return  # this step's log-probs, after the rollout's own updates, against the engine's
        if engine or TRAIN_MISMATCH in metrics:
            self._expect_ceiling(
                Check.TRAIN_ROLLOUT_MISMATCH,
                TRAIN_MISMATCH,
                self.ceiling,
                metrics,
                where,
                self._engine_reason(rollout_id),
                audit and step_id == 0,
            )

    def _resumed_audit(self, rollout_id: int) -> bool:
        """Rollout `rollout_id` is the first audit of a process that started after rollout 0
        (a resumed run's trainer)."""
        if not self.wants_audit(rollout_id):
            return False
        if self._first_audit is None:
            self._first_audit = rollout_id
        return rollout_id == self._first_audit and rollout_id > 0

    def wants_rebuilt_reference(self, rollout_id: int) -> bool:
        """Whether to ask for the check-only forward of a reference rebuilt from its source: at
        the first audit after a resume, where the reference came from the checkpoint (rollout
        0 compared the reference with the actor, which training has since moved), and at
        rollout 0 where the reference has a checkpoint of its own (`source`)."""
        if not (self.active and self.reference):
            return False
        resumed = self._resumed_audit(rollout_id)
        return resumed or (rollout_id == 0 and self.source is not None)

    def wants_replayed_reference(self, rollout_id: int) -> bool:
        """Whether to ask for the check-only reference forward that replays the rollout's
        routing: at rollout 0 (an audit) of a CI run with a reference, when plugins exempted
        the actor/reference checks for routing alone."""
        return (
            self.active
            and rollout_id == 0
            and bool(self.reference)
            and self.source is None
            and self._routing_only()
        )

    def after_log_rollout_data(self, rollout_id: int, metrics: Mapping[str, Any]) -> None:
        """At an audit, require its marker; at rollout 0, check that actor and reference agree
        on every counted token's log-prob (under a routing-only exemption, the reference that
        replays the rollout's routing); at the first audit after a resume, that the reference
        restored from the checkpoint agrees with one rebuilt from its source; wherever the
        trainer scored the rollout with the engine's weights, check the per-token maximum and
        the mean mismatch."""
        if not self.active:
            return
        self._announce()
        where = f"rollout {rollout_id} (log_rollout_data)"
        audit = self.wants_audit(rollout_id)
        if audit:
            self._number(
                Check.AUDIT,
                AUDIT,
                metrics,
                where,
                f"the checker asked for an audit iteration at rollout {rollout_id} (rollout 0 "
                f"and every {self.audit_interval}: {SECTION}.audit_interval)",
            )
        scored = self._scored(rollout_id)
        if rollout_id == 0 and scored and self._applies(REF_MAX_ABS_DIFF, metrics):
            self._expect_zero(
                Check.ROLLOUT_REF_LOG_PROBS,
                REF_MAX_ABS_DIFF,
                metrics,
                where,
                self._reference_reason(),
                audit,
            )
        if (
            rollout_id == 0
            and self.source is None
            and (self.wants_replayed_reference(rollout_id) or REF_REPLAYED_MAX_ABS_DIFF in metrics)
        ):
            self._expect_zero(
                Check.ROLLOUT_REF_REPLAYED_LOG_PROBS,
                REF_REPLAYED_MAX_ABS_DIFF,
                metrics,
                where,
                f"{self._reference_reason()} and every exemption excuses routing only, so the "
                "checker asked for the reference forward that replays the rollout's routing",
                audit,
            )
        if rollout_id == 0 and self.source is not None and self.reference:
            self._expect_zero(
                Check.ROLLOUT_REF_REBUILT_LOG_PROBS,
                REF_REBUILT_MAX_ABS_DIFF,
                metrics,
                where,
                f"{self._reference_reason()}, a checkpoint of its own, so the checker asked "
                "for a second reference built from it to compare the run's with",
                audit,
            )
        elif self.wants_rebuilt_reference(rollout_id) or REF_REBUILT_MAX_ABS_DIFF in metrics:
            self._expect_zero(
                Check.RESUMED_REF_LOG_PROBS,
                REF_REBUILT_MAX_ABS_DIFF,
                metrics,
                where,
                f"{self._reference_reason()} and this is the first audit after a resume, so "
                "the checker asked for a reference rebuilt from its source to compare the "
                "checkpoint's with",
                audit,
            )
        if audit and scored and self._replaying():
            self._expect_floor(
                Check.RECORDED_ROUTING,
                ROUTING_AGREEMENT,
                self.routing_floor,
                metrics,
                where,
                "a plugin replays the rollout's routing, so the audit's scoring compares the "
                "trainer's own routing with the experts the engine recorded",
            )
        if (audit and scored and self._replaying()) or SHIFTED_REPLAY_AGREEMENT in metrics:
            self._expect_one(
                Check.SHIFTED_REPLAY,
                SHIFTED_REPLAY_AGREEMENT,
                metrics,
                where,
                "a plugin replays the rollout's routing, so the audit's probe forward replays "
                "the recorded experts each moved to the next expert id, which only replay follows",
                audit,
            )
        if self.staleness_bound >= 1 or VERSIONS_BEHIND in metrics:
            self._check_versions(rollout_id, metrics, where, audit)
        if ROLLOUT_LOG_PROBS in metrics:
            self._engine_log_probs.add(rollout_id)
        if not (scored and self._same_weights(rollout_id)):
            return
        engine = ROLLOUT_LOG_PROBS in metrics
        # Per-token maxima decide: a mean hides one far token among many close ones.
        for check, name, ceiling in (
            (Check.TRAIN_ROLLOUT_MISMATCH_MAX, MISMATCH_MAX, self.max_ceiling),
            (Check.TRAIN_ROLLOUT_MISMATCH, ROLLOUT_MISMATCH, self.ceiling),
        ):
            if engine or name in metrics:
                reason = self._engine_reason(rollout_id)
                self._expect_ceiling(check, name, ceiling, metrics, where, reason, audit)

    def _check_versions(
        self, rollout_id: int, metrics: Mapping[str, Any], where: str, audit: bool
    ) -> None:
        """No sample staler than the bound, at every rollout; and after each audit, once a
        rollout holds stale samples, an off-policy audit that reports it (its training steps
        then report the replay agreement: replay is exact on experts recorded under older
        weights)."""
        check, bound = Check.RECORDED_VERSIONS, self.staleness_bound
        behind = self._number(
            check,
            VERSIONS_BEHIND,
            metrics,
            where,
            f"rollout.max_staleness={bound} lets generation run ahead, so every rollout's "
            "recorded weight versions are checked against the bound",
        )
        off_policy = self._off_policy_due and behind >= 1
        text = f"{VERSIONS_BEHIND} = {behind:g}, expected <= {bound} (rollout.max_staleness)"
        if not behind <= bound:  # NaN fails
            raise KLCheckError(check, where, metrics, text)
        if off_policy:
            self._off_policy_due = False
            self._off_policy_audit = rollout_id
            self._passed(check, where, text + ", with stale samples", "off-policy audit")
        if audit and bound >= 1:
            self._off_policy_due = True

    def _applies(self, name: str, metrics: Mapping[str, Any]) -> bool:
        """Whether an actor/reference check runs: a reference by config (or its metric logged
        anyway) that starts as the actor (no checkpoint of its own), and no plugin's
        exemption."""
        if self.source is not None:
            return False
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

    def _replaying(self) -> bool:
        """A plugin reported a routing exemption: it replays the rollout's routing."""
        return any(e.scope == ExemptionScope.ROUTING for e in self.exemptions())

    def _exempted(self) -> bool:
        exemptions = self.exemptions()
        if exemptions and not self._announced:
            self._announced = True
            reasons = "; ".join(f"{e.plugin}: {e.reason}" for e in exemptions)
            still = [str(Check.PPO_KL), str(Check.PPO_KL_MAX)]
            if self.reference and self.source is None and self._routing_only():
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

    @staticmethod
    def _passed(check: Check, where: str, text: str, kind: str = "audit") -> None:
        logger.info("ci_kl_checker: %s %s: %s passed: %s", kind, where, check, text)

    def _expect_zero(
        self,
        check: Check,
        name: str,
        metrics: Mapping[str, Any],
        where: str,
        required: str,
        report: bool = False,
    ) -> None:
        number = self._number(check, name, metrics, where, required)
        text = f"|{name}| = {abs(number):.3e}, expected < {TOLERANCE:g}"
        if not exactly_zero(number):
            raise KLCheckError(check, where, metrics, text)
        if report:
            self._passed(check, where, text)

    def _expect_replayed(
        self, metrics: Mapping[str, Any], where: str, report: bool, kind: str = "audit"
    ) -> None:
        check = Check.REPLAY_AGREEMENT
        required = (
            "a plugin replays the rollout's routing (a routing exemption), so every training "
            "forward compares the experts it used with the rollout's"
        )
        self._expect_one(check, REPLAY_AGREEMENT, metrics, where, required, report, kind)

    def _expect_one(
        self,
        check: Check,
        name: str,
        metrics: Mapping[str, Any],
        where: str,
        required: str,
        report: bool = False,
        kind: str = "audit",
    ) -> None:
        number = self._number(check, name, metrics, where, required)
        text = f"{name} = {number!r}, expected exactly 1.0"
        if not exactly_one(number):
            raise KLCheckError(check, where, metrics, text)
        if report:
            self._passed(check, where, text, kind)

    def _expect_floor(
        self,
        check: Check,
        name: str,
        floor: float,
        metrics: Mapping[str, Any],
        where: str,
        required: str,
    ) -> None:
        number = self._number(check, name, metrics, where, required)
        text = f"{name} = {number:.4f}, expected >= {floor:g} ({SECTION}.{check}_min)"
        if not at_least(number, floor):
            raise KLCheckError(check, where, metrics, text)
        self._passed(check, where, text)

    def _expect_ceiling(
        self,
        check: Check,
        name: str,
        ceiling: float,
        metrics: Mapping[str, Any],
        where: str,
        required: str,
        report: bool = False,
    ) -> None:
        number = self._number(check, name, metrics, where, required)
        key = "max_abs_diff" if check == Check.TRAIN_ROLLOUT_MISMATCH_MAX else "abs_diff"
        text = (
            f"{name} = {number:.3e}, expected <= {ceiling:g} "
            f"({SECTION}.train_rollout_logprob_{key}_threshold)"
        )
        if not at_most(number, ceiling):
            raise KLCheckError(check, where, metrics, text)
        if report:
            self._passed(check, where, text)


def engine_dtype(config: Any) -> str | None:
    """The dtype the run's engine computes in, where the config says it: the embedded engine's
    `engine.hf.dtype`, or launched SGLang servers' `engine.sglang.dtype` unless auto; None
    otherwise (an attached server's, or SGLang's own rule, is not the config's to tell)."""
    engine = _get(config, "engine")
    if engine is None:
        return None
    kind = _get(engine, "kind")
    if kind in (None, "hf"):
        return _get(_get(engine, "hf"), "dtype")
    if kind == "sglang":
        sglang = _get(engine, "sglang")
        dtype = _get(sglang, "dtype")
        return None if _get(sglang, "urls") or dtype in (None, "auto") else dtype
    return None


def max_ceiling(config: Any, section: KLCheckerConfig) -> tuple[float, str]:
    """The per-token mismatch ceiling of a run and why: the section's, or, when it is null,
    `ember certify`'s by the dtypes of the engine and the trainer and the engine's quantization."""
    if section.train_rollout_logprob_max_abs_diff_threshold is not None:
        value = section.train_rollout_logprob_max_abs_diff_threshold
        return value, f"{SECTION}.train_rollout_logprob_max_abs_diff_threshold={value:g}"
    exact = bool(_get(_get(config, "rollout"), "true_on_policy"))
    train = _get(config, "train")
    bars = mismatch_ceiling(
        engine_dtype(config),
        _get(train, "dtype"),
        exact=exact,
        quantization=_get(_get(config, "engine"), "quantization"),  # the certificate's bars
        qat=bool(_get(train, "qat")),
    )
    return bars.max, bars.why


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
    train = _get(config, "train")
    source = (
        reference_source(_get(train, "ref_load"), _get(train, "hf_load")) if reference else None
    )
    engine_old = _flag(config, "algorithm", "use_rollout_log_probs")
    rollout = _get(config, "rollout")
    # A RunConfig holds `async_` (a keyword otherwise); a mapping of the file holds `async`.
    one_step_off = bool(_get(rollout, "async_") or _get(rollout, "async"))
    bound = _get(rollout, "max_staleness")
    staleness_bound = int(one_step_off) if bound is None else int(bound)
    ceiling, why = max_ceiling(config, section)
    active = ci_test and not section.disable
    lines = []
    if active:
        lines.append(
            f"ci_kl_checker: audits at rollout 0 and every {section.audit_interval} rollouts "
            f"({SECTION}.audit_interval); the per-token mismatch ceiling is {ceiling:g} ({why})"
        )
        between = _between_audits(engine_old, one_step_off)
        if between:
            lines.append(f"ci_kl_checker: between audits, {between}")
        if staleness_bound >= 1:
            lines.append(
                f"ci_kl_checker: every rollout's recorded weight versions are at most "
                f"{staleness_bound} behind the trainer (rollout.max_staleness), and after each "
                "audit the first rollout with stale samples is an off-policy audit, which "
                f"reports them and its {Check.REPLAY_AGREEMENT} where routing is replayed"
            )
        if reference and source is not None:
            lines.append(
                f"ci_kl_checker: {Check.KL_LOSS}, {Check.ROLLOUT_REF_LOG_PROBS} and "
                f"{Check.ROLLOUT_REF_REPLAYED_LOG_PROBS} do not apply: train.ref_load={source!r} "
                "is the reference's own checkpoint, not the actor's start, so actor and "
                f"reference need not agree at rollout 0; {Check.ROLLOUT_REF_REBUILT_LOG_PROBS} "
                "compares the reference with a second one built from it instead"
            )
        if not reference:
            lines.append(
                f"ci_kl_checker: {Check.KL_LOSS} and {Check.ROLLOUT_REF_LOG_PROBS} do not apply: "
                "the config uses no reference model (algorithm.use_kl_loss=false, "
                "algorithm.kl_coef=0, no train.ref_load); they run only if their metrics are "
                "logged anyway"
            )
    if section.disable:
        logger.warning(
            "ci_kl_checker: disabled by %s.disable=true; none of its checks runs%s",
            SECTION,
            "" if ci_test else " (ci.test is false, so none would have run anyway)",
        )
    _checker = KLChecker(
        active=active,
        exemptions=plugins.kl_check_exemptions,
        reference=reference,
        source=source if reference else None,
        ceiling=section.train_rollout_logprob_abs_diff_threshold,
        max_ceiling=ceiling,
        audit_interval=section.audit_interval,
        routing_floor=section.recorded_routing_agreement_min,
        engine_old_log_probs=engine_old,
        one_step_off=one_step_off,
        staleness_bound=staleness_bound,
        announcements=lines,
    )


def _between_audits(engine_old: bool, one_step_off: bool) -> str:
    """What stands down between audits in this loop, and why; empty when nothing does."""
    parts = []
    if engine_old:
        parts.append(
            f"{Check.PPO_KL}, {Check.PPO_KL_MAX} and {Check.TRAIN_ROLLOUT_MISMATCH_MAX} stand "
            "down: "
            "algorithm.use_rollout_log_probs=true takes the old log-probs from the engine, so "
            "the trainer computes none to compare"
        )
    if one_step_off:
        parts.append(
            f"{Check.TRAIN_ROLLOUT_MISMATCH} stands down: rollout.async=true samples each "
            "rollout from weights one update older than the trainer's, so the train/rollout "
            "gap holds that update too (logged apart as train/stale_rollout_logprob_abs_diff, "
            "with rollout/staleness)"
        )
    elif engine_old:
        parts.append(
            f"{Check.TRAIN_ROLLOUT_MISMATCH} is checked at each rollout's first step only "
            "(later steps compare the rollout's own updates with the engine's log-probs)"
        )
    return "; ".join(parts)


@hookimpl
def ember_audit_rollout(rollout_id: int) -> bool:
    return _current().wants_audit(rollout_id)


@hookimpl
def ember_replayed_reference_forward(rollout_id: int) -> bool:
    return _current().wants_replayed_reference(rollout_id)


@hookimpl
def ember_rebuilt_reference_forward(rollout_id: int) -> bool:
    return _current().wants_rebuilt_reference(rollout_id)


@hookimpl
def ember_after_train_step(
    rollout_id: int, step_id: int, accumulated_step_id: int, metrics: dict[str, float]
) -> None:
    _current().after_train_step(rollout_id, step_id, accumulated_step_id, metrics)


@hookimpl
def ember_after_log_rollout_data(rollout_id: int, metrics: dict[str, float]) -> None:
    _current().after_log_rollout_data(rollout_id, metrics)
