"""The truncation_mask plugin: zero the loss mask of responses cut off at the length limit."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ember_core.config import check
from ember_core.hookspecs import ConfigSection, hookimpl
from ember_core.types import Sample, SampleStatus

logger = logging.getLogger(__name__)

SECTION = "truncation_mask"
"""Name of the plugin, of its config section and of the metadata key it writes on samples."""


@dataclass(kw_only=True, slots=True)
class TruncationMaskConfig:
    """Which responses lose every loss token: those cut off at `rollout.max_response_len`."""

    buffer: int = 0
    """Also mask finished responses longer than rollout.max_response_len - buffer tokens;
    0 masks only the responses the engine cut off."""

    def __post_init__(self) -> None:
        valid = isinstance(self.buffer, int) and not isinstance(self.buffer, bool)
        check(valid and self.buffer >= 0, "buffer", self.buffer, "an integer >= 0")


_longest_kept: int | None = None
"""The longest finished response that still trains; None until `ember_configure` ran."""


def _current() -> int:
    if _longest_kept is None:
        raise RuntimeError(
            f"{SECTION}: ember_process_sample ran before ember_configure; configure the plugins "
            "(EmberPlugins.configure) before generating rollouts"
        )
    return _longest_kept


# --------------------------------------------------------------------------------------------
# Hooks
# --------------------------------------------------------------------------------------------


@hookimpl
def ember_config_section() -> ConfigSection:
    return ConfigSection(SECTION, TruncationMaskConfig)


@hookimpl
def ember_configure(config: Any, sections: dict[str, Any]) -> None:
    global _longest_kept
    section = sections.get(SECTION) or TruncationMaskConfig()
    limit = config.rollout.max_response_len
    check(
        section.buffer < limit,
        f"{SECTION}.buffer",
        section.buffer,
        f"< rollout.max_response_len={limit} (otherwise every response is masked)",
    )
    _longest_kept = limit - section.buffer
    logger.info(
        "%s: responses cut off by the engine%s train on no token",
        SECTION,
        f" or longer than {_longest_kept} tokens" if section.buffer else "",
    )


@hookimpl
def ember_process_sample(sample: Sample) -> None:
    # Runs in the rollout engine's process, before rewards: the sample still gets its reward
    # (and counts in its group's baseline); only its tokens leave the loss.
    longest_kept = _current()
    if sample.status == SampleStatus.TRUNCATED:
        reason = "truncated"
    elif sample.status == SampleStatus.COMPLETED and sample.response_length > longest_kept:
        reason = "buffer"
    else:
        return
    sample.loss_mask = [0] * sample.response_length
    sample.metadata[SECTION] = reason
