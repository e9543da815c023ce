"""Ray actors: one per training rank (a Megatron worker) and one per rollout engine."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import ray
import torch

from ember.quiet import quiet_libraries
from ember_core.types import Sample


def _prepare_process(threads: int | None) -> None:
    """What every actor process does first: quiet library chatter, then size torch's pool."""
    quiet_libraries()
    if threads:
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


@ray.remote
class TrainRank:
    """One data-parallel training rank: a torch.distributed process holding a Megatron worker.

    Each actor re-reads the resolved config and loads its own plugins: plugin modules live in the
    process that calls their hooks.
    """

    def __init__(
        self,
        config: dict[str, Any],
        *,
        rank: int,
        world_size: int,
        init_method: str,
        threads: int | None,
    ) -> None:
        _prepare_process(threads)
        from ember.config import load_config
        from ember_megatron_backend.parallel import init_distributed
        from ember_megatron_backend.worker import MegatronWorker

        self.config, self.plugins = load_config(config)
        init_distributed(
            self.config.train.parallel, rank=rank, world_size=world_size, init_method=init_method
        )
        self.rank = rank
        self.worker = MegatronWorker(
            self.config.train,
            self.config.algorithm,
            self.config.rollout,
            self.plugins,
        )
        self._batch = None

    def ready(self) -> int:
        return self.rank

    def prepare(self, rollout_id: int, samples: list[Sample]) -> dict[str, float]:
        """Score this rank's samples (ref / old log-probs, values, advantages) and log them."""
        self._batch = self.worker.prepare(rollout_id, samples)
        return self.worker.log_rollout_data(rollout_id, self._batch)

    def train(self, rollout_id: int) -> list[dict[str, float]]:
        assert self._batch is not None, "prepare() must run before train()"
        metrics = self.worker.train(rollout_id, self._batch)
        self._batch = None
        return metrics

    def hf_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The actor's weights under HF names (every rank must call: gathers are collective)."""
        return list(self.worker.hf_weights())

    def export_hf(self, path: str) -> None:
        self.worker.export_hf(Path(path))

    def save(self, path: str) -> None:
        self.worker.save_checkpoint(Path(path))

    def load(self, path: str) -> None:
        self.worker.load_checkpoint(Path(path))


@ray.remote
class RolloutEngine:
    """One rollout engine with its prompt stream, scorer and group sampling."""

    def __init__(self, config: dict[str, Any], *, model_path: str, threads: int | None) -> None:
        _prepare_process(threads)
        from ember.config import load_config
        from ember_rollout import RolloutGenerator, build_engine

        self.config, self.plugins = load_config(config)
        engine_config = self.config.engine
        if engine_config.kind == "hf":
            engine_config.hf.model_path = model_path
        if self.config.data.tokenizer_path is None:
            self.config.data.tokenizer_path = model_path
        self.loop = asyncio.new_event_loop()
        self.engine = build_engine(engine_config, plugins=self.plugins)
        self.loop.run_until_complete(self.engine.start())
        self.generator = RolloutGenerator.from_config(
            engine=self.engine,
            sampling=self.config.rollout,
            sections=self.config,
            plugins=self.plugins,
        )

    def generate(self, rollout_id: int) -> Any:
        return self.loop.run_until_complete(self.generator.generate(rollout_id))

    def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]], version: str) -> None:
        self.loop.run_until_complete(
            self.engine.update_weights_from_tensors(named_tensors, weight_version=version)
        )

    def state_dict(self) -> dict[str, Any]:
        return self.generator.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.load_state_dict(state)

    def shutdown(self) -> None:
        self.loop.run_until_complete(self.engine.shutdown())
