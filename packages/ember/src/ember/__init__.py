"""Ember: the CLI and the Ray driver of the RL post-training framework."""

import os

RAY_ENV = {"RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "RAY_USAGE_STATS_ENABLED": "0"}
"""Ray reads these when it is imported and started. Under `uv run`, Ray would otherwise package
the working directory and re-resolve the environment for every worker."""

for _key, _value in RAY_ENV.items():
    os.environ.setdefault(_key, _value)
