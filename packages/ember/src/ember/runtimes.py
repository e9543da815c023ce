"""Where a run's roles live: Ray actors, each a process of its own, or objects in this process.

Both runtimes build the same actor classes (`ember.actors`, `ember.rollout_manager`) and hand
back handles that take calls the same way (`ember.calls`), so the driver and its loop are one
code for both. `choose_runtime` picks one from the config (`ray.enabled`).
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any

from ember import processes
from ember.calls import LocalActor, method_groups
from ember.layout import in_process, plan_layout
from ember.placement import Placement
from ember.quiet import VERBOSE_ENV, verbose
from ember.startup import mark

logger = logging.getLogger(__name__)


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


class LocalRuntime:
    """Every role a plain object in this process (`ember.calls.LocalActor`), on threads of its
    own. Nothing to start; the actors' threads stop at `shutdown`."""

    name = "in-process"

    def __init__(self) -> None:
        self.actors: list[LocalActor] = []

    def start(self, config: Any, threads: int) -> None:
        """Size torch's thread pool once for every role: in one process the roles share it
        (OpenMP threads are counted per calling thread, and each role's threads start from
        this count), as `actor_threads` sizes them (the same for a rank and an engine)."""
        import torch

        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)

    def placement(self, config: Any) -> Placement:
        """The layout alone: no placement groups in one process."""
        return Placement(layout=plan_layout(config))

    def create(self, actor_class: Any, options: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        """`actor_class` built in this process, under the name `role`; Ray's `options` do not
        apply here."""
        role = kwargs.pop("role")
        actor = LocalActor(actor_class, args, kwargs, name=role)
        self.actors.append(actor)
        return actor

    def log_tail(self, pid: str | None) -> str | None:
        return None

    def shutdown(self) -> None:
        for actor in self.actors:
            actor.close(wait=True)
        self.actors.clear()


class RayRuntime:
    """Every role a Ray actor, placed by the run's placement groups. Starts a local Ray (or
    joins `ray.address`) and stops only a Ray of its own."""

    name = "ray"

    def __init__(self) -> None:
        self.started = False
        """Whether `start` started Ray (rather than finding it running)."""
        self._processes: set[int] = set()
        """The processes `ray.init` started on this machine (GCS, raylet, ...): `shutdown`
        waits for everything below them too."""
        self.logs: Path | None = None
        """The log directory of the Ray session started here (workers' stderr there)."""

    def start(self, config: Any, threads: int) -> None:
        import ray

        from ember import RAY_ENV
        from ember_core.certify import PLANT_ENV

        if ray.is_initialized():
            return
        ray_cfg = config.ray
        env = {**RAY_ENV, VERBOSE_ENV: "1" if verbose() else "0"}
        if os.environ.get(PLANT_ENV):  # `ember certify --plant`: into every process of the run
            env[PLANT_ENV] = os.environ[PLANT_ENV]
        if ray_cfg.address is None:
            # The Ray started here inherits this environment, and its workers with it. A
            # runtime_env instead would cost every actor a fresh worker process set up by the
            # runtime-env agent (about 3 s each on a 2-core AMD EPYC) rather than a prestarted one.
            os.environ.update(env)
        # A joined cluster's workers have its environment; they get what only this run sets (the
        # verbosity asked for, a certifier's plant), so that a run with neither can use the
        # workers Ray keeps started. RAY_ENV is read where Ray starts, not by its workers.
        forwarded = {k: v for k, v in env.items() if k not in RAY_ENV and v not in ("", "0")}
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
            runtime_env={"env_vars": forwarded} if ray_cfg.address and forwarded else None,
            logging_level=logging.WARNING,
        )
        self.started = True
        session = getattr(context, "address_info", {}).get("session_dir")
        self.logs = Path(session) / "logs" if session else None
        self._processes = processes.children(os.getpid()) - before
        mark("driver", "ray.init done")

    def placement(self, config: Any) -> Placement:
        """The run's placement groups, granted (an impossible layout fails here)."""
        return Placement.create(config)

    def create(self, actor_class: Any, options: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        """`actor_class` as a Ray actor (`ray_actor`) with Ray's `options`."""
        kwargs.pop("role")
        return ray_actor(actor_class).options(**options).remote(*args, **kwargs)

    def log_tail(self, pid: str | None) -> str | None:
        """The last non-empty line the worker process `pid` wrote to stderr (Ray's session
        logs, on this machine), or None."""
        if not pid or self.logs is None:
            return None
        for path in sorted(self.logs.glob(f"worker-*-{pid}.err")):
            try:
                lines = [line.strip() for line in path.read_text(errors="replace").splitlines()]
            except OSError:
                continue
            lines = [line for line in lines if line and not line.startswith(":")]
            if lines:
                return lines[-1][:300]
        return None

    def shutdown(self) -> None:
        """Stop Ray if `start` started it, and wait for every process below it."""
        if not self.started:
            return
        import ray

        # Workers (and servers an engine launched) sit below Ray's own processes and exit
        # after them, on their own: wait for them.
        tree = self._processes | processes.descendants(self._processes)
        ray.shutdown()
        killed = processes.reap(tree)
        if killed:
            logger.warning("killed %d process(es) Ray left running", len(killed))
        self.started, self._processes = False, set()
        mark("driver", "ray shut down")


@functools.cache
def ray_actor(cls: type) -> Any:
    """`cls` as a Ray actor class, with a thread for each concurrency group its methods name
    (`ember.calls.concurrency_group`)."""
    import ray

    groups = sorted(set(method_groups(cls).values()))
    if not groups:
        return ray.remote(cls)
    return ray.remote(concurrency_groups=dict.fromkeys(groups, 1))(cls)


def choose_runtime(config: Any) -> tuple[LocalRuntime | RayRuntime, str]:
    """The runtime of the run (`in_process`) and the reason for it."""
    local, why = in_process(config)
    return (LocalRuntime() if local else RayRuntime()), why
