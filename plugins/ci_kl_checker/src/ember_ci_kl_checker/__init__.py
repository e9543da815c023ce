"""CI guard that the first update of an Ember run starts exactly on-policy."""

from ember_ci_kl_checker.config import SECTION, KLCheckerConfig
from ember_ci_kl_checker.errors import Check, KLCheckError

__all__ = ["SECTION", "Check", "KLCheckError", "KLCheckerConfig"]
