"""Rollout Routing Replay (R3) for Ember: MoE training replays the rollout engine's routing."""

from ember_r3_routing.config import SECTION, R3RoutingConfig, compact_dtype
from ember_r3_routing.experts import decode_routed_experts, validate_routed_experts

__all__ = [
    "SECTION",
    "R3RoutingConfig",
    "compact_dtype",
    "decode_routed_experts",
    "validate_routed_experts",
]
