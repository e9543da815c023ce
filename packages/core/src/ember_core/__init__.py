"""Ember core: loss heads, RL algorithms, sample packing, config and plugin hooks."""

from ember_core.hookspecs import NAME, hookimpl, hookspec

__all__ = ["NAME", "hookimpl", "hookspec"]
