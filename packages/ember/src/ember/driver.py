"""The RL loop's driver: it builds a run's actors (Ray actors, or objects in this process:
`ember.runtimes`), runs the loop variant the config asks for (`ember.loops`) with checkpoints
and resume (`ember.checkpoints`), and stops everything at the end. Engine mending and the
weight push are modules of their own (`ember.engine_mending`, `ember.weight_push`)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ember import calls, checkpoints
from ember.checkpoints import check_unused, resume_checkpoint
from ember.config import RunConfig, default_run_dir, load_plugins, write_resolved
from ember.engine_mending import EngineMender
from ember.failures import EnginesExhausted, actor_death, is_actor_error
from ember.loops import Iteration, Loop, loop_for
from ember.metrics import MetricsLogger
from ember.placement import MemoryHandoff, Placement
from ember.plot import PlotProcess
from ember.runtimes import actor_threads, choose_runtime
from ember.startup import mark
from ember.versions import INITIAL_WEIGHT_VERSION
from ember.weight_push import WeightPush, early_launch_source, init_complete
from ember_core.plugins import EmberPlugins
from ember_core.types import Sample

logger = logging.getLogger(__name__)

HF_INIT = "hf_init"
"""Run subdirectory with the trainer's initial weights as an HF checkpoint (and the tokenizer)."""
ENGINE_SHUTDOWN_S = 120.0
"""How long `Driver.shutdown` waits for an engine to stop before killing it."""


@dataclass(slots=True)
class Actors:
    train: list[Any]
    engines: list[Any]
    manager: Any = None
    """The `RolloutManager`: prompt stream, rewards and filters, over `engines`."""


