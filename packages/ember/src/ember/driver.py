"""The RL loop on Ray: rollout -> score -> train -> push weights, with checkpoints and resume."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from tqdm import tqdm

from ember import RAY_ENV
from ember.config import RunConfig, default_run_dir, write_resolved
from ember.metrics import METRICS_FILE, MetricsLogger, metrics_lines
from ember.quiet import VERBOSE_ENV, verbose
from ember_core.types import Sample

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
LATEST = "latest"
DRIVER_STATE = "driver.json"
HF_INIT = "hf_init"
"""Run subdirectory with the trainer's initial weights as an HF checkpoint (and the tokenizer)."""
PUSHED_WEIGHTS = "pushed_weights"
"""Run subdirectory of the HF checkpoints the engines load weights from (disk transport)."""
INITIAL_WEIGHT_VERSION = "-1"
"""Weight version of the initial weights; after training rollout i the version is str(i)."""

WEIGHT_TRANSPORTS: dict[str, str] = {"hf": "tensors", "sglang": "disk"}
"""How the trainer's weights reach each engine kind (other kinds: disk, which every engine
implements). tensors: rank 0's CPU copy through the Ray object store into the engine actor,
for the embedded engine that holds the model in that actor. disk: the ranks write an HF
checkpoint under the run directory and each engine loads it; SGLang servers are processes of
their own, and sglang 0.5.23 /update_weights_from_tensor takes tensor handles (CUDA IPC), not
CPU tensors from another process."""


def weight_transport(engine_kind: str) -> str:
    """The transport (`WEIGHT_TRANSPORTS`) that carries weights to engines of this kind."""
    return WEIGHT_TRANSPORTS.get(engine_kind, "disk")


# --------------------------------------------------------------------------------------------
# Checkpoints: <run>/checkpoints/rollout_000009/{train/, driver.json}, `latest` names the newest
# --------------------------------------------------------------------------------------------


def checkpoint_name(rollout_id: int) -> str:
    return f"rollout_{rollout_id:06d}"


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (a directory is complete once it has its final name)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("rollout_*") if (p / DRIVER_STATE).is_file())


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def resume_checkpoint(run_dir: Path, num_engines: int) -> Path:
    """The checkpoint a resumed run continues from: the newest complete one, checked against
    the run's `ray.num_engines`. Reads files only, so it fails before Ray starts.

    Raises:
        ValueError: The directory holds no complete checkpoint, or the checkpoint holds the
            state of a different number of rollout engines.
    """
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        raise ValueError(
            f"{run_dir}: no complete checkpoint to resume from (no {CHECKPOINTS}/rollout_*/"
            f"{DRIVER_STATE}); to start the run over, give its config.yaml a new run.dir"
        )
    _check_engines(checkpoint, _driver_state(checkpoint), num_engines)
    return checkpoint


def _driver_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / DRIVER_STATE).read_text())


def _check_engines(checkpoint: Path, state: dict[str, Any], num_engines: int) -> None:
    # Each engine owns a prompt stream and serves the rollouts whose id modulo the engine count
    # is its index, so the saved positions mean nothing to a different number of engines.
    saved = len(state["engines"])
    if saved != num_engines:
        raise ValueError(
            f"{checkpoint}: saved with {saved} rollout engine(s), but ray.num_engines="
            f"{num_engines}; resume with --set ray.num_engines={saved}"
        )


def _check_unused(run_dir: Path) -> None:
    """Refuse to start a run afresh where one already logged metrics or saved checkpoints, so
    that no rollout is logged twice and no other run's checkpoint is resumed by mistake."""
    metrics = Path(run_dir) / METRICS_FILE
    if (metrics.is_file() and metrics.stat().st_size) or complete_checkpoints(run_dir):
        raise ValueError(
            f"run.dir {run_dir} already holds a run (metrics or checkpoints); continue it with "
            f"`ember train --resume {run_dir}` or choose another run.dir"
        )


# --------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Actors:
    train: list[Any]
    engines: list[Any]


def split_by_rank(samples: list[Sample], n_per_prompt: int, ranks: int) -> list[list[Sample]]:
    """Contiguous whole groups per data-parallel rank, so group baselines see the whole group."""
    groups = [samples[i : i + n_per_prompt] for i in range(0, len(samples), n_per_prompt)]
    if len(groups) % ranks:
        raise ValueError(
            f"ray.data_parallel={ranks}: the rollout has {len(groups)} prompt groups, which do not "
            "split evenly across ranks; make rollout.rollout_batch_size a multiple of it"
        )
    per = len(groups) // ranks
    return [[s for g in groups[r * per : (r + 1) * per] for s in g] for r in range(ranks)]


