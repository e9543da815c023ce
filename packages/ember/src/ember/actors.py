"""Ray actors: one per training rank (a Megatron worker) and one per rollout engine."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any

import ray
import torch

from ember.quiet import quiet_libraries, verbose
from ember_core.types import Sample

logger = logging.getLogger(__name__)


def _prepare_process(threads: int | None) -> None:
    """What every actor process does first: quiet library chatter, then size torch's pool."""
    quiet_libraries()
    if not verbose():
        # Ray logs an actor's failed __init__ with its traceback from inside the actor; the same
        # error reaches the driver, which prints it as one line (whole with `ember -v`).
        logging.getLogger("ray._raylet").setLevel(logging.CRITICAL)
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
        threads: int | None,
    ) -> None:
        _prepare_process(threads)
        from ember.config import load_config

        self.config, self.plugins = load_config(config)
        self.rank = rank
        self.world_size = world_size
        self.worker: Any = None
        self._batch = None

    def rendezvous(self) -> str:
        """The init method of the ranks' process group: this actor's node and a port free there.

        The driver asks rank 0 before any rank initialises torch.distributed, because rank 0's
        TCP store listens on the node rank 0 runs on, which need not be the driver's.
        """
        from ember_megatron_backend.parallel import free_port

        host = ray.util.get_node_ip_address()
        # torch 2.14 TCPStore: the server on rank 0 listens on every interface of its node.
        port = free_port("0.0.0.0")
        return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"

    def setup(self, init_method: str) -> int:
        """Join the ranks' process group at `init_method`, then build the Megatron worker."""
        from ember_megatron_backend.parallel import init_distributed
        from ember_megatron_backend.worker import MegatronWorker

        init_distributed(
            self.config.train.parallel,
            rank=self.rank,
            world_size=self.world_size,
            init_method=init_method,
        )
        self.worker = MegatronWorker(
            self.config.train,
            self.config.algorithm,
            self.config.rollout,
            self.plugins,
        )
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

    def hf_weights(self) -> list[tuple[str, torch.Tensor]] | None:
        """The actor's weights under HF names as CPU copies, returned by rank 0 only.

        Every rank must call it, since the gathers over TP/EP are collective: each consumes the
        whole iterator, and ranks other than 0 drop every tensor once gathered and return None.
        """
        keep = self.rank == 0
        weights = []
        for name, tensor in self.worker.hf_weights():
            if keep:
                # A copy of its own: a view into a fused parameter pickles the whole storage.
                weights.append((name, tensor.detach().to("cpu", copy=True)))
        return weights if keep else None

    def export_hf(self, path: str) -> None:
        """Write the actor as an HF checkpoint at `path` (collective; rank 0 writes)."""
        self.worker.export_hf(Path(path))

    def save(self, path: str) -> None:
        self.worker.save_checkpoint(Path(path))

    def load(self, path: str) -> None:
        self.worker.load_checkpoint(Path(path))


@ray.remote
class RolloutEngine:
    """One rollout engine with its prompt stream, scorer and group sampling.

    The engine starts from the trainer's initial weights at `model_path` (the driver's export):
    the embedded model loads them, launched SGLang servers are launched from them whatever
    `engine.sglang.model_path` says, and the model's shape (layers, top-k, context length) is
    read from there. Attached SGLang servers (`engine.sglang.urls`) hold whatever they were
    started with, so the driver loads the initial weights into them before rollout 0.
    """

    def __init__(self, config: dict[str, Any], *, model_path: str, threads: int | None) -> None:
        _prepare_process(threads)
        from ember.config import load_config
        from ember_rollout import RolloutGenerator, build_engine

        self.config, self.plugins = load_config(config)
        engine_config = self.config.engine
        sglang = engine_config.sglang
        if engine_config.kind == "sglang" and sglang.model_path not in (None, model_path):
            logger.info(
                "engine.sglang.model_path=%s is replaced by the trainer's initial weights at %s",
                sglang.model_path,
                model_path,
            )
        engine_config.hf.model_path = model_path
        sglang.model_path = model_path
        self.attached = engine_config.kind == "sglang" and bool(sglang.urls)
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

    def loaded_model_path(self) -> bool:
        """Whether the engine loaded `model_path` itself when it started (not an attached
        server's)."""
        return not self.attached

    def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]], version: str) -> None:
        """Load weights handed over in memory (through the Ray object store)."""
        self.loop.run_until_complete(
            self.engine.update_weights_from_tensors(named_tensors, weight_version=version)
        )

    def update_weights_from_disk(self, path: str, version: str) -> None:
        """Load every weight from the HF checkpoint directory `path`."""
        self.loop.run_until_complete(
            self.engine.update_weights_from_disk(path, weight_version=version)
        )

    def state_dict(self) -> dict[str, Any]:
        return self.generator.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.load_state_dict(state)

    def shutdown(self) -> None:
        self.loop.run_until_complete(self.engine.shutdown())