class Driver:
    """Owns the actors of one run and drives the loop of DESIGN section 2."""

    def __init__(
        self, config: RunConfig, run_dir: Path | None = None, plugins: EmberPlugins | None = None
    ) -> None:
        self.config = config
        self.plugins = plugins if plugins is not None else _configured_plugins(config)
        """The run's plugins in this process (asked which rollouts to audit)."""
        self.run_dir = Path(run_dir or config.run.dir or default_run_dir(config))
        self.config.run.dir = str(self.run_dir)
        self.runtime, self.runtime_reason = choose_runtime(config)
        """Where the actors live (`ember.runtimes`), and why."""
        self.actors: Actors | None = None
        self.placement: Placement | None = None
        """The run's placement groups, once built."""
        self.data_ranks: list[int] = []
        """Each training rank's data-parallel rank (its model replica), once built (empty: one
        replica per rank)."""
        self.handoff = MemoryHandoff((), (), enabled=False)
        """Who holds the shared GPUs of a colocated run; disabled until `build` knows."""
        self.roles: dict[str, str] = {}
        """What each Ray actor is ("training rank 0", "rollout engine 1", "the rollout
        manager"), by actor id, for the error that names a process that died."""
        self.trained_version = INITIAL_WEIGHT_VERSION
        """The weight version the trainer holds (a replacement is loaded with it)."""
        self.mender = EngineMender(self)
        self.pusher = WeightPush(self)
        self.loop: Loop = loop_for(self)
        self._plots: PlotProcess | None = None
        """The end-of-run plots' process (`run.plot`), started with the run and drawing while
        `shutdown` stops the actors."""

    @property
    def init_dir(self) -> Path:
        """The trainer's initial weights, which the engines start from."""
        return self.run_dir / HF_INIT

    @property
    def rollout_only(self) -> bool:
        """Half a run: generate, score and dump rollouts, with no trainer (`run.rollout_only`)."""
        return self.config.run.rollout_only

    @property
    def from_dump(self) -> bool:
        """Half a run: train on dumped rollouts, with no engine (`run.train_from_rollouts`)."""
        return self.config.run.train_from_rollouts is not None

    def describe(self) -> str:
        """Where the run's roles live and why: the line `ember train` prints at start."""
        return f"actors: {self.runtime.name} ({self.runtime_reason})"

    # -- setup -------------------------------------------------------------------------------

    def _threads(self) -> tuple[int, int]:
        """torch threads of each training rank and of each engine (`actor_threads`)."""
        cfg = self.config
        overlap = cfg.rollout.async_ or not cfg.ray.colocate
        return actor_threads(cfg.ray, overlap=overlap, cores=os.cpu_count() or 1)

    def start(self) -> None:
        """Start the runtime: Ray (or join it), or size this process's torch threads."""
        self.runtime.start(self.config, self._threads()[0])

    def build(self, *, reuse_init: bool = False) -> None:
        """Create the actors: training ranks, the initial-weights export, the engines, and the
        rollout manager over them.

        Args:
            reuse_init: Keep an existing `hf_init` (on resume, where the checkpoint's weights
                are pushed next anyway); otherwise it is written from the trainer's weights.
        """
        from ember.actors import TrainRank
        from ember.rollout_manager import RolloutManager

        cfg, runtime = self.config, self.runtime
        ray_cfg = cfg.ray
        resolved = cfg.to_dict()
        threads, engine_threads = self._threads()
        # Every GPU an actor gets comes from its placement-group bundle; an impossible layout
        # fails here, before any actor starts. CPU actors reserve nothing: the thread counts
        # above are what shares the cores.
        self.placement = placement = runtime.placement(cfg)
        # A rollout-only run serves train.hf_load as it is; the others the trainer's export.
        model_dir = Path(cfg.train.hf_load) if self.rollout_only else self.init_dir
        # Every actor is created now and imports its libraries at once; the engines and the
        # manager load the model only when `start` is called, after the trainer's export.
        # Half a run (rollout_only, train_from_rollouts) leaves out the other half's actors.
        train = [
            runtime.create(
                TrainRank,
                placement.train_options(rank),
                resolved,
                rank=rank,
                world_size=ray_cfg.data_parallel,
                threads=threads,
                role=f"training rank {rank}",
            )  # fmt: skip
            for rank in range(0 if self.rollout_only else ray_cfg.data_parallel)
        ]
        self.mender.spec = {
            "config": resolved, "model_path": str(model_dir), "threads": engine_threads
        }  # fmt: skip
        engines = [
            self.mender.new_engine(j) for j in range(0 if self.from_dump else ray_cfg.num_engines)
        ]
        # Launched SGLang servers start from a checkpoint that is already there, if one is, and
        # come up while the trainer starts: they load the initial weights before rollout 0.
        source = early_launch_source(cfg, model_dir, reuse_init=reuse_init)
        launched = [e.launch.remote(str(source)) for e in engines] if source else []
        manager = None
        if not self.from_dump:
            manager = runtime.create(
                RolloutManager, placement.manager_options(), resolved, engines=engines,
                model_path=str(model_dir), role="the rollout manager",
            )  # fmt: skip
        self.actors = Actors(train=train, engines=engines, manager=manager)
        named = [(a, f"training rank {i}") for i, a in enumerate(train)]
        named += [(a, f"rollout engine {j}") for j, a in enumerate(engines)]
        named += [(manager, "the rollout manager")] if manager is not None else []
        ids = [(getattr(a, "_actor_id", None), role) for a, role in named]  # Ray's actors only
        self.roles = {actor_id.hex(): role for actor_id, role in ids if actor_id is not None}
        mark("driver", "actors created")
        if train:
            # The rendezvous lives on rank 0's node, which need not be this one: ask rank 0
            # for its address before any rank initialises torch.distributed.
            init_method = calls.get(train[0].rendezvous.remote())
            mark("driver", "rank 0 answered (rendezvous)")
            self.data_ranks = calls.get([t.setup.remote(init_method) for t in train])
            mark("driver", "trainer built")
        if engines and train and not (reuse_init and init_complete(model_dir)):
            calls.get([t.export_hf.remote(str(model_dir)) for t in train])
            calls.get(train[0].save_tokenizer.remote(str(model_dir)))
            mark("driver", "initial weights exported")
        # Colocated on GPUs, the trainer steps aside before the engines take the shared GPUs.
        self.handoff = handoff = MemoryHandoff.for_run(cfg, engines, train)
        handoff.to_rollout()
        calls.get(launched)
        calls.get([e.start.remote() for e in engines])
        self.mender.processes = dict(enumerate(calls.get([e.process.remote() for e in engines])))
        mark("driver", "engines started")
        if manager is not None:
            calls.get(manager.start.remote())
            mark("driver", "rollout manager started")

    # -- the loop's parts, as callers outside it know them -----------------------------------

    def load_initial_weights(self) -> None:
        """Bring engines that did not load `hf_init` themselves to the initial weights."""
        self.pusher.load_initial()

    def push_weights(self, rollout_id: int) -> None:
        """Load the actor's current weights into every engine, as version `str(rollout_id)`."""
        self.pusher.push(rollout_id)

    def iteration(self, rollout_id: int) -> Iteration:
        """One iteration of the run's loop variant (`ember.loops`)."""
        return self.loop.iteration(rollout_id)

    def score(self, rollout_id: int, samples: list[Sample]) -> dict[str, float]:
        return self.loop.score(rollout_id, samples)

    def train(self, rollout_id: int) -> list[dict[str, float]]:
        return self.loop.train(rollout_id)

    def save(self, rollout_id: int, accumulated_step: int) -> Path:
        return checkpoints.save(self, rollout_id, accumulated_step)

    def restore(self, checkpoint: Path) -> tuple[int, int]:
        return checkpoints.restore(self, checkpoint)

    def _eval_due(self, rollout_id: int) -> bool:
        """Evaluate after rollouts interval - 1, 2 x interval - 1, ... and after the last."""
        interval = self.config.run.eval_interval
        last = rollout_id + 1 == self.config.run.num_rollouts
        return bool(interval) and ((rollout_id + 1) % interval == 0 or last)

    def evaluate(self, rollout_id: int) -> dict[str, float]:
        """Every eval set through the engines, on the weights trained on rollout `rollout_id`
        (pushed at the end of its iteration; the manager answers after the rollouts it is
        generating ahead)."""
        assert self.actors is not None
        return self.mender.get(self.actors.manager.evaluate.remote(rollout_id))

    # -- run ---------------------------------------------------------------------------------

    def run(self, *, resume: bool = False) -> Path:
        """Run (or continue) the loop to `run.num_rollouts`; returns the run directory.

        Args:
            resume: Continue from the run directory's newest complete checkpoint.

        Raises:
            ValueError: Before Ray starts: `resume` and no complete checkpoint; not `resume`
                and the directory already holds a run's metrics or checkpoints.
        """
        cfg = self.config
        if resume:
            checkpoint: Path | None = resume_checkpoint(self.run_dir)
        else:
            check_unused(self.run_dir)
            checkpoint = None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.run.plot:  # its matplotlib import overlaps the start-up, on another core
            self._plots = PlotProcess(self.run_dir)
        write_resolved(cfg, self.run_dir)
        self.start()
        self.build(reuse_init=checkpoint is not None)
        start, accumulated = 0, 0
        if checkpoint is not None:
            start, accumulated = self.restore(checkpoint)  # the engines get its weights
            logger.info("resumed from %s at rollout %d", checkpoint, start)
        else:
            self.load_initial_weights()
        mark("driver", "initial weights loaded")
        sink = MetricsLogger(
            self.run_dir,
            tensorboard=cfg.run.tensorboard,
            wandb_project=cfg.run.wandb_project,
            wandb_config=cfg.to_dict(),
        )
        total = cfg.run.num_rollouts
        half = self.rollout_only or self.from_dump
        if half:
            logger.info(
                "%s: no checkpoints are written%s",
                "run.rollout_only (no trainer)"
                if self.rollout_only
                else f"run.train_from_rollouts={cfg.run.train_from_rollouts} (no engine)",
                "" if self.rollout_only else ", and nothing is evaluated",
            )
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
                mark("driver", f"rollout {rollout_id} trained")
                if self._eval_due(rollout_id) and self.actors.manager is not None:
                    evaluation = self.evaluate(rollout_id)
                    sink.log("eval", rollout_id, rollout_id, evaluation)
                    bar.set_postfix_str(eval_line(evaluation), refresh=False)
                    bar.write(f"eval    {rollout_id:4d} | {eval_line(evaluation)}")
                interval = 0 if half else cfg.run.save_interval
                if interval and ((rollout_id + 1) % interval == 0 or rollout_id + 1 == total):
                    self.save(rollout_id, accumulated)
                    mark("driver", f"checkpoint {rollout_id} saved")
        finally:
            bar.close()
            sink.close()
        if self._plots is not None:
            self._plots.draw()
        return self.run_dir

    def stopped_by(self, exc: BaseException) -> str | None:
        """One line for a process failure that stopped the run: which process died (role,
        pid, node), what Ray says of its exit, the last line of its log, and the command that
        continues from the newest checkpoint; an engine slot past its restarts says so. None
        for any other error."""
        if isinstance(exc, EnginesExhausted):
            return str(exc)
        death = actor_death(exc)
        if death is None:
            return None
        role = self.roles.get(death.actor_id or "", death.class_name or "an actor")
        parts = [f"{role} ({death.where()}) died: {death.detail or 'Ray gives no reason'}"]
        log = self.runtime.log_tail(death.pid)
        if log:
            parts.append(f"last line of its log: {log}")
        parts.append(self.resume_hint())
        return "; ".join(parts)

    def resume_hint(self) -> str:
        """The command that continues from the newest checkpoint, or that there is none."""
        return checkpoints.resume_hint(self.run_dir)

    def shutdown(self) -> None:
        """Stop the engines and the actors (and the placement groups); stop Ray if this run
        started it; wait for the end-of-run plots."""
        self.loop.pending.clear()
        try:
            if self.actors is not None:
                engines = self.actors.engines
                refs = [e.shutdown.remote() for e in engines]
                # An engine whose last push stopped partway holds its generation until a
                # complete one, which a stopping run never sends: a `generate` it runs then
                # waits, and its shutdown behind it. Wait a bound, then stop it for good.
                _, stuck = calls.wait(refs, num_returns=len(refs), timeout=ENGINE_SHUTDOWN_S)
                for engine, ref in zip(engines, refs, strict=True):
                    if ref in stuck:
                        logger.warning(
                            "a rollout engine did not stop within %g s; killing it",
                            ENGINE_SHUTDOWN_S,
                        )
                        calls.kill(engine)
                        continue
                    try:
                        calls.get(ref)
                    except Exception as exc:
                        if not is_actor_error(exc):
                            raise  # else: it died already, nothing to stop
        finally:
            self.actors = None
            if self.placement is not None:
                self.placement.remove()
                self.placement = None
            mark("driver", "actors shut down")
            self.runtime.shutdown()
            if self._plots is not None:
                if self._plots.finish():
                    mark("driver", "plots written")
                self._plots = None