class Driver:
    """Owns the Ray actors of one run and drives the loop of DESIGN section 2."""

    def __init__(self, config: RunConfig, run_dir: Path | None = None) -> None:
        self.config = config
        self.run_dir = Path(run_dir or config.run.dir or default_run_dir(config))
        self.config.run.dir = str(self.run_dir)
        self.actors: Actors | None = None

    @property
    def init_dir(self) -> Path:
        """The trainer's initial weights, which the engines start from."""
        return self.run_dir / HF_INIT

    # -- setup -------------------------------------------------------------------------------

    def start_ray(self) -> None:
        if ray.is_initialized():
            return
        ray_cfg = self.config.ray
        ray.init(
            address=ray_cfg.address,
            num_cpus=ray_cfg.num_cpus if ray_cfg.address is None else None,
            include_dashboard=False,
            log_to_driver=True,
            runtime_env={"env_vars": {**RAY_ENV, VERBOSE_ENV: "1" if verbose() else "0"}},
            logging_level=logging.WARNING,
        )

    def build(self, *, reuse_init: bool = False) -> None:
        """Create the actors: training ranks, the initial-weights export, then the engines.

        Args:
            reuse_init: Keep an existing `hf_init` (on resume, where the checkpoint's weights
                are pushed next anyway); otherwise it is written from the trainer's weights.
        """
        from ember.actors import RolloutEngine, TrainRank

        cfg = self.config
        ray_cfg = cfg.ray
        resolved = cfg.to_dict()
        cores = os.cpu_count() or 1
        threads = ray_cfg.threads_per_actor or max(1, cores // max(1, ray_cfg.data_parallel))
        # CPU actors reserve no Ray CPUs: training and rollout alternate (colocated), and the
        # thread count above is what shares the cores.
        train = [
            TrainRank.options(num_cpus=0, num_gpus=ray_cfg.gpus_per_rank).remote(
                resolved, rank=rank, world_size=ray_cfg.data_parallel, threads=threads
            )
            for rank in range(ray_cfg.data_parallel)
        ]
        # The rendezvous lives on rank 0's node, which need not be this one: ask rank 0 for
        # its address before any rank initialises torch.distributed.
        init_method = ray.get(train[0].rendezvous.remote())
        ray.get([t.setup.remote(init_method) for t in train])
        model_dir = self.init_dir
        if not (reuse_init and _init_complete(model_dir)):
            ray.get([t.export_hf.remote(str(model_dir)) for t in train])
            self._save_tokenizer(model_dir)
        engines = [
            RolloutEngine.options(num_cpus=0, num_gpus=ray_cfg.gpus_per_engine).remote(
                resolved, model_path=str(model_dir), threads=cores if ray_cfg.colocate else threads
            )
            for _ in range(ray_cfg.num_engines)
        ]
        self.actors = Actors(train=train, engines=engines)

    def _save_tokenizer(self, model_dir: Path) -> None:
        from ember_rollout.tokenizer import save_tokenizer_for_model

        save_tokenizer_for_model(self.config.data.tokenizer_path, model_dir)

    # -- one iteration -----------------------------------------------------------------------

    def push_weights(self, rollout_id: int) -> None:
        """Load the actor's current weights into every engine, as version `str(rollout_id)`.

        The transport follows the engine kind (`weight_transport`); either way the weights go
        from the training ranks to the engines without passing through this process.
        """
        push = {"tensors": self._push_tensors, "disk": self._push_disk}
        push[weight_transport(self.config.engine.kind)](rollout_id)

    def _push_tensors(self, rollout_id: int) -> None:
        assert self.actors is not None
        # Every rank takes part in the gathers; only rank 0 returns the (CPU) tensors. Ray
        # resolves a top-level ObjectRef argument inside the receiving actor, so the engines
        # fetch rank 0's result from the object store and this process never holds it.
        refs = [t.hf_weights.remote() for t in self.actors.train]
        version = str(rollout_id)
        updates = [e.update_weights.remote(refs[0], version) for e in self.actors.engines]
        ray.get(refs[1:] + updates)

    def _push_disk(self, rollout_id: int) -> None:
        assert self.actors is not None
        # A fresh directory per version: a server never reads one that is being written, and
        # the previous one goes only after every engine has loaded the new one.
        root = self.run_dir / PUSHED_WEIGHTS
        target = root / checkpoint_name(rollout_id)
        ray.get([t.export_hf.remote(str(target)) for t in self.actors.train])
        version = str(rollout_id)
        ray.get(
            [e.update_weights_from_disk.remote(str(target), version) for e in self.actors.engines]
        )
        for old in root.iterdir():
            if old != target:
                shutil.rmtree(old, ignore_errors=True)

    def load_initial_weights(self) -> None:
        """Bring every engine that did not load `hf_init` itself (attached SGLang servers) to
        the trainer's initial weights, so rollout 0 comes from them."""
        assert self.actors is not None
        engines = self.actors.engines
        loaded = ray.get([e.loaded_model_path.remote() for e in engines])
        path = str(self.init_dir)
        ray.get(
            [
                e.update_weights_from_disk.remote(path, INITIAL_WEIGHT_VERSION)
                for e, done in zip(engines, loaded, strict=True)
                if not done
            ]
        )

    def iteration(self, rollout_id: int) -> tuple[dict[str, float], list[dict[str, float]], dict]:
        assert self.actors is not None
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        engine = self.actors.engines[rollout_id % len(self.actors.engines)]
        batch = ray.get(engine.generate.remote(rollout_id))
        timings["perf/rollout_time"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        shards = split_by_rank(
            batch.samples, self.config.rollout.n_samples_per_prompt, len(self.actors.train)
        )
        # Every rank returns the same metrics, already reduced across data-parallel ranks.
        per_rank = [
            t.prepare.remote(rollout_id, s) for t, s in zip(self.actors.train, shards, strict=True)
        ]
        rollout_metrics = ray.get(per_rank)[0]
        timings["perf/log_probs_time"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        step_metrics = ray.get([t.train.remote(rollout_id) for t in self.actors.train])[0]
        timings["perf/train_time"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        self.push_weights(rollout_id)
        timings["perf/weight_push_time"] = time.perf_counter() - t0

        rollout_metrics = {**batch.metrics, **rollout_metrics, **timings}
        if self.config.run.dump_rollouts:
            self._dump(rollout_id, batch.samples)
        return rollout_metrics, step_metrics, timings

    def _dump(self, rollout_id: int, samples: list[Sample]) -> None:
        out = self.run_dir / "rollouts"
        out.mkdir(exist_ok=True)
        with (out / f"{rollout_id:06d}.jsonl").open("w") as handle:
            for s in samples:
                handle.write(
                    json.dumps(
                        {
                            "index": s.index,
                            "group_index": s.group_index,
                            "prompt": s.prompt,
                            "response": s.response,
                            "label": s.label,
                            "reward": s.reward,
                            "status": str(s.status),
                            "tokens": s.tokens,
                            "response_length": s.response_length,
                            "rollout_log_probs": s.rollout_log_probs,
                        }
                    )
                    + "\n"
                )

    # -- checkpoints -------------------------------------------------------------------------

    def save(self, rollout_id: int, accumulated_step: int) -> Path:
        """Write a checkpoint atomically: everything into a hidden directory, then one rename."""
        from ember_megatron_backend.checkpoint import fsync_path, replace_dir

        assert self.actors is not None
        root = self.run_dir / CHECKPOINTS
        final = root / checkpoint_name(rollout_id)
        tmp = root / f".{checkpoint_name(rollout_id)}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        ray.get([t.save.remote(str(tmp / "train")) for t in self.actors.train])
        state = {
            "rollout_id": rollout_id,
            "accumulated_step": accumulated_step,
            "engines": ray.get([e.state_dict.remote() for e in self.actors.engines]),
        }
        (tmp / DRIVER_STATE).write_text(json.dumps(state))
        replace_dir(tmp, final)
        fsync_path(root)
        for old in complete_checkpoints(self.run_dir)[: -self.config.run.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def restore(self, checkpoint: Path) -> tuple[int, int]:
        """Load a checkpoint into the actors; returns (next rollout id, accumulated step)."""
        assert self.actors is not None
        state = _driver_state(checkpoint)
        _check_engines(checkpoint, state, len(self.actors.engines))
        ray.get([t.load.remote(str(checkpoint / "train")) for t in self.actors.train])
        for engine, engine_state in zip(self.actors.engines, state["engines"], strict=True):
            ray.get(engine.load_state_dict.remote(engine_state))
        self.push_weights(state["rollout_id"])
        _truncate_metrics(self.run_dir, state["rollout_id"])
        return state["rollout_id"] + 1, state["accumulated_step"]

    # -- run ---------------------------------------------------------------------------------

    def run(self, *, resume: bool = False) -> Path:
        """Run (or continue) the loop to `run.num_rollouts`; returns the run directory.

        Args:
            resume: Continue from the run directory's newest complete checkpoint.

        Raises:
            ValueError: Before Ray starts: `resume` and no complete checkpoint (or one saved
                with another `ray.num_engines`); not `resume` and the directory already holds
                a run's metrics or checkpoints.
        """
        cfg = self.config
        if resume:
            checkpoint: Path | None = resume_checkpoint(self.run_dir, cfg.ray.num_engines)
        else:
            _check_unused(self.run_dir)
            checkpoint = None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_resolved(cfg, self.run_dir)
        self.start_ray()
        self.build(reuse_init=checkpoint is not None)
        start, accumulated = 0, 0
        if checkpoint is not None:
            start, accumulated = self.restore(checkpoint)  # the engines get its weights
            logger.info("resumed from %s at rollout %d", checkpoint, start)
        else:
            self.load_initial_weights()
        sink = MetricsLogger(
            self.run_dir,
            tensorboard=cfg.run.tensorboard,
            wandb_project=cfg.run.wandb_project,
            wandb_config=cfg.to_dict(),
        )
        total = cfg.run.num_rollouts
        bar = tqdm(total=total, initial=start, desc="rollouts", unit="rollout", dynamic_ncols=True)
        try:
            for rollout_id in range(start, total):
                rollout_metrics, steps, _ = self.iteration(rollout_id)
                sink.log("rollout", rollout_id, rollout_id, rollout_metrics)
                for step in steps:
                    sink.log("train", rollout_id, accumulated, step)
                    accumulated += 1
                bar.update(1)
                bar.write(summary_line(rollout_id, rollout_metrics, steps))
                interval = cfg.run.save_interval
                if interval and ((rollout_id + 1) % interval == 0 or rollout_id + 1 == total):
                    self.save(rollout_id, accumulated)
        finally:
            bar.close()
            sink.close()
        if cfg.run.plot:
            from ember.plot import plot_run

            plot_run(self.run_dir)
        return self.run_dir

    def shutdown(self) -> None:
        if self.actors is not None:
            try:
                ray.get([e.shutdown.remote() for e in self.actors.engines])
            finally:
                self.actors = None


def summary_line(rollout_id: int, rollout: dict[str, float], steps: list[dict[str, float]]) -> str:
    """One line per rollout: reward, KL, train/inference mismatch, routing, throughput."""
    last = steps[-1] if steps else {}
    parts = [
        f"rollout {rollout_id:4d}",
        f"reward {rollout.get('rollout/rewards', float('nan')):.3f}",
    ]
    if "train/kl_loss" in last:
        parts.append(f"kl {last['train/kl_loss']:.2e}")
    if "rollout/train_rollout_logprob_abs_diff" in rollout:
        parts.append(f"mismatch {rollout['rollout/train_rollout_logprob_abs_diff']:.2e}")
    if "rollout/routing_agreement" in rollout:
        routing = f"routing {rollout['rollout/routing_agreement']:.4f}"
        if "rollout/replay_agreement" in rollout:
            routing += f" (replayed {rollout['rollout/replay_agreement']:.4f})"
        parts.append(routing)
    if "perf/rollout_tokens_per_s" in rollout:
        parts.append(f"{rollout['perf/rollout_tokens_per_s']:.0f} tok/s")
    return " | ".join(parts)


def _init_complete(model_dir: Path) -> bool:
    """Whether the export of the initial weights finished, tokenizer included (saved last)."""
    return all((model_dir / name).is_file() for name in ("config.json", "tokenizer_config.json"))


def _truncate_metrics(run_dir: Path, last_rollout: int) -> None:
    """Drop the records logged after the checkpoint of `last_rollout`, which the resumed run
    logs again, so that the file holds every rollout once.

    A last line cut off by the kill is dropped with a warning; any other damaged line stops the
    resume with `FILE:LINE` (`metrics_lines`), since dropping it would lose a record silently.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return
    kept = []
    for number, text, record in metrics_lines(path):
        if record is None:
            logger.warning("%s:%d: dropped a record cut off by the kill: %.60s", path, number, text)
            continue
        rollout_id = record.get("rollout_id")
        if isinstance(rollout_id, bool) or not isinstance(rollout_id, int):
            raise ValueError(
                f"{path}:{number}: rollout_id={rollout_id!r}, expected an integer in every record"
            )
        if rollout_id <= last_rollout:
            kept.append(text)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    os.replace(tmp, path)
