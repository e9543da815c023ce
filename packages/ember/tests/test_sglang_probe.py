"""Health probes of SGLang engines as the driver sends them: the real `RolloutEngine` and
`SGLangEngine` in this process (`LocalActor`), attached to the in-process fake server of
`packages/rollout/tests/sglang_fake.py`, whose GET /health is what sglang 0.5.23's is: a
one-token generate, refused (the real scheduler dies) while memory is released, and as slow as
a test asks.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "rollout" / "tests"))

from engine_standins import AsRayActor, ManagerStandIn  # noqa: E402
from sglang_fake import FakeSGLang, serving  # noqa: E402

from ember import calls  # noqa: E402
from ember.actors import RolloutEngine  # noqa: E402
from ember.calls import LocalActor  # noqa: E402
from ember.config import load_config  # noqa: E402
from ember.driver import Actors, Driver  # noqa: E402
from ember.failures import probe  # noqa: E402
from ember.placement import MemoryHandoff  # noqa: E402


@pytest.fixture
def model(tmp_path) -> Path:
    from ember_rollout.config import TinyModelConfig
    from ember_rollout.models import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path / "model", TinyModelConfig(vocab_size=17))


def run_config(url: str, *overrides: str) -> Any:
    config, _ = load_config(
        "default",
        overrides=[
            "engine.kind=sglang",
            f"engine.sglang.urls=[{url}]",
            "engine.sglang.health_poll_s=0.05",
            "engine.sglang.max_retries=0",
            *overrides,
        ],
    )
    return config


def engine_actor(config: Any, model: Path) -> LocalActor:
    """A started engine actor, as `Driver.build` makes one (in this process)."""
    engine = LocalActor(
        RolloutEngine,
        (config.to_dict(),),
        {"model_path": str(model), "threads": 1},
        name="rollout engine 0",
    )
    calls.get(engine.start.remote())
    return engine


@pytest.mark.slow
def test_the_probe_gives_sglang_health_the_configured_timeout(model):
    # sglang 0.5.23 answers GET /health when the scheduler returns a one-token generate,
    # checked each second for up to 20 s: a busy healthy server may take over 10 s.
    fake = FakeSGLang()
    with serving(fake) as url:
        config = run_config(url, "fault_tolerance.health_check_timeout_s=15")
        engine = engine_actor(config, model)
        fake.health_s = 10.5
        try:
            assert probe(engine, config.fault_tolerance.health_check_timeout_s) is None
        finally:
            calls.get(engine.shutdown.remote())


class TrainerStandIn:
    """A training rank's calls in a colocated push from disk: the offloads (nothing to move on
    CPU) and the export, a copy of the model the engine serves."""

    def __init__(self, model: str) -> None:
        self.model = model

    def offload(self, part: str) -> int:
        return 0

    def reload(self) -> int:
        return 0

    def export_hf(self, path: str, pushed: bool = False) -> None:
        shutil.copytree(self.model, path)


@pytest.mark.slow
def test_a_colocated_push_probes_no_server_whose_memory_is_released(model, tmp_path):
    fake = FakeSGLang()
    with serving(fake) as url:
        config = run_config(
            url,
            "ray.gpus_per_rank=0.5",
            "ray.gpus_per_engine=0.5",
            "rollout.async=false",
            "weights.transport=disk",
            f"run.dir={tmp_path / 'run'}",
        )
        engine = engine_actor(config, model)
        rank = LocalActor(TrainerStandIn, (str(model),), {}, name="training rank 0")
        manager = LocalActor(ManagerStandIn, (), {}, name="the rollout manager")
        driver = Driver(config, tmp_path / "run")
        driver.actors = Actors(
            train=[rank],
            engines=[engine],
            manager=AsRayActor(manager),
        )
        driver.handoff = MemoryHandoff.for_run(config, [engine], [rank])
        assert driver.handoff.enabled and driver.mender.tolerant()
        try:
            for rollout_id in range(2):
                fake.calls.clear()
                driver.handoff.to_training()
                driver.handoff.after_training(lambda r=rollout_id: driver.push_weights(r))
                routes = [path for _, path in fake.calls]
                assert routes == [
                    "/release_memory_occupation",
                    "/resume_memory_occupation",  # the weights' memory: the push loads into it
                    "/update_weights_from_disk",
                    "/resume_memory_occupation",  # the KV cache and CUDA graphs
                ]
                assert fake.states[0].weight_version == str(rollout_id)
                assert fake.released == {0: set()}
            assert manager.instance.failed == {} and driver.mender.restarts == {}
            # Held memory: the probe asks the server again.
            fake.calls.clear()
            assert probe(engine, 5.0) is None
            assert [path for _, path in fake.calls] == ["/health"]
        finally:
            calls.get(engine.shutdown.remote())
