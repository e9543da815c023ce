"""The RL loop on Ray: rollout -> score -> train -> push weights, with checkpoints and resume."""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.actor import ActorHandle
from tqdm import tqdm

from ember import RAY_ENV, processes
from ember.checkpoints import (
    CHECKPOINTS,
    DRIVER_STATE,
    PENDING_ROLLOUTS,
    check_unused,
    checkpoint_name,
    complete_checkpoints,
    driver_state,
    pending_rollouts,
    resume_checkpoint,
    rollout_state,
    truncate_metrics,
)
from ember.config import RunConfig, default_run_dir, dump_path, load_plugins, write_resolved
from ember.dumps import read_dump, write_dump
from ember.failures import EnginesExhausted, actor_death, kill, probe
from ember.metrics import MetricsLogger
from ember.placement import MemoryHandoff, Placement
from ember.quiet import VERBOSE_ENV, verbose
from ember.startup import mark
from ember.versions import (
    INITIAL_WEIGHT_VERSION,
    beyond_bound,
    sample_version,
    staleness_metrics,
)
from ember_core.certify import PLANT_ENV
from ember_core.plugins import EmberPlugins
from ember_core.types import Sample
from ember_rollout.rollout import RolloutBatch, prompts_of

logger = logging.getLogger(__name__)

HF_INIT = "hf_init"
"""Run subdirectory with the trainer's initial weights as an HF checkpoint (and the tokenizer)."""
PUSHED_WEIGHTS = "pushed_weights"
"""Run subdirectory of the HF checkpoints the engines load weights from (disk transport)."""


def weight_transport(config: RunConfig) -> str:
    """The transport that carries the trainer's weights to this run's engines: one of
    `ember.config.WEIGHT_TRANSPORTS` (`weights.transport`, auto resolved, checked against the
    engine kind and the placement; see `ember.config.weight_transport`)."""
    from ember.config import weight_transport as resolve

    return resolve(config)


# --------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Actors:
    train: list[Any]
    engines: list[Any]
    manager: Any = None
    """The `RolloutManager`: prompt stream, rewards and filters, over `engines`."""


