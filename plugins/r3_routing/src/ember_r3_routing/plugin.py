"""The r3_routing plugin: Rollout Routing Replay (arXiv 2510.11370) through Ember's hooks."""

from __future__ import annotations

import dataclasses
from contextlib import AbstractContextManager
from typing import Any

from ember_core.hookspecs import (
    ConfigSection,
    ExemptionScope,
    KLExemption,
    Phase,
    Role,
    hookimpl,
)
from ember_core.types import SampleStatus
from ember_r3_routing import replay
from ember_r3_routing.config import SECTION, R3RoutingConfig
from ember_r3_routing.experts import META_KEY, REQUEST_FIELD, SERVER_FLAG, routed_experts_for

EXEMPTION_REASON = (
    "the actor replays the rollout engine's expert choices in every MoE layer while the "
    "reference routes with its own router, so the two can pick different experts for the same "
    "token and their log-probs differ from the first step (ppo_kl stays exactly zero: old and "
    "new actor log-probs replay the same experts; a reference forward that replays the same "
    "experts agrees with the actor exactly)"
)

_config: R3RoutingConfig | None = None


def _current() -> R3RoutingConfig:
    if _config is None:
        raise RuntimeError(
            "r3_routing: a hook that needs the model shape ran before ember_configure; configure "
            "the plugins (EmberPlugins.configure) first"
        )
    return _config


# --------------------------------------------------------------------------------------------
# Setup
# --------------------------------------------------------------------------------------------


@hookimpl
def ember_config_section() -> ConfigSection:
    return ConfigSection(SECTION, R3RoutingConfig)


def _model_shape(config: Any) -> dict[str, Any]:
    """The MoE shape of the run's training model, when the run config can tell it.

    A run config whose `train` section resolves its model (`train.model_config()`, as the
    Megatron backend's does) fills the shape fields left at 0; the plugin imports no backend.
    """
    resolve = getattr(getattr(config, "train", None), "model_config", None)
    if not callable(resolve):
        return {}
    model = resolve()
    return {
        "num_layers": getattr(model, "num_layers", 0),
        "num_experts": getattr(model, "num_experts", 0),
        "topk": getattr(model, "moe_router_topk", 0),
        "dense_layers": list(getattr(model, "dense_layers", ())),
    }


@hookimpl
def ember_configure(config: Any, sections: dict[str, Any]) -> None:
    global _config
    section = sections.get(SECTION)
    if section is None:
        section = R3RoutingConfig()
    if not isinstance(section, R3RoutingConfig):
        raise TypeError(
            f"sections[{SECTION!r}] must be an R3RoutingConfig, got {type(section).__name__}"
        )
    shape = _model_shape(config)
    missing = {k: v for k, v in shape.items() if not getattr(section, k) and v}
    if missing:
        section = dataclasses.replace(section, **missing)
    section.require_shape()
    _config = section


@hookimpl
def ember_model_config(role: Role, model_config: Any) -> None:
    replay.configure_model(role, model_config, _current())


# --------------------------------------------------------------------------------------------
# Rollout
# --------------------------------------------------------------------------------------------


@hookimpl
def ember_rollout_request_fields(engine: str) -> dict[str, Any]:
    return {REQUEST_FIELD: True}


@hookimpl
def ember_rollout_server_args(engine: str) -> list[str] | None:
    return [SERVER_FLAG] if engine == "sglang" else None


@hookimpl
def ember_process_sample(sample: Any, meta_info: dict[str, Any], engine: str) -> None:
    unfinished = sample.status in (SampleStatus.ABORTED, SampleStatus.FAILED)
    if unfinished and sample.rollout_routed_experts is None and META_KEY not in meta_info:
        return  # never trained on; replay names the sample if one ever reaches training
    sample.rollout_routed_experts = routed_experts_for(sample, meta_info, _current())


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


@hookimpl
def ember_forward_context(
    role: Role, phase: Phase, batch: Any
) -> AbstractContextManager[None] | None:
    if role == Role.ACTOR or (role == Role.REF and phase == Phase.REPLAY_CHECK):
        return replay.replay_context(phase, batch, _current())
    # The reference's scoring for losses and the critic route as they would anyway.
    return None


@hookimpl
def ember_kl_check_exemptions() -> KLExemption:
    return KLExemption(SECTION, EXEMPTION_REASON, ExemptionScope.ROUTING)
