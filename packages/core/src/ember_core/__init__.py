"""Ember core: loss heads, RL algorithms, sample packing, config and plugin hooks."""
