"""The error a failed CI check raises."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any


class Check(enum.StrEnum):
    """The checks, by the name errors and log lines use."""

    PPO_KL = "first_step_ppo_kl"
    """|train/ppo_kl| < tolerance at the first step of every rollout."""
    PPO_KL_MAX = "first_step_ppo_kl_max"
    """train/ppo_kl_abs_max (max over tokens of |old - training| log-prob) < tolerance at the
    first step of every rollout where ppo_kl is checked: a signed mean can cancel."""
    KL_LOSS = "first_step_kl_loss"
    """|train/kl_loss| < tolerance at the first step of the run, unless exempted."""
    ROLLOUT_REF_LOG_PROBS = "first_rollout_ref_log_probs"
    """rollout/log_probs_ref_max_abs_diff (max over tokens of |actor - reference| log-prob)
    < tolerance at rollout 0, unless exempted."""
    ROLLOUT_REF_REPLAYED_LOG_PROBS = "first_rollout_ref_replayed_log_probs"
    """rollout/ref_replayed_log_probs_max_abs_diff (max over tokens of |actor - reference|
    log-prob, the reference replaying the rollout's routing in a check-only forward) < tolerance
    at rollout 0, when every exemption excuses routing only."""
    ROLLOUT_REF_REBUILT_LOG_PROBS = "first_rollout_ref_rebuilt_log_probs"
    """rollout/ref_rebuilt_log_probs_max_abs_diff (max over tokens of |reference - reference
    rebuilt from train.ref_load| log-prob) < tolerance at rollout 0, when `train.ref_load` names
    other weights than the actor's start (`train.hf_load`): the reference is the model its
    checkpoint holds. The actor/reference checks do not apply then (an SFT reference, RL
    continued from a checkpoint)."""
    RESUMED_REF_LOG_PROBS = "resumed_ref_log_probs"
    """rollout/ref_rebuilt_log_probs_max_abs_diff (max over tokens of |reference - reference
    rebuilt from its source| log-prob) < tolerance at the first audit after a resume: the
    reference restored from the checkpoint is the one the run started from."""
    TRAIN_ROLLOUT_MISMATCH = "train_rollout_mismatch_ceiling"
    """train/ and rollout/train_rollout_logprob_abs_diff <= the configured ceiling, wherever
    engine and trainer held the same weights."""
    TRAIN_ROLLOUT_MISMATCH_MAX = "train_rollout_mismatch_max"
    """rollout/train_rollout_logprob_max_abs_diff (max over tokens of |trainer - engine|
    log-prob) <= the per-token ceiling, wherever the trainer scored the rollout with the
    engine's weights (every audit)."""
    REPLAY_AGREEMENT = "replay_agreement"
    """train/replay_agreement == 1.0 at every step, when a plugin replays the rollout's
    routing: the experts each training forward used are the rollout's."""
    SHIFTED_REPLAY = "shifted_replay_agreement"
    """rollout/shifted_replay_agreement == 1.0 at every audit, when a plugin replays the
    rollout's routing: the audit's probe forward, given the engine's experts each moved to the
    next expert id (experts no router picks by itself), used exactly those. Replay agreement on
    the engine's own experts holds without replay too wherever the trainer's routing agrees
    with the engine's (float32, in-turn runs)."""
    RECORDED_ROUTING = "recorded_routing_agreement"
    """rollout/routing_agreement (the trainer's own top-k expert sets, before replay, against the
    experts the engine recorded) >= recorded_routing_agreement_min at every audit, when a plugin
    replays the rollout's routing: replay agreement alone passes experts recorded wrongly."""
    RECORDED_VERSIONS = "recorded_versions"
    """rollout/versions_behind_max (the most updates the trainer is ahead of a sample's
    recorded weight version) <= rollout.max_staleness at every rollout, and >= 1 at the
    off-policy audit: the first rollout after each audit that holds stale samples, when the
    loop lets generation run ahead (max_staleness >= 1). Its steps report the replay agreement
    too: replay stays exact on experts recorded under older weights."""
    AUDIT = "audit"
    """rollout/audit is logged at every rollout the checker asked to audit."""


class KLCheckError(AssertionError):
    """A CI check failed: the first update did not start exactly on-policy, trainer and engine
    disagree by more than the ceiling, or a metric a check needs was not logged.

    Attributes:
        check: Which check failed (a `Check` value).
        step: Where it failed, e.g. "rollout 0, step 0 (accumulated step 0)".
        metrics: The whole metric dict the check read.
    """

    def __init__(self, check: str, step: str, metrics: Mapping[str, Any], detail: str) -> None:
        self.check = str(check)
        self.step = step
        self.metrics = dict(metrics)
        self.detail = detail
        super().__init__(
            f"ci_kl_checker: check {self.check} failed at {step}: {detail}; "
            f"metrics: {self.metrics!r}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuild from the fields, not from the message, so the error crosses process
        # boundaries (Ray workers) intact.
        return (type(self), (self.check, self.step, self.metrics, self.detail))
