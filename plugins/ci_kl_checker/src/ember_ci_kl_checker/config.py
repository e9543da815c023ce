"""The `ci_kl_checker` config section."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ember_core.config import check

SECTION = "ci_kl_checker"
"""Name of the section in run configs (and of the plugin)."""


@dataclass(kw_only=True, slots=True)
class KLCheckerConfig:
    """Switches of the CI checks (on-policy KL, train/rollout mismatch); they run only when
    `ci.test` is true."""

    disable: bool = False
    """Turn every check off with one warning, the mismatch ceiling too (slime's flag spares it)."""
    train_rollout_logprob_abs_diff_threshold: float = 0.1
    """Largest train/ and rollout/train_rollout_logprob_abs_diff (means) that passes (slime's:
    0.1)."""
    train_rollout_logprob_max_abs_diff_threshold: float | None = None
    """Largest rollout/train_rollout_logprob_max_abs_diff (the per-token maximum of |trainer -
    engine| log-prob at audits) that passes; null: 0 under `rollout.true_on_policy`, 5e-4 when
    the engine (the embedded one, or launched SGLang servers) and the trainer both compute in
    float32, 2.0 otherwise (the per-token bars of `ember certify`, measured on SmolLM2:
    docs/certify.md)."""
    recorded_routing_agreement_min: float = 0.5
    """Smallest rollout/routing_agreement that passes at audits under routing replay: the
    share of (token, MoE layer) routings where the trainer's own top-k expert set, before
    replay, equals the set the engine recorded. Kernel and precision differences flip only
    near-tied experts; experts recorded for another layer, position or model agree about as
    often as chance (1 / C(experts, top-k)), which replay would then train on unnoticed."""
    audit_interval: int = 50
    """Audit rollout 0 and every this many rollouts: the engine samples from the trainer's
    weights (the overlap drains) and the trainer scores the rollout itself, so every check is
    exact there."""

    def __post_init__(self) -> None:
        check(isinstance(self.disable, bool), "disable", self.disable, "true or false")
        for key in (
            "train_rollout_logprob_abs_diff_threshold",
            "train_rollout_logprob_max_abs_diff_threshold",
        ):
            ceiling = getattr(self, key)
            if ceiling is None and key.startswith("train_rollout_logprob_max"):
                continue
            number = isinstance(ceiling, int | float) and not isinstance(ceiling, bool)
            check(
                number and math.isfinite(ceiling) and ceiling >= 0,
                key,
                ceiling,
                "a finite number >= 0" + (" or null" if "max" in key else ""),
            )
        floor = self.recorded_routing_agreement_min
        check(
            isinstance(floor, int | float) and not isinstance(floor, bool) and 0 <= floor <= 1,
            "recorded_routing_agreement_min",
            floor,
            "a number in [0, 1]",
        )
        interval = self.audit_interval
        check(
            isinstance(interval, int) and not isinstance(interval, bool) and interval >= 1,
            "audit_interval",
            interval,
            "an integer >= 1",
        )
