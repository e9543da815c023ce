"""The rollout manager: one Ray actor per run that owns the prompt stream, group sampling,
filters and rewards, and spreads each rollout's prompt groups over the engine actors."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import ray

from ember_core.types import Sample
from ember_rollout.rollout import PromptGroup, RolloutBatch


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
    and every engine gets one `generate` call with its groups, all engines at once.

    It counts the requests each engine served since `start_rollout`, for the
    `rollout/engine{k}_requests` metrics.
    """

    def __init__(self, engines: Sequence[Any], *, kind: str) -> None:
        self.engines = list(engines)
        self._kind = kind
        self.in_flight = [0] * len(self.engines)
        self.requests = [0] * len(self.engines)

    @property
    def kind(self) -> str:
        return self._kind

    def start_rollout(self) -> None:
        self.requests = [0] * len(self.engines)

    def metrics(self) -> dict[str, float]:
        return {f"rollout/engine{k}_requests": float(n) for k, n in enumerate(self.requests)}

    async def generate_groups(self, groups: Sequence[PromptGroup]) -> list[list[Sample]]:
        sizes = [len(g.requests) for g in groups]
        owners = assign_groups(sizes, self.in_flight)
        calls = []
        for k in range(len(self.engines)):
            mine = [i for i, owner in enumerate(owners) if owner == k]
            if mine:
                calls.append((k, mine, sum(sizes[i] for i in mine)))
        for k, _, load in calls:
            self.in_flight[k] += load
            self.requests[k] += load
        try:
            # One worker thread per engine call: the engines generate at the same time, and
            # this event loop waits for all of them, in whatever order they finish.
            results = await asyncio.gather(
                *(
                    asyncio.to_thread(self._generate, k, [groups[i] for i in mine])
                    for k, mine, _ in calls
                )
            )
        finally:
            for k, _, load in calls:
                self.in_flight[k] -= load
        out: list[list[Sample]] = [[] for _ in groups]
        for (_, mine, _), samples in zip(calls, results, strict=True):
            for i, group_samples in zip(mine, samples, strict=True):
                out[i] = group_samples
        return out

    def _generate(self, engine: int, groups: list[PromptGroup]) -> list[list[Sample]]:
        return ray.get(self.engines[engine].generate.remote(groups))


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


@ray.remote
class RolloutManager:
    """Generates rollouts over `ray.num_engines` engine actors: the run's one `RolloutGenerator`
    (prompt stream, group sampling, dynamic filter, rewards) around an `EnginePool`.

    Its checkpoint state (`state_dict`) is the prompt stream's position, held once whatever the
    number of engines, so a run resumes with any `ray.num_engines`.
    """

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
        self.pool = EnginePool(engines, kind=self.config.engine.kind)
        self.loop = asyncio.new_event_loop()
        self.generator: Any = None
        self.eval_sets: dict[str, Any] | None = None
        _import_rollout_libraries(embedded_engine=False)
        mark("manager", "libraries imported")

    def start(self) -> None:
        """Build the rollout generator: the prompts, the tokenizer (from the export), the served
        model's shape (from engine 0, which must have started). Idempotent."""
        if self.generator is not None:
            return
        from ember_rollout import RolloutGenerator

        self.generator = RolloutGenerator.from_config(
            runner=self.pool,
            model_info=ray.get(self.pool.engines[0].model_info.remote()),
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

    def state_dict(self) -> dict[str, Any]:
        """The prompt stream's position (request seeds derive from rollout ids)."""
        return self.generator.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.load_state_dict(state)