def actor_threads(ray_cfg: Any, *, overlap: bool, cores: int) -> tuple[int, int]:
    """torch threads of each training rank and of each engine.

    Actors that compute at the same time share the cores: the engines with each other (every
    rollout spreads over all of them), and the engines with the training ranks when rollout
    overlaps training (`overlap`: `rollout.async`, or `ray.colocate` off). Otherwise training
    and rollout take turns, and each side gets the whole machine.
    """
    if ray_cfg.threads_per_actor:
        return ray_cfg.threads_per_actor, ray_cfg.threads_per_actor
    ranks, engines = ray_cfg.data_parallel, ray_cfg.num_engines
    if overlap:
        shared = max(1, cores // (ranks + engines))
        return shared, shared
    return max(1, cores // ranks), max(1, cores // engines)


def split_by_rank(samples: list[Sample], n_per_prompt: int, ranks: int) -> list[list[Sample]]:
    """Contiguous whole groups per data-parallel rank, so group baselines see the whole group."""
    groups = [samples[i : i + n_per_prompt] for i in range(0, len(samples), n_per_prompt)]
    if len(groups) % ranks:
        raise ValueError(
            f"{ranks} data-parallel replicas (ray.data_parallel / the model-parallel size): the "
            f"rollout has {len(groups)} prompt groups, which do not split evenly across them; make "
            "rollout.rollout_batch_size a multiple of it"
        )
    per = len(groups) // ranks
    return [[s for g in groups[r * per : (r + 1) * per] for s in g] for r in range(ranks)]


class Driver:
    """Owns the Ray actors of one run and drives the loop of DESIGN section 2."""

    def __init__(
        self, config: RunConfig, run_dir: Path | None = None, plugins: EmberPlugins | None = None
    ) -> None:
        self.config = config
        self.plugins = plugins if plugins is not None else _configured_plugins(config)
        """The run's plugins in this process (asked which rollouts to audit)."""
        self.run_dir = Path(run_dir or config.run.dir or default_run_dir(config))
        self.config.run.dir = str(self.run_dir)
        self.actors: Actors | None = None
        self._pending: dict[int, Any] = {}
        """Rollouts started ahead (ObjectRefs of `RolloutManager.generate`) or restored from a
        checkpoint (`RolloutBatch`), by rollout id."""
        self.placement: Placement | None = None
        """The run's placement groups, once built."""
        self.data_ranks: list[int] = []
        """Each training rank's data-parallel rank (its model replica), once built (empty: one
        replica per rank)."""
        self.handoff = MemoryHandoff((), (), enabled=False)
        """Who holds the shared GPUs of a colocated run; disabled until `build` knows."""
        self._started_ray = False
        """Whether `start_ray` started Ray (rather than finding it running): `shutdown` stops
        only a Ray of its own."""
        self._ray_processes: set[int] = set()
        """The processes `ray.init` started on this machine (GCS, raylet, ...): `shutdown`
        waits for everything below them too."""
        self._plotting: threading.Thread | None = None
        """The end-of-run plots, drawn while `shutdown` stops the actors and Ray."""
        self._roles: dict[str, str] = {}
        """What each actor is ("training rank 0", "rollout engine 1", "the rollout manager"),
        by actor id, for the error that names a process that died."""
        self._logs: Path | None = None
        """The log directory of the Ray session this driver started (workers' stderr there)."""
        self._regenerated: dict[int, int] = {}
        """Samples of a rollout dropped as staler than `rollout.max_staleness` (a restored
        rollout, with a lower bound than the checkpoint's run had), by rollout id."""
        self._engine_spec: dict[str, Any] = {}
        """How `build` created the engines (resolved config, threads, model path): a
        replacement is created alike."""
        self._engine_process: dict[int, tuple[int, str]] = {}
        """Each engine slot's (pid, node address), for the error that names it."""
        self._restarts: dict[int, int] = {}
        """Replacements per engine slot over this process's run."""
        self._new_restarts = 0
        """Replacements since the last rollout's metrics (`rollout/engine_restarts`)."""
        self._replaced = False
        """An engine was replaced since the last push: the next one checks its weights."""
        self._trained_version = INITIAL_WEIGHT_VERSION
        """The weight version the trainer holds (a replacement is loaded with it)."""

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

    # -- setup -------------------------------------------------------------------------------

    def start_ray(self) -> None:
        if ray.is_initialized():
            return
        ray_cfg = self.config.ray
        env = {**RAY_ENV, VERBOSE_ENV: "1" if verbose() else "0"}
        if os.environ.get(PLANT_ENV):  # `ember certify --plant`: into every process of the run
            env[PLANT_ENV] = os.environ[PLANT_ENV]
        if ray_cfg.address is None:
            # The Ray started here inherits this environment, and its workers with it. A
            # runtime_env instead would cost every actor a fresh worker process set up by the
            # runtime-env agent (about 3 s each on a 2-core AMD EPYC) rather than a prestarted one.
            os.environ.update(env)
        mark("driver", "ray.init starts")
        before = processes.children(os.getpid())
        context = ray.init(
            # "local" starts a Ray of our own: with no address, ray.init joins whatever Ray
            # another process on this machine started last (ray 2.60 worker.py).
            address=ray_cfg.address or "local",
            num_cpus=ray_cfg.num_cpus if ray_cfg.address is None else None,
            object_store_memory=(
                ray_cfg.object_store_mb * 2**20
                if ray_cfg.address is None and ray_cfg.object_store_mb is not None
                else None
            ),
            include_dashboard=False,
            log_to_driver=True,
            runtime_env=None if ray_cfg.address is None else {"env_vars": env},
            logging_level=logging.WARNING,
        )
        self._started_ray = True
        session = getattr(context, "address_info", {}).get("session_dir")
        self._logs = Path(session) / "logs" if session else None
        self._ray_processes = processes.children(os.getpid()) - before
        mark("driver", "ray.init done")

    def build(self, *, reuse_init: bool = False) -> None:
        """Create the actors: training ranks, the initial-weights export, the engines, and the
        rollout manager over them.

        Args:
            reuse_init: Keep an existing `hf_init` (on resume, where the checkpoint's weights
                are pushed next anyway); otherwise it is written from the trainer's weights.
        """
        from ember.actors import TrainRank
        from ember.rollout_manager import RolloutManager

        cfg = self.config
        ray_cfg = cfg.ray
        resolved = cfg.to_dict()
        threads, engine_threads = actor_threads(
            ray_cfg, overlap=cfg.rollout.async_ or not ray_cfg.colocate, cores=os.cpu_count() or 1
        )
        # Every GPU an actor gets comes from its placement-group bundle; an impossible layout
        # fails here, before any actor starts. CPU actors reserve nothing: the thread counts
        # above are what shares the cores.
        self.placement = placement = Placement.create(cfg)
        # A rollout-only run serves train.hf_load as it is; the others the trainer's export.
        model_dir = Path(cfg.train.hf_load) if self.rollout_only else self.init_dir
        # Every actor is created now and imports its libraries at once; the engines and the
        # manager load the model only when `start` is called, after the trainer's export.
        # Half a run (rollout_only, train_from_rollouts) leaves out the other half's actors.
        train = [
            TrainRank.options(**placement.train_options(rank)).remote(
                resolved, rank=rank, world_size=ray_cfg.data_parallel, threads=threads
            )
            for rank in range(0 if self.rollout_only else ray_cfg.data_parallel)
        ]
        self._engine_spec = {
            "config": resolved, "model_path": str(model_dir), "threads": engine_threads
        }  # fmt: skip
        engines = [self._new_engine(j) for j in range(0 if self.from_dump else ray_cfg.num_engines)]
        manager = None
        if not self.from_dump:
            manager = RolloutManager.options(**placement.manager_options()).remote(
                resolved, engines=engines, model_path=str(model_dir)
            )
        self.actors = Actors(train=train, engines=engines, manager=manager)
        named = [(a, f"training rank {i}") for i, a in enumerate(train)]
        named += [(a, f"rollout engine {j}") for j, a in enumerate(engines)]
        named += [(manager, "the rollout manager")] if manager is not None else []
        # Ray's handles carry their actor id; stand-ins (tests running actors in-process) none.
        ids = [(getattr(a, "_actor_id", None), role) for a, role in named]
        self._roles = {actor_id.hex(): role for actor_id, role in ids if actor_id is not None}
        mark("driver", "actors created")
        if train:
            # The rendezvous lives on rank 0's node, which need not be this one: ask rank 0
            # for its address before any rank initialises torch.distributed.
            init_method = ray.get(train[0].rendezvous.remote())
            mark("driver", "rank 0 answered (rendezvous)")
            self.data_ranks = ray.get([t.setup.remote(init_method) for t in train])
            mark("driver", "trainer built")
        if engines and train and not (reuse_init and _init_complete(model_dir)):
            ray.get([t.export_hf.remote(str(model_dir)) for t in train])
            ray.get(train[0].save_tokenizer.remote(str(model_dir)))
            mark("driver", "initial weights exported")
        # Colocated on GPUs, the trainer steps aside before the engines take the shared GPUs.
        self.handoff = handoff = MemoryHandoff.for_run(cfg, engines, train)
        handoff.to_rollout()
        ray.get([e.start.remote() for e in engines])
        self._engine_process = dict(enumerate(ray.get([e.process.remote() for e in engines])))
        mark("driver", "engines started")
        if manager is not None:
            ray.get(manager.start.remote())
            mark("driver", "rollout manager started")

    # -- engine failures ---------------------------------------------------------------------

    MEND_POLL_S = 1.0
    """While it waits on the manager, how often the driver asks it for failed engines."""

    def _new_engine(self, slot: int) -> Any:
        """An engine actor for `slot`, created as `build` creates them (not started)."""
        from ember.actors import engine_actor

        assert self.placement is not None
        spec = self._engine_spec
        return (
            engine_actor(self.config)
            .options(**self.placement.engine_options(slot))
            .remote(spec["config"], model_path=spec["model_path"], threads=spec["threads"])
        )

    def _tolerant(self) -> bool:
        """Whether failed engines are replaced: `fault_tolerance.enabled`, and the actors are
        Ray's (in-process stand-ins in tests neither fail nor probe)."""
        return (
            self.config.fault_tolerance.enabled
            and self.actors is not None
            and isinstance(self.actors.manager, ActorHandle)
        )

    def _get(self, pending: Any) -> Any:
        """`ray.get` of a manager call, mending failed engines while it runs (a rollout whose
        engines all failed waits for a replacement, which only this process starts)."""
        if isinstance(pending, RolloutBatch):
            return pending
        if self._tolerant():
            self._wait([pending])
        return ray.get(pending)

    def _wait(self, refs: list[Any]) -> None:
        """Wait until every call of `refs` finished, mending failed engines meanwhile."""
        pending = list(refs)
        if not self._tolerant():
            ray.wait(pending, num_returns=len(pending), fetch_local=False)
            return
        while pending:
            _, pending = ray.wait(
                pending, num_returns=len(pending), timeout=self.MEND_POLL_S, fetch_local=False
            )
            if pending:
                self._mend_engines()

    def _mend_engines(self, *, probe_all: bool = False) -> bool:
        """Replace every engine the manager found failed (and, with `probe_all`, every engine
        that fails a health probe now); returns whether one was replaced. The trainer is idle
        here (the driver waits on the manager, or is about to push).

        Raises:
            EnginesExhausted: a slot failed once more than `fault_tolerance.max_restarts`
                allows, or cannot be replaced in a colocated run.
        """
        if not self._tolerant():
            return False
        assert self.actors is not None
        ft = self.config.fault_tolerance
        manager = self.actors.manager
        failed = ray.get(manager.engine_failures.remote())
        if probe_all:
            for slot, engine in enumerate(self.actors.engines):
                if slot not in failed:
                    why = probe(engine, ft.health_check_timeout_s)
                    if why is not None:
                        ray.get(manager.fail_engine.remote(slot, why))
                        failed[slot] = why
        for slot, why in sorted(failed.items()):
            self._replace(slot, why)
        return bool(failed)

    def _replace(self, slot: int, why: str) -> None:
        """Start an engine in `slot` in place of the failed one, load the trainer's current
        weights into it and hand it to the manager; a replacement that fails to start counts
        as a failure of the slot too."""
        assert self.actors is not None
        ft = self.config.fault_tolerance
        while True:
            done = self._restarts.get(slot, 0)
            if done >= ft.max_restarts or self.handoff.enabled:
                raise EnginesExhausted(self._exhausted(slot, why, done))
            self._restarts[slot] = done + 1
            self._new_restarts += 1
            kill(self.actors.engines[slot])
            logger.warning(
                "rollout engine %d failed (%s); starting replacement %d of at most %d",
                slot, why, done + 1, ft.max_restarts,
            )  # fmt: skip
            engine = self._new_engine(slot)
            self.actors.engines[slot] = engine
            actor_id = getattr(engine, "_actor_id", None)
            if actor_id is not None:
                self._roles[actor_id.hex()] = f"rollout engine {slot}"
            started = engine.start.remote()
            ready, _ = ray.wait([started], timeout=ft.first_start_timeout_s)
            try:
                if not ready:
                    raise TimeoutError(
                        f"its replacement did not start within fault_tolerance."
                        f"first_start_timeout_s={ft.first_start_timeout_s:g}"
                    )
                ray.get(started)
                self._engine_process[slot] = ray.get(engine.process.remote())
                self._load_current(engine)
            except Exception as exc:
                death = actor_death(exc)
                mine = getattr(engine, "_actor_id", None)
                if death is not None and mine is not None and death.actor_id != mine.hex():
                    raise  # another process died (a training rank): not this slot's failure
                why = f"its replacement failed to start: {death.detail if death else exc}"
                continue
            ray.get(self.actors.manager.install_engine.remote(slot, engine))
            self._replaced = True
            logger.warning(
                "rollout engine %d replaced (pid %s), serving weight version %s",
                slot, self._engine_process[slot][0], self._trained_version,
            )  # fmt: skip
            return

    def _load_current(self, engine: Any) -> None:
        """Bring a started replacement to the weights the trainer holds now: the initial ones
        it loaded itself, or a push to it alone (attached servers always get one)."""
        assert self.actors is not None
        loaded = ray.get(engine.loaded_model_path.remote())
        if self._trained_version == INITIAL_WEIGHT_VERSION and loaded:
            return
        if self._trained_version == INITIAL_WEIGHT_VERSION:
            path = self.config.train.hf_load if self.rollout_only else str(self.init_dir)
            ray.get(engine.update_weights_from_disk.remote(path, INITIAL_WEIGHT_VERSION))
            return
        if self.rollout_only:
            raise RuntimeError("a rollout-only run has no trainer to load a replacement from")
        self._push(self._trained_version, [engine])

    def _check_replacements(self) -> None:
        """After a push that reached a replacement: every engine that can hash its weights
        serves the same bytes (the push gave each the trainer's weights)."""
        assert self.actors is not None
        self._replaced = False
        digests = ray.get([e.weights_digest.remote() for e in self.actors.engines])
        known = {slot: d for slot, d in enumerate(digests) if d is not None}
        if len(set(known.values())) > 1:
            raise RuntimeError(
                "after replacing a rollout engine, the engines serve different weights "
                f"(SHA-256 per engine slot: {known}); the push did not reach every engine"
            )
        if len(known) > 1:
            logger.info("the %d engines serve the same weights (sha256 %s...)", len(known),
                        next(iter(known.values()))[:12])  # fmt: skip

    def _exhausted(self, slot: int, why: str, restarts: int) -> str:
        """The one-line error of a slot that cannot be replaced."""
        pid, node = self._engine_process.get(slot, (None, None))
        where = f"pid {pid}" + (f" on {node}" if node else "") if pid else "pid unknown"
        if self.handoff.enabled:
            cause = "a colocated run cannot load a replacement while the others generate"
        else:
            ft_max = self.config.fault_tolerance.max_restarts
            cause = f"it was replaced {restarts} time(s), fault_tolerance.max_restarts={ft_max}"
        why = re.sub(r"^died \([^)]*\): ", "died: ", why)  # the process is named already
        parts = [f"rollout engine {slot} ({where}) failed: {why}; {cause}"]
        log = self._log_tail(str(pid) if pid else None)
        if log:
            parts.append(f"last line of its log: {log}")
        parts.append(self._resume_hint())
        return "; ".join(parts)

    # -- one iteration -----------------------------------------------------------------------

    def push_weights(self, rollout_id: int) -> None:
        """Load the actor's current weights into every engine, as version `str(rollout_id)`.

        The transport is `weight_transport(config)`. Whichever it is, the training ranks send
        the weights and the engines take them: this process only starts the calls and opens
        and closes the engines' weight-update sessions, and never holds a weight.
        """
        version = str(rollout_id)
        self._mend_engines(probe_all=True)
        while True:
            try:
                self._push(version)
                self._trained_version = version
                if self._replaced:
                    self._check_replacements()
                return
            except Exception:
                # An engine that died or hung during the push or the check after it (a
                # replacement too): replace it and push again; any other failure is the push's
                # own. Each pass uses up a restart of a slot, so a slot that keeps failing ends
                # the loop with EnginesExhausted (fault_tolerance.max_restarts).
                if not self._mend_engines(probe_all=True):
                    raise
                logger.warning(
                    "weight push %d failed on a failed engine; pushing again", rollout_id
                )

    def _push(self, version: str, engines: list[Any] | None = None) -> None:
        """The trainer's current weights, as `version`, into `engines` (None: every engine)."""
        transport = weight_transport(self.config)
        if transport == "disk":
            self._push_disk(version, engines)
        else:
            self._push_in_session(version, transport, engines)

    def _push_in_session(
        self, version: str, transport: str, engines: list[Any] | None = None
    ) -> None:
        """Broadcast or ipc, inside a weight-update session on every engine of `engines`
        (None: all; closed even when the push fails, and then the push's error is the one
        raised)."""
        assert self.actors is not None
        one_off = engines is not None
        engines = self.actors.engines if engines is None else engines
        opened: list[Any] = []
        try:
            begun = [e.begin_weight_update.remote() for e in engines]
            failed: BaseException | None = None
            for engine, ref in zip(engines, begun, strict=True):
                try:  # every answer, so that each session that opened is closed again
                    ray.get(ref)
                    opened.append(engine)
                except Exception as exc:
                    failed = failed or exc
            if failed is not None:
                raise failed
            if transport == "broadcast":
                self._push_broadcast(version, engines, one_off=one_off)
            else:
                self._push_ipc(version, engines)
        except BaseException:
            _end_sessions(opened, quiet=True)
            raise
        _end_sessions(opened)

    def _push_broadcast(self, version: str, engines: list[Any], *, one_off: bool) -> None:
        """Every rank walks the weights; the sending rank broadcasts them to `engines` (with
        `one_off`, a replacement alone, over a group of their own)."""
        assert self.actors is not None
        args = (engines, version, True) if one_off else (engines, version)
        ray.get([t.send_weights.remote(*args) for t in self.actors.train])

    def _push_ipc(self, version: str, engines: list[Any]) -> None:
        """Training rank i hands its copy to engine i, on the same GPU (`ray.colocate`), where
        engine i is one of `engines`."""
        assert self.actors is not None
        slots = self.actors.engines
        ray.get(
            [
                t.send_weights_ipc.remote(
                    slots[i] if i < len(slots) and slots[i] in engines else None, version
                )
                for i, t in enumerate(self.actors.train)
            ]
        )

    def _push_disk(self, version: str, engines: list[Any] | None = None) -> None:
        assert self.actors is not None
        # A fresh directory per version: a server never reads one that is being written, and
        # the previous one goes only after every engine has loaded the new one.
        # A replacement's load has a directory of its own, gone once it is loaded.
        root = self.run_dir / PUSHED_WEIGHTS
        name = checkpoint_name(int(version))
        target = root / (name if engines is None else f"{name}-replacement")
        ray.get([t.export_hf.remote(str(target)) for t in self.actors.train])
        into = self.actors.engines if engines is None else engines
        ray.get([e.update_weights_from_disk.remote(str(target), version) for e in into])
        for old in root.iterdir():
            if old != target or engines is not None:
                shutil.rmtree(old, ignore_errors=True)

    def load_initial_weights(self) -> None:
        """Bring every engine that did not load `hf_init` itself (attached SGLang servers) to
        the trainer's initial weights, so rollout 0 comes from them: by the run's transport
        (disk: `hf_init` itself, which such a server must be able to read)."""
        assert self.actors is not None
        engines = self.actors.engines
        loaded = ray.get([e.loaded_model_path.remote() for e in engines])
        if all(loaded):
            return
        transport = "disk" if self.rollout_only else weight_transport(self.config)
        if transport != "disk":
            # Engines that loaded hf_init get the same weights again: a broadcast or a
            # bucket goes to every engine at once. The trainer sends, so it takes the GPUs.
            self.handoff.to_training()
            self.handoff.after_training(
                lambda: self._push_in_session(INITIAL_WEIGHT_VERSION, transport)
            )
            return
        path = self.config.train.hf_load if self.rollout_only else str(self.init_dir)
        ray.get(
            [
                e.update_weights_from_disk.remote(path, INITIAL_WEIGHT_VERSION)
                for e, done in zip(engines, loaded, strict=True)
                if not done
            ]
        )

    def _start(self, rollout_id: int) -> None:
        """Start generating rollout `rollout_id` (unless it is already started or restored, or
        the run trains on dumped rollouts)."""
        assert self.actors is not None
        if self.from_dump:
            return
        if rollout_id < self.config.run.num_rollouts and rollout_id not in self._pending:
            self._pending[rollout_id] = self.actors.manager.generate.remote(rollout_id)

    def _start_ahead(self, rollout_id: int) -> None:
        """Start the rollouts after `rollout_id` that may generate now: up to
        `rollout.max_staleness` ahead, stopping before one a plugin audits (it generates at
        the start of its own iteration, from the weights the trainer holds then)."""
        for ahead in range(rollout_id + 1, rollout_id + 1 + self.config.rollout.max_staleness):
            if self.plugins.audit_rollout(ahead):
                return
            self._start(ahead)

    def _take(self, rollout_id: int) -> RolloutBatch:
        """Rollout `rollout_id`, generated now if it was not started ahead; generated again,
        from the current weights and with the same prompts (`prompts_of`), where it cannot be
        trained as it is: staler than `rollout.max_staleness` allows, or audited with samples
        from older weights than the trainer's (a rollout restored from a run with a higher
        bound, without the audit, or with another audit interval). The dropped samples are
        counted in `rollout/regenerated`."""
        assert self.actors is not None
        self._start(rollout_id)
        batch = self._get(self._pending.pop(rollout_id))
        why = self._untrainable(batch, rollout_id)
        if why:
            logger.warning("rollout %d: %s; generating it again", rollout_id, why)
            self._regenerated[rollout_id] = len(batch.samples)
            prompts = prompts_of(batch.samples)
            batch = self._get(self.actors.manager.generate.remote(rollout_id, prompts))
        return batch

    def _untrainable(self, batch: RolloutBatch, rollout_id: int) -> str | None:
        """Why rollout `rollout_id` cannot be trained as it is (None: it can). The trainer
        then holds version rollout_id - 1."""
        bound = self.config.rollout.max_staleness
        stale = beyond_bound(batch.samples, rollout_id, bound)
        if stale:
            return (
                f"{stale} of its {len(batch.samples)} samples are staler than "
                f"rollout.max_staleness={bound}"
            )
        older = sum(sample_version(s) < rollout_id - 1 for s in batch.samples)
        if older and self.plugins.audit_rollout(rollout_id):
            return (
                f"it is audited, and {older} of its {len(batch.samples)} samples come from "
                f"weights older than the trainer's (version {rollout_id - 1})"
            )
        return None

    def iteration(self, rollout_id: int) -> tuple[dict[str, float], list[dict[str, float]], dict]:
        """One RL iteration: generate (or collect) rollout `rollout_id`, score, train, push.

        With `rollout.max_staleness` k = 0 the rollout is generated now, from the weights
        trained on rollout i - 1. With k >= 1 it was started up to k iterations earlier, and
        rollouts up to i + k start before training: they generate while the trainer trains.
        The push waits for them, so the engines never change weights mid-rollout and rollout
        j comes from exactly the weights trained on rollout j - 1 - k; under
        `rollout.partial_rollouts` it does not wait, and the engines take the new weights
        between decode steps. A rollout a plugin audits (`EmberPlugins.audit_rollout`) is not
        started ahead: it generates at the start of its own iteration, from the trainer's
        current weights.
        """
        assert self.actors is not None
        timings: dict[str, float] = {}
        started = t0 = time.perf_counter()
        if self.rollout_only:
            return self._generate_only(rollout_id)
        if self.from_dump:
            source = Path(self.config.run.train_from_rollouts)
            batch = RolloutBatch(read_dump(dump_path(source, rollout_id)))
            why = self._untrainable(batch, rollout_id)
            if why:  # nothing can generate it again: trained as dumped, and said so
                logger.warning(
                    "rollout %d of %s: %s; trained as dumped (a dump from other weights, "
                    "such as a rollout-only run's, trains off-policy)",
                    rollout_id,
                    source,
                    why,
                )
        else:
            batch = self._take(rollout_id)
        waited = time.perf_counter() - t0
        self._start_ahead(rollout_id)

        t0 = time.perf_counter()
        self.handoff.to_training()
        rollout_metrics = self.score(rollout_id, batch.samples)
        timings["perf/log_probs_time"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        step_metrics = self.train(rollout_id)
        timings["perf/train_time"] = time.perf_counter() - t0

        generating = [ref for ref in self._pending.values() if not isinstance(ref, RolloutBatch)]
        if generating and not self.config.rollout.partial_rollouts:
            t0 = time.perf_counter()
            self._wait(generating)
            waited += time.perf_counter() - t0
        timings["perf/rollout_time"] = waited

        t0 = time.perf_counter()
        if self.actors.engines:
            self.handoff.after_training(lambda: self.push_weights(rollout_id))
        timings["perf/weight_push_time"] = time.perf_counter() - t0
        timings["perf/iteration_time"] = time.perf_counter() - started

        # The trainer held version rollout_id - 1 (the initial weights are -1) when it trained.
        rollout_metrics = {
            **batch.metrics,
            **rollout_metrics,
            **staleness_metrics(batch.samples, rollout_id - 1, self.config.rollout.max_staleness),
            "rollout/regenerated": float(self._regenerated.pop(rollout_id, 0)),
            "rollout/engine_restarts": float(self._new_restarts),
            **timings,
        }
        self._new_restarts = 0
        if self.config.run.dump_rollouts:
            write_dump(dump_path(self.run_dir / "rollouts", rollout_id), batch.samples)
        return rollout_metrics, step_metrics, timings

    def score(self, rollout_id: int, samples: list[Sample]) -> dict[str, float]:
        """Score rollout `rollout_id` on the training ranks (the trainer holds the GPUs): its
        rollout/* metrics, the same on every rank (reduced across data-parallel ranks; the
        ranks of one model replica, its TP, PP and CP peers, take the same shard)."""
        assert self.actors is not None
        data_ranks = self.data_ranks or list(range(len(self.actors.train)))
        shards = split_by_rank(
            samples, self.config.rollout.n_samples_per_prompt, 1 + max(data_ranks)
        )
        per_rank = [
            t.prepare.remote(rollout_id, shards[dp])
            for t, dp in zip(self.actors.train, data_ranks, strict=True)
        ]
        return ray.get(per_rank)[0]

    def train(self, rollout_id: int) -> list[dict[str, float]]:
        """Train on the rollout `score` scored last: the metrics of each optimizer step."""
        assert self.actors is not None
        step_metrics = ray.get([t.train.remote(rollout_id) for t in self.actors.train])[0]
        self._trained_version = str(rollout_id)
        return step_metrics

    def _generate_only(
        self, rollout_id: int
    ) -> tuple[dict[str, float], list[dict[str, float]], dict]:
        """A rollout-only iteration: generate and score rollout `rollout_id` from the weights
        the engines serve, and dump it; nothing trains, nothing is pushed."""
        assert self.actors is not None
        started = time.perf_counter()
        batch = self._get(self.actors.manager.generate.remote(rollout_id))
        timings = {"perf/rollout_time": time.perf_counter() - started}
        write_dump(dump_path(self.run_dir / "rollouts", rollout_id), batch.samples)
        timings["perf/iteration_time"] = time.perf_counter() - started
        return {**batch.metrics, **timings}, [], timings

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
        return self._get(self.actors.manager.evaluate.remote(rollout_id))

    # -- checkpoints -------------------------------------------------------------------------

    def save(self, rollout_id: int, accumulated_step: int) -> Path:
        """Write a checkpoint atomically: everything into a hidden directory, then one rename.

        It holds the training state, the rollout manager's prompt stream and, with
        `rollout.max_staleness` >= 1, the rollouts generating ahead, once they finish
        (`PENDING_ROLLOUTS`): the prompt stream has moved past them, and the weights they came
        from are gone.
        """
        from ember_megatron_backend.checkpoint import fsync_path, replace_dir

        assert self.actors is not None
        root = self.run_dir / CHECKPOINTS
        final = root / checkpoint_name(rollout_id)
        tmp = root / f".{checkpoint_name(rollout_id)}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        ray.get([t.save.remote(str(tmp / "train")) for t in self.actors.train])
        # The manager answers once it has finished any rollout it is generating.
        state = {
            "rollout_id": rollout_id,
            "accumulated_step": accumulated_step,
            "rollout": self._get(self.actors.manager.state_dict.remote()),
        }
        # The rollouts generating ahead finish first: their samples and versions are part of
        # the run's state (the prompt stream has moved past them).
        ahead = {j: self._get(pending) for j, pending in sorted(self._pending.items())}
        if ahead:
            with (tmp / PENDING_ROLLOUTS).open("wb") as handle:
                pickle.dump(ahead, handle)
        (tmp / DRIVER_STATE).write_text(json.dumps(state))
        replace_dir(tmp, final)
        fsync_path(root)
        for old in complete_checkpoints(self.run_dir)[: -self.config.run.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def restore(self, checkpoint: Path) -> tuple[int, int]:
        """Load a checkpoint into the actors; returns (next rollout id, accumulated step).

        Any number of engines can continue it: the prompt stream lives in the manager. The
        rollouts the checkpoint holds already generated are trained on next (each generated
        again, from its own prompts, if it is staler than this run's `rollout.max_staleness`
        or audited: `_take`).
        """
        assert self.actors is not None
        state = driver_state(checkpoint)
        stream = rollout_state(checkpoint, state)
        self.handoff.to_training()  # the trainer loads into its own memory
        ray.get([t.load.remote(str(checkpoint / "train")) for t in self.actors.train])
        ray.get(self.actors.manager.load_state_dict.remote(stream))
        self._pending.clear()
        self._pending.update(pending_rollouts(checkpoint, state["rollout_id"]))
        self._trained_version = str(state["rollout_id"])
        self.handoff.after_training(lambda: self.push_weights(state["rollout_id"]))
        truncate_metrics(self.run_dir, state["rollout_id"])
        return state["rollout_id"] + 1, state["accumulated_step"]

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
        write_resolved(cfg, self.run_dir)
        self.start_ray()
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
        if cfg.run.plot:
            # Drawn on a thread: matplotlib's import and the drawing (2.3-2.9 s on a 2-core AMD
            # EPYC) overlap `shutdown`, which mostly waits for processes to exit.
            self._plotting = threading.Thread(target=self._plot, name="ember-plots", daemon=True)
            self._plotting.start()
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
        role = self._roles.get(death.actor_id or "", death.class_name or "an actor")
        parts = [f"{role} ({death.where()}) died: {death.detail or 'Ray gives no reason'}"]
        log = self._log_tail(death.pid)
        if log:
            parts.append(f"last line of its log: {log}")
        parts.append(self._resume_hint())
        return "; ".join(parts)

    def _resume_hint(self) -> str:
        """The command that continues from the newest checkpoint, or that there is none."""
        checkpoints = complete_checkpoints(self.run_dir)
        if not checkpoints:
            return "no checkpoint was saved yet (run.save_interval): start the run again"
        rollout = int(checkpoints[-1].name.removeprefix("rollout_"))
        return (
            f"continue from the checkpoint of rollout {rollout} with: ember train "
            f"--resume {self.run_dir}"
        )

    def _log_tail(self, pid: str | None) -> str | None:
        """The last non-empty line the worker process `pid` wrote to stderr (Ray's session
        logs, on this machine), or None."""
        if not pid or self._logs is None:
            return None
        for path in sorted(self._logs.glob(f"worker-*-{pid}.err")):
            try:
                lines = [line.strip() for line in path.read_text(errors="replace").splitlines()]
            except OSError:
                continue
            lines = [line for line in lines if line and not line.startswith(":")]
            if lines:
                return lines[-1][:300]
        return None

    def _plot(self) -> None:
        from ember.plot import plot_run

        try:
            plot_run(self.run_dir)
        except Exception:  # the run's results are saved; a plot is not worth failing it
            logger.exception("plotting failed; `ember plot %s` draws the plots again", self.run_dir)
        mark("driver", "plots written")

    def shutdown(self) -> None:
        """Stop the engines and remove the placement groups; stop Ray if `start_ray` started
        it; wait for the end-of-run plots."""
        self._pending.clear()
        try:
            if self.actors is not None:
                for ref in [e.shutdown.remote() for e in self.actors.engines]:
                    try:
                        ray.get(ref)
                    except ray.exceptions.RayActorError:  # died already: nothing to stop
                        pass
        finally:
            self.actors = None
            if self.placement is not None:
                self.placement.remove()
                self.placement = None
            mark("driver", "actors shut down")
            if self._started_ray:
                # Workers (and servers an engine launched) sit below Ray's own processes and
                # exit after them, on their own: wait for them.
                tree = self._ray_processes | processes.descendants(self._ray_processes)
                ray.shutdown()
                killed = processes.reap(tree)
                if killed:
                    logger.warning("killed %d process(es) Ray left running", len(killed))
                self._started_ray, self._ray_processes = False, set()
                mark("driver", "ray shut down")
            if self._plotting is not None:
                self._plotting.join()
                self._plotting = None


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


def _end_sessions(engines: list[Any], *, quiet: bool = False) -> None:
    """Close the weight-update session of every engine; raise the first failure once all
    answered (log them instead when `quiet`: another error is on its way)."""
    refs = [e.end_weight_update.remote() for e in engines]
    errors = []
    for ref in refs:
        try:
            ray.get(ref)
        except Exception as exc:
            if quiet:
                logger.error("while closing an engine's weight-update session: %s", exc)
            errors.append(exc)
    if errors and not quiet:
        raise errors[0]


def _init_complete(model_dir: Path) -> bool:
    """Whether the export of the initial weights finished, tokenizer included (saved last)."""
    return all((model_dir / name).is_file() for name in ("config.json", "tokenizer_config.json"))
