"""The `certify` plugin: what `ember certify` asks of every process of the run it builds.

The trainer scores every rollout itself (an audit: engine and trainer hold the same weights,
and the trainer's log-probs are compared with the engine's), and at rollout 0 a run that
replays routing (a plugin's routing exemption) also scores the reference with the rollout's
routing replayed. `ember certify` enables it; a training run has no use for it.
"""

from __future__ import annotations

from typing import Any

from ember_core.hookspecs import ExemptionScope, hookimpl

_plugins: Any = None


@hookimpl
def ember_configure(config: Any, sections: dict[str, Any], plugins: Any) -> None:
    global _plugins
    _plugins = plugins


@hookimpl
def ember_audit_rollout(rollout_id: int) -> bool:
    return True


@hookimpl
def ember_replayed_reference_forward(rollout_id: int) -> bool:
    if rollout_id != 0 or _plugins is None:
        return False
    return any(e.scope == ExemptionScope.ROUTING for e in _plugins.kl_check_exemptions())
