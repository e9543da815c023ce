"""The `ci_kl_checker` config section."""

from __future__ import annotations

from dataclasses import dataclass

SECTION = "ci_kl_checker"
"""Name of the section in run configs (and of the plugin)."""


@dataclass(kw_only=True, slots=True)
class KLCheckerConfig:
    """Switches of the CI on-policy KL checks; they run only when `ci.test` is true."""

    disable: bool = False
    """Turn every check off (slime's --ci-disable-kl-checker); one warning line says so."""

    def __post_init__(self) -> None:
        if not isinstance(self.disable, bool):
            raise ValueError(f"disable={self.disable!r}: expected true or false")
