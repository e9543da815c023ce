"""The rollout manager: one actor per run that owns the prompt stream, group sampling,
filters and rewards, and spreads each rollout's prompt groups over the engine actors."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from ember import calls
from ember.failures import (
    EngineFailure,
    actor_death,
    errors_held_for_start,
    is_actor_error,
    kill,
    probe,
)
from ember_core.types import Sample
from ember_rollout.rollout import PromptGroup, RolloutBatch

logger = logging.getLogger(__name__)


def assign_groups(sizes: Sequence[int], loads: Sequence[int]) -> list[int]:
    """The engine of each group: whole groups, each to the least-loaded engine.

    Args:
        sizes: Requests per group, in group order.
        loads: Requests each engine has in flight already.

    Returns:
        For each group, the index of its engine: the one with the fewest requests (in flight
        plus assigned here so far), ties to the lower index. Deterministic, so a rerun of the
        same rollout sends the same groups to the same engines.
    """
    if not loads:
        raise ValueError("assign_groups: no engines to assign groups to")
    load = list(loads)
    owners = []
    for size in sizes:
        engine = min(range(len(load)), key=lambda k: (load[k], k))
        owners.append(engine)
        load[engine] += size
    return owners


class EnginePool:
    """A `GroupRunner` over engine actors: each round's groups are split by `assign_groups`
    over the live engines, and every engine gets one `generate` call with its groups, all
    engines at once.

    With `fault_tolerance.enabled`, an engine that dies, hangs (no answer to a health probe:
    `ember.failures.probe`) or loses its servers during a call is killed and leaves the pool
    (`failed`), and its groups are generated anew on the live engines: every sample comes
    whole from one engine, with the version, log-probs and routes of that engine's forward.
    With no live engine left the pool waits until the driver installs a replacement
    (`install`). Otherwise the first failure is raised.

    It counts the requests each engine served since `start_rollout`
    (`rollout/engine{k}_requests`), and since the last `metrics` the engines that failed
    (`rollout/engine_failures`) and the requests sent again (`rollout/resent_requests`).
    """

    WAIT_FOR_ENGINE_S = 0.2
    """How often a round with no live engine looks for a replacement."""

    def __init__(self, engines: Sequence[Any], *, kind: str, fault_tolerance: Any = None) -> None:
        self.engines = list(engines)
        self._kind = kind
        self.fault_tolerance = fault_tolerance
        self.in_flight = [0] * len(self.engines)
        self.requests = [0] * len(self.engines)
        self.failed: dict[int, str] = {}
        """Slots whose engine failed and has no replacement yet, with why."""
        self.failures = 0
        self.resent = 0
        self._lock = threading.Lock()

    @property
    def kind(self) -> str:
        return self._kind

    def start_rollout(self) -> None:
        self.requests = [0] * len(self.engines)

    def metrics(self) -> dict[str, float]:
        """The rollout's figures; failures and re-sent requests since the last call (a failure
        found between rollouts counts in the next one)."""
        out = {f"rollout/engine{k}_requests": float(n) for k, n in enumerate(self.requests)}
        with self._lock:
            out["rollout/engine_failures"] = float(self.failures)
            out["rollout/resent_requests"] = float(self.resent)
            self.failures = self.resent = 0
        return out

    def install(self, slot: int, engine: Any) -> None:
        """Put `engine` (started, holding the trainer's current weights) in `slot`."""
        with self._lock:
            self.engines[slot] = engine
            self.failed.pop(slot, None)

    def failed_slots(self) -> dict[int, str]:
        """The slots awaiting a replacement, with why (a copy, safe from any thread)."""
        with self._lock:
            return dict(self.failed)

    def fail(self, slot: int, engine: Any, reason: str) -> None:
        """Take `engine`, found failed in `slot`, out of the pool and kill it.

        Only while `engine` serves `slot`: its failure counts once, and a report that comes
        after a replacement took the slot (the driver's probe found the engine dead while a
        round still waited on its call) leaves the replacement alone, which naming the slot
        alone would kill.
        """
        with self._lock:
            if slot in self.failed or self.engines[slot] != engine:
                return  # failed, and killed, already
            self.failed[slot] = reason
            self.failures += 1
        logger.warning("rollout engine %d failed: %s; its requests go to the others", slot, reason)
        kill(engine)

    async def _live(self) -> list[tuple[int, Any]]:
        """The slots whose engine serves, each with its engine, once there is one."""
        while True:
            with self._lock:
                live = [(k, e) for k, e in enumerate(self.engines) if k not in self.failed]
            if live:
                return live
            await asyncio.sleep(self.WAIT_FOR_ENGINE_S)

    async def generate_groups(self, groups: Sequence[PromptGroup]) -> list[list[Sample]]:
        sizes = [len(g.requests) for g in groups]
        out: list[list[Sample] | None] = [None] * len(groups)
        todo = list(range(len(groups)))
        while todo:
            live = await self._live()
            owners = assign_groups([sizes[i] for i in todo], [self.in_flight[k] for k, _ in live])
            calls = []
            for j, (k, engine) in enumerate(live):
                mine = [i for i, owner in zip(todo, owners, strict=True) if owner == j]
                if mine:
                    calls.append((k, engine, mine, sum(sizes[i] for i in mine)))
            for k, _, _, load in calls:
                self.in_flight[k] += load
                self.requests[k] += load
            try:
                # One worker thread per engine call: the engines generate at the same time,
                # and this event loop waits for all of them, in whatever order they finish.
                results = await asyncio.gather(
                    *(
                        asyncio.to_thread(self._generate, k, engine, [groups[i] for i in mine])
                        for k, engine, mine, _ in calls
                    ),
                    return_exceptions=True,
                )
            finally:
                for k, _, _, load in calls:
                    self.in_flight[k] -= load
            todo = []
            for (k, engine, mine, load), result in zip(calls, results, strict=True):
                if isinstance(result, EngineFailure):
                    # The engine the call went to: a replacement may hold the slot by now.
                    self.fail(k, engine, result.reason)
                    with self._lock:
                        self.resent += load
                    todo += mine
                elif isinstance(result, BaseException):
                    raise result
                else:
                    for i, group_samples in zip(mine, result, strict=True):
                        out[i] = group_samples
            todo.sort()
        return out  # type: ignore[return-value]

    def _generate(self, slot: int, engine: Any, groups: list[PromptGroup]) -> list[list[Sample]]:
        """The samples of `groups` from `engine`, in `slot`; raises `EngineFailure` when it
        fails meanwhile (with fault tolerance on)."""
        ref = engine.generate.remote(groups)
        ft = self.fault_tolerance
        if ft is None or not ft.enabled or not calls.is_ray_actor(engine):
            return calls.get(ref)  # an engine in this process cannot fail apart from it
        while True:
            ready, _ = calls.wait([ref], timeout=ft.health_check_interval_s)
            if ready:
                try:
                    return calls.get(ref)
                except Exception as exc:
                    if is_actor_error(exc):  # a Ray actor here: Ray is imported
                        death = actor_death(exc)
                        if death is None:
                            raise
                        detail = death.detail or "Ray gives no reason"
                        raise EngineFailure(slot, f"died ({death.where()}): {detail}") from exc
                    # A server that went away fails the call; anything else is the call's own.
                    why = probe(engine, ft.health_check_timeout_s)
                    if why is None:
                        raise
                    first = str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else ""
                    raise EngineFailure(slot, f"{why} (its generate failed: {first})") from exc
            why = probe(engine, ft.health_check_timeout_s)
            if why is not None:
                raise EngineFailure(slot, why)


async def evaluate_sets(
    generator: Any, sets: dict[str, Any], run: Any, rollout_id: int
) -> dict[str, float]:
    """Every eval set through `generator` (a `RolloutGenerator`) with the run section's eval
    settings (`eval_temperature`, `eval_samples_per_prompt`); their metrics and
    `perf/eval_time`."""
    started = time.perf_counter()
    metrics: dict[str, float] = {}
    for name, records in sets.items():
        metrics.update(
            await generator.evaluate(
                name,
                records,
                rollout_id=rollout_id,
                temperature=run.eval_temperature,
                samples_per_prompt=run.eval_samples_per_prompt,
            )
        )
    metrics["perf/eval_time"] = time.perf_counter() - started
    return metrics


CONTROL_CALLS = "control"
"""The concurrency group of the manager's pool calls (failures, replacements): answered while
a rollout generates on the default thread."""


class RolloutManager:
    """Generates rollouts over `ray.num_engines` engine actors: the run's one `RolloutGenerator`
    (prompt stream, group sampling, dynamic filter, rewards) around an `EnginePool`.

    Its checkpoint state (`state_dict`) is the prompt stream's position, held once whatever the
    number of engines, so a run resumes with any `ray.num_engines`.
    """

    @errors_held_for_start
    def __init__(
        self, config: dict[str, Any], *, engines: list[Any], model_path: str, threads: int = 1
    ) -> None:
        """Read the config and import the rollout libraries; ``start`` (once the engines have
        started) builds the generator."""
        from ember.actors import _import_rollout_libraries, _prepare_process
        from ember.startup import mark, mark_process_start

        mark_process_start("manager", "actor created")
        _prepare_process(threads)
        from ember.config import load_config

        self.config, self.plugins = load_config(config)
        if self.config.data.tokenizer_path is None:
            self.config.data.tokenizer_path = model_path
        self.pool = EnginePool(
            engines, kind=self.config.engine.kind, fault_tolerance=self.config.fault_tolerance
        )
        self.loop = asyncio.new_event_loop()
        self.generator: Any = None
        self.eval_sets: dict[str, Any] | None = None
        _import_rollout_libraries(embedded_engine=False)
        mark("manager", "libraries imported")

    def start(self) -> None:
        """Build the rollout generator: the prompts, the tokenizer (from the export), the served
        model's shape (from engine 0, which must have started). Idempotent."""
        if self.init_error is not None:
            raise self.init_error
        if self.generator is not None:
            return
        from ember_rollout import RolloutGenerator

        self.generator = RolloutGenerator.from_config(
            runner=self.pool,
            model_info=calls.get(self.pool.engines[0].model_info.remote()),
            sampling=self.config.rollout,
            sections=self.config,
            plugins=self.plugins,
        )

    def evaluate(self, rollout_id: int) -> dict[str, float]:
        """Generate and score every eval set (`run.eval_sets`) on the engines' current weights:
        the `eval/<set>/*` metrics and `perf/eval_time`."""
        from ember_rollout.data import load_eval_sets

        run = self.config.run
        if self.eval_sets is None:
            self.eval_sets = load_eval_sets(
                run.eval_sets, self.config.data, prompts=run.eval_prompts
            )
        return self.loop.run_until_complete(
            evaluate_sets(self.generator, self.eval_sets, run, rollout_id)
        )

    def generate(
        self, rollout_id: int, prompts: list[tuple[Any, list[int]]] | None = None
    ) -> RolloutBatch:
        """Generate, score and filter rollout `rollout_id` on every engine; with `prompts`
        (`ember_rollout.rollout.prompts_of` a rollout generated again), from those prompts
        instead of the stream's next ones."""
        self.pool.start_rollout()
        batch = self.loop.run_until_complete(self.generator.generate(rollout_id, prompts))
        batch.metrics.update(self.pool.metrics())
        return batch

    @calls.concurrency_group(CONTROL_CALLS)
    def engine_failures(self) -> dict[int, str]:
        """The slots whose engine failed and awaits a replacement, with why."""
        return self.pool.failed_slots()

    @calls.concurrency_group(CONTROL_CALLS)
    def fail_engine(self, slot: int, engine: Any, reason: str) -> None:
        """Take `engine` out of `slot` (the driver's probe found it failed), unless a
        replacement holds the slot by now (`EnginePool.fail`)."""
        self.pool.fail(slot, engine, reason)

    @calls.concurrency_group(CONTROL_CALLS)
    def install_engine(self, slot: int, engine: Any) -> None:
        """Put a replacement, holding the trainer's current weights, in `slot`."""
        self.pool.install(slot, engine)

    def state_dict(self) -> dict[str, Any]:
        """The prompt stream's position (request seeds derive from rollout ids)."""
        return self.generator.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.load_state_dict(state)
