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
    """Largest train/ and rollout/train_rollout_logprob_abs_diff that passes (slime's: 0.1)."""

    def __post_init__(self) -> None:
        check(isinstance(self.disable, bool), "disable", self.disable, "true or false")
        ceiling = self.train_rollout_logprob_abs_diff_threshold
        number = isinstance(ceiling, int | float) and not isinstance(ceiling, bool)
        check(
            number and math.isfinite(ceiling) and ceiling >= 0,
            "train_rollout_logprob_abs_diff_threshold",
            ceiling,
            "a finite number >= 0",
        )
