"""The `certify` plugin: what `ember certify` asks of every process of the run it builds.

The trainer scores every rollout itself (an audit: engine and trainer hold the same weights,
and the trainer's log-probs are compared with the engine's), and at rollout 0 a run that
replays routing (a plugin's routing exemption) also scores the reference with the rollout's
routing replayed, or, where the reference has a checkpoint of its own (`train.ref_load` naming
other weights than the actor's), scores the rollout with a second reference built from that
checkpoint. `ember certify` enables it; a training run has no use for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ember_core.certify import reference_source
from ember_core.hookspecs import ExemptionScope, hookimpl

_plugins: Any = None
_source: str | None = None
"""The reference's own checkpoint, where it is not the actor's start."""


@hookimpl
def ember_configure(config: Any, sections: dict[str, Any], plugins: Any) -> None:
    global _plugins, _source
    _plugins = plugins
    train = _get(config, "train")
    _source = reference_source(_get(train, "ref_load"), _get(train, "hf_load"))


def _get(node: Any, key: str) -> Any:
    """`key` of a config node, an object or a mapping (None where absent)."""
    return node.get(key) if isinstance(node, Mapping) else getattr(node, key, None)


@hookimpl
def ember_audit_rollout(rollout_id: int) -> bool:
    return True


@hookimpl
def ember_replayed_reference_forward(rollout_id: int) -> bool:
    if rollout_id != 0 or _plugins is None or _source is not None:
        return False
    return any(e.scope == ExemptionScope.ROUTING for e in _plugins.kl_check_exemptions())


@hookimpl
def ember_rebuilt_reference_forward(rollout_id: int) -> bool:
    return rollout_id == 0 and _source is not None
