"""Shared fixtures: tiny real transformers models and the engines serving them."""

from __future__ import annotations

import pytest
import torch

from ember_rollout.config import HFEngineConfig, TinyModelConfig
from ember_rollout.families import FAMILIES, write_family_checkpoint
from ember_rollout.hf_engine import HFEngine

# Layer 1 is dense, so the routed-experts layout is checked for zeros there too.
TINY = TinyModelConfig(num_layers=3, dense_layers=[1], hidden_size=48, init_seed=7)


def make_engine(dtype: str = "float32", **kwargs) -> HFEngine:
    engine = HFEngine(HFEngineConfig(dtype=dtype, tiny=TINY, **kwargs))
    engine.load()
    return engine


@pytest.fixture(scope="session")
def fp32_engine() -> HFEngine:
    return make_engine("float32")


@pytest.fixture(scope="session")
def bf16_engine() -> HFEngine:
    return make_engine("bfloat16")


@pytest.fixture(scope="session", params=list(FAMILIES))
def family_checkpoint(request, tmp_path_factory):
    """(model_type, HF directory) of a tiny random model of each MoE family, as exported."""
    path = tmp_path_factory.mktemp(request.param)
    return request.param, write_family_checkpoint(path, request.param, seed=3)


@pytest.fixture(scope="session")
def family_engine(family_checkpoint) -> HFEngine:
    """An fp32 hf engine serving `family_checkpoint`'s directory (through `model_path`)."""
    _, path = family_checkpoint
    engine = HFEngine(HFEngineConfig(model_path=str(path), dtype="float32"))
    engine.load()
    return engine


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """Tiny models gain nothing from threads, and OpenMP spin-waits badly on busy shared cores."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
