"""Ember: the CLI and the Ray driver of the RL post-training framework."""
