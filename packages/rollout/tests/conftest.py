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


@pytest.fixture(scope="module")
def real_sglang(tmp_path_factory):
    """The real SGLang server on CPU serving Ember's tiny-moe export (`sglang_real.RealServer`);
    skipped, with the install command, where the sglang extra is not installed. One per test
    module: the server holds about 3.7 GB and its processes, so it goes when the module's tests
    are done."""
    from ember_rollout import sglang_cpu

    if not sglang_cpu.sglang_installed():
        pytest.skip(f"needs the real SGLang server: {sglang_cpu.EXTRA_HINT}")
    from sglang_real import launch

    engine, loop, server = launch(tmp_path_factory.mktemp("sglang"))
    try:
        yield server
    finally:
        loop.run_until_complete(engine.shutdown())
        loop.close()
