"""Ember: the CLI and the Ray driver of the RL post-training framework."""

import os

# Ray reads these when it is imported and started. Under `uv run`, Ray would otherwise package
# the working directory and re-resolve the environment for every worker.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