def summary_line(rollout_id: int, rollout: dict[str, float], steps: list[dict[str, float]]) -> str:
    """One line per rollout: reward, KL, train/inference mismatch, routing, throughput."""
    last = steps[-1] if steps else {}
    parts = [
        f"rollout {rollout_id:4d}",
        f"reward {rollout.get('rollout/rewards', float('nan')):.3f}",
    ]
    if "train/kl_loss" in last:
        parts.append(f"kl {last['train/kl_loss']:.2e}")
    first = steps[0] if steps else {}
    if "rollout/train_rollout_logprob_abs_diff" in rollout:
        parts.append(f"mismatch {rollout['rollout/train_rollout_logprob_abs_diff']:.2e}")
    else:
        # Old log-probs from the engine: the first step's own log-probs against the engine's,
        # under the stale name when the samples came from older weights (the overlapped loop
        # after rollout 0), where the gap holds the update they lag behind.
        for key in ("train/train_rollout_logprob_abs_diff", "train/stale_rollout_logprob_abs_diff"):
            if key in first:
                parts.append(f"mismatch {first[key]:.2e}")
                break
    # Scored rollouts measure routing before training; otherwise the first step's forward does.
    source = rollout if "rollout/routing_agreement" in rollout else first
    prefix = "rollout" if source is rollout else "train"
    if f"{prefix}/routing_agreement" in source:
        routing = f"routing {source[f'{prefix}/routing_agreement']:.4f}"
        if f"{prefix}/replay_agreement" in source:
            routing += f" (replayed {source[f'{prefix}/replay_agreement']:.4f})"
        parts.append(routing)
    if "rollout/audit" in rollout:
        parts.append("audit")
    if "perf/rollout_tokens_per_s" in rollout:
        parts.append(f"{rollout['perf/rollout_tokens_per_s']:.0f} tok/s")
    return " | ".join(parts)


def eval_line(metrics: dict[str, float]) -> str:
    """The eval figures of one evaluation: each set's mean reward (and pass@n)."""
    parts = []
    for key, value in metrics.items():
        if key.startswith("eval/") and (key.endswith("/reward") or "/pass@" in key):
            parts.append(f"{key[len('eval/') :]} {value:.3f}")
    return " | ".join(parts)


def _configured_plugins(config: RunConfig) -> EmberPlugins:
    """The config's enabled plugins, loaded and configured with its parsed sections."""
    plugins = load_plugins(config.plugins)
    plugins.configure(config, config.plugin_sections)
    return plugins
