"""Engine mending: failed rollout engines found (by the rollout manager or a health probe),
killed, replaced in their slot, brought to the trainer's weights and handed back to the
manager (docs/architecture.md, "Engine failures"). Only Ray actors fail apart from the run:
in one process an engine's failure is the run's, and nothing here acts."""

from __future__ import annotations

import logging
import re
from typing import Any

from ember import calls
from ember.failures import EnginesExhausted, actor_death, kill, probe
from ember.versions import INITIAL_WEIGHT_VERSION
from ember_rollout.rollout import RolloutBatch

logger = logging.getLogger(__name__)


class EngineMender:
    """Replaces the failed engines of `driver` (a `Driver`)."""

    POLL_S = 1.0
    """While it waits on the manager, how often the driver asks it for failed engines."""

    def __init__(self, driver: Any) -> None:
        self.driver = driver
        self.spec: dict[str, Any] = {}
        """How `Driver.build` created the engines (resolved config, threads, model path): a
        replacement is created alike."""
        self.processes: dict[int, tuple[int, str]] = {}
        """Each engine slot's (pid, node address), for the error that names it."""
        self.restarts: dict[int, int] = {}
        """Replacements per engine slot over this process's run."""
        self.new_restarts = 0
        """Replacements since the last rollout's metrics (`rollout/engine_restarts`)."""
        self.replaced = False
        """An engine was replaced since the last push: the next one checks its weights."""

    def new_engine(self, slot: int) -> Any:
        """An engine actor for `slot`, created as `Driver.build` creates them (not started)."""
        from ember.actors import engine_actor

        driver = self.driver
        spec = self.spec
        return driver.runtime.create(
            engine_actor(driver.config),
            driver.placement.engine_options(slot),
            spec["config"],
            model_path=spec["model_path"],
            threads=spec["threads"],
            role=f"rollout engine {slot}",
        )

    def tolerant(self) -> bool:
        """Whether failed engines are replaced: `fault_tolerance.enabled`, and the engines are
        Ray actors (an engine in this process cannot fail apart from the run)."""
        actors = self.driver.actors
        return (
            self.driver.config.fault_tolerance.enabled
            and actors is not None
            and calls.is_ray_actor(actors.manager)
        )

    def get(self, pending: Any) -> Any:
        """The result of a manager call, mending failed engines while it runs (a rollout whose
        engines all failed waits for a replacement, which only the driver starts)."""
        if isinstance(pending, RolloutBatch):
            return pending
        if self.tolerant():
            self.wait([pending])
        return calls.get(pending)

    def wait(self, refs: list[Any]) -> None:
        """Wait until every call of `refs` finished, mending failed engines meanwhile."""
        pending = list(refs)
        if not self.tolerant():
            calls.wait(pending, num_returns=len(pending), fetch_local=False)
            return
        while pending:
            _, pending = calls.wait(
                pending, num_returns=len(pending), timeout=self.POLL_S, fetch_local=False
            )
            if pending:
                self.mend()

    def mend(self, *, probe_all: bool = False) -> bool:
        """Replace every engine the manager found failed (and, with `probe_all`, every engine
        that fails a health probe now); returns whether one was replaced. The trainer is idle
        here (the driver waits on the manager, or is about to push).

        Raises:
            EnginesExhausted: a slot failed once more than `fault_tolerance.max_restarts`
                allows, or cannot be replaced in a colocated run.
        """
        if not self.tolerant():
            return False
        actors = self.driver.actors
        ft = self.driver.config.fault_tolerance
        manager = actors.manager
        failed = calls.get(manager.engine_failures.remote())
        if probe_all:
            for slot, engine in enumerate(actors.engines):
                if slot not in failed:
                    why = probe(engine, ft.health_check_timeout_s)
                    if why is not None:
                        calls.get(manager.fail_engine.remote(slot, engine, why))
                        failed[slot] = why
        for slot, why in sorted(failed.items()):
            self.replace(slot, why)
        return bool(failed)

    def replace(self, slot: int, why: str) -> None:
        """Start an engine in `slot` in place of the failed one, load the trainer's current
        weights into it and hand it to the manager; a replacement that fails to start counts
        as a failure of the slot too."""
        driver = self.driver
        actors = driver.actors
        ft = driver.config.fault_tolerance
        while True:
            done = self.restarts.get(slot, 0)
            if done >= ft.max_restarts or driver.handoff.enabled:
                raise EnginesExhausted(self.exhausted(slot, why, done))
            self.restarts[slot] = done + 1
            self.new_restarts += 1
            kill(actors.engines[slot])
            logger.warning(
                "rollout engine %d failed (%s); starting replacement %d of at most %d",
                slot, why, done + 1, ft.max_restarts,
            )  # fmt: skip
            engine = self.new_engine(slot)
            actors.engines[slot] = engine
            actor_id = getattr(engine, "_actor_id", None)
            if actor_id is not None:
                driver.roles[actor_id.hex()] = f"rollout engine {slot}"
            started = engine.start.remote()
            ready, _ = calls.wait([started], timeout=ft.first_start_timeout_s)
            try:
                if not ready:
                    raise TimeoutError(
                        f"its replacement did not start within fault_tolerance."
                        f"first_start_timeout_s={ft.first_start_timeout_s:g}"
                    )
                calls.get(started)
                self.processes[slot] = calls.get(engine.process.remote())
                self.load_current(engine)
            except Exception as exc:
                death = actor_death(exc)
                mine = getattr(engine, "_actor_id", None)
                if death is not None and mine is not None and death.actor_id != mine.hex():
                    raise  # another process died (a training rank): not this slot's failure
                why = f"its replacement failed to start: {death.detail if death else exc}"
                continue
            calls.get(actors.manager.install_engine.remote(slot, engine))
            self.replaced = True
            logger.warning(
                "rollout engine %d replaced (pid %s), serving weight version %s",
                slot, self.processes[slot][0], driver.trained_version,
            )  # fmt: skip
            return

    def load_current(self, engine: Any) -> None:
        """Bring a started replacement to the weights the trainer holds now: the initial ones
        it loaded itself, or a push to it alone (attached servers always get one)."""
        driver = self.driver
        loaded = calls.get(engine.loaded_model_path.remote())
        if driver.trained_version == INITIAL_WEIGHT_VERSION and loaded:
            return
        if driver.trained_version == INITIAL_WEIGHT_VERSION:
            path = driver.config.train.hf_load if driver.rollout_only else str(driver.init_dir)
            calls.get(engine.update_weights_from_disk.remote(path, INITIAL_WEIGHT_VERSION))
            return
        if driver.rollout_only:
            raise RuntimeError("a rollout-only run has no trainer to load a replacement from")
        driver.pusher.send(driver.trained_version, [engine])

    def check_replacements(self) -> None:
        """After a push that reached a replacement: every engine that can hash its weights
        serves the same bytes (the push gave each the trainer's weights)."""
        self.replaced = False
        digests = calls.get([e.weights_digest.remote() for e in self.driver.actors.engines])
        known = {slot: d for slot, d in enumerate(digests) if d is not None}
        if len(set(known.values())) > 1:
            raise RuntimeError(
                "after replacing a rollout engine, the engines serve different weights "
                f"(SHA-256 per engine slot: {known}); the push did not reach every engine"
            )
        if len(known) > 1:
            logger.info("the %d engines serve the same weights (sha256 %s...)", len(known),
                        next(iter(known.values()))[:12])  # fmt: skip

    def exhausted(self, slot: int, why: str, restarts: int) -> str:
        """The one-line error of a slot that cannot be replaced."""
        driver = self.driver
        pid, node = self.processes.get(slot, (None, None))
        where = f"pid {pid}" + (f" on {node}" if node else "") if pid else "pid unknown"
        if driver.handoff.enabled:
            cause = "a colocated run cannot load a replacement while the others generate"
        else:
            ft_max = driver.config.fault_tolerance.max_restarts
            cause = f"it was replaced {restarts} time(s), fault_tolerance.max_restarts={ft_max}"
        why = re.sub(r"^died \([^)]*\): ", "died: ", why)  # the process is named already
        parts = [f"rollout engine {slot} ({where}) failed: {why}; {cause}"]
        log = driver.runtime.log_tail(str(pid) if pid else None)
        if log:
            parts.append(f"last line of its log: {log}")
        parts.append(driver.resume_hint())
        return "; ".join(parts)
