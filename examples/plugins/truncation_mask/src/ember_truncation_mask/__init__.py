"""Example Ember plugin: responses cut off at the length limit are kept out of the loss."""

from ember_truncation_mask.plugin import SECTION, TruncationMaskConfig

__all__ = ["SECTION", "TruncationMaskConfig"]
