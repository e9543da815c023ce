"""Ember rollout: inference engines, rewards, prompt data and group sampling."""

from ember_rollout.config import (
    DataConfig,
    EngineConfig,
    GroupSamplingConfig,
    HFEngineConfig,
    RewardConfig,
    RolloutSections,
    SGLangEngineConfig,
    TinyModelConfig,
    ToyTaskConfig,
)
from ember_rollout.engine import (
    ENGINES,
    Engine,
    EngineError,
    GenerateOutput,
    GenerateRequest,
    ModelInfo,
    SamplingParams,
    build_engine,
)
from ember_rollout.rewards import REWARDS, Scorer, group_reward, register_reward
from ember_rollout.rollout import (
    GroupRunner,
    LocalGroups,
    PromptGroup,
    RolloutBatch,
    RolloutGenerator,
)
from ember_rollout.routing import decode_routed_experts, encode_routed_experts

__all__ = [
    "ENGINES",
    "REWARDS",
    "DataConfig",
    "Engine",
    "EngineConfig",
    "EngineError",
    "GenerateOutput",
    "GenerateRequest",
    "GroupRunner",
    "GroupSamplingConfig",
    "HFEngineConfig",
    "LocalGroups",
    "ModelInfo",
    "PromptGroup",
    "RewardConfig",
    "RolloutBatch",
    "RolloutGenerator",
    "RolloutSections",
    "SGLangEngineConfig",
    "SamplingParams",
    "Scorer",
    "TinyModelConfig",
    "ToyTaskConfig",
    "build_engine",
    "decode_routed_experts",
    "encode_routed_experts",
    "group_reward",
    "register_reward",
]
