"""The loop variants of DESIGN section 2, one class each, over the actors a `Driver` built:

- `InTurnLoop` (`rollout.max_staleness` 0): generate rollout i from the weights trained on
  rollout i - 1, then score, train and push;
- `OverlappedLoop` (k >= 1): rollouts up to i + k generate while the trainer trains on rollout
  i; the push waits for them (or, with `rollout.partial_rollouts`, reaches the engines between
  decode steps);
- `TrainFromDumpLoop` (`run.train_from_rollouts`): rollouts read from a dump, no engine;
- `RolloutOnlyLoop` (`run.rollout_only`): generate, score and dump, no trainer.

Each `iteration(rollout_id)` returns (rollout metrics, each step's metrics, timings).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from ember import calls
from ember.config import check_dump_audit, checked_run, dump_path, dump_provenance
from ember.dumps import read_dump, write_dump
from ember.versions import beyond_bound, sample_version, staleness_metrics
from ember_core.types import Sample
from ember_rollout.rollout import RolloutBatch, prompts_of

logger = logging.getLogger(__name__)

Iteration = tuple[dict[str, float], list[dict[str, float]], dict[str, float]]
"""What one iteration returns: rollout metrics, each optimizer step's metrics, timings."""


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


class Loop:
    """What every variant shares: the rollouts started ahead or restored from a checkpoint,
    and the trainer's scoring and training calls."""

    description = ""

    def __init__(self, driver: Any) -> None:
        self.driver = driver
        self.config = driver.config
        self.pending: dict[int, Any] = {}
        """Rollouts started ahead (references to `RolloutManager.generate`) or restored from
        a checkpoint (`RolloutBatch`), by rollout id."""
        self.regenerated: dict[int, int] = {}
        """Samples of a rollout dropped as untrainable (`take`), by rollout id."""

    @property
    def actors(self) -> Any:
        assert self.driver.actors is not None
        return self.driver.actors

    def iteration(self, rollout_id: int) -> Iteration:
        raise NotImplementedError

    # -- rollouts ----------------------------------------------------------------------------

    def start(self, rollout_id: int) -> None:
        """Start generating rollout `rollout_id` (unless it is already started or restored)."""
        if rollout_id < self.config.run.num_rollouts and rollout_id not in self.pending:
            self.pending[rollout_id] = self.actors.manager.generate.remote(rollout_id)

    def start_ahead(self, rollout_id: int) -> None:
        """Start the rollouts after `rollout_id` that may generate now: up to
        `rollout.max_staleness` ahead, stopping before one a plugin audits (it generates at
        the start of its own iteration, from the weights the trainer holds then)."""
        for ahead in range(rollout_id + 1, rollout_id + 1 + self.config.rollout.max_staleness):
            if self.driver.plugins.audit_rollout(ahead):
                return
            self.start(ahead)

    def take(self, rollout_id: int) -> RolloutBatch:
        """Rollout `rollout_id`, generated now if it was not started ahead; generated again,
        from the current weights and with the same prompts (`prompts_of`), where it cannot be
        trained as it is (`untrainable`). The dropped samples are counted in
        `rollout/regenerated`."""
        mender = self.driver.mender
        self.start(rollout_id)
        batch = mender.get(self.pending.pop(rollout_id))
        why = self.untrainable(batch, rollout_id)
        if why:
            logger.warning("rollout %d: %s; generating it again", rollout_id, why)
            self.regenerated[rollout_id] = len(batch.samples)
            prompts = prompts_of(batch.samples)
            batch = mender.get(self.actors.manager.generate.remote(rollout_id, prompts))
        return batch

    def untrainable(self, batch: RolloutBatch, rollout_id: int) -> str | None:
        """Why rollout `rollout_id` cannot be trained as it is (None: it can): staler than
        `rollout.max_staleness` allows, or audited with samples from older weights than the
        trainer's (a rollout restored from a run with a higher bound, without the audit, or
        with another audit interval). The trainer then holds version rollout_id - 1."""
        bound = self.config.rollout.max_staleness
        stale = beyond_bound(batch.samples, rollout_id, bound)
        if stale:
            return (
                f"{stale} of its {len(batch.samples)} samples are staler than "
                f"rollout.max_staleness={bound}"
            )
        older = sum(sample_version(s) < rollout_id - 1 for s in batch.samples)
        if older and self.driver.plugins.audit_rollout(rollout_id):
            return (
                f"it is audited, and {older} of its {len(batch.samples)} samples come from "
                f"weights older than the trainer's (version {rollout_id - 1})"
            )
        return None

    def generating(self) -> list[Any]:
        """The rollouts started ahead that are still generating."""
        return [ref for ref in self.pending.values() if not isinstance(ref, RolloutBatch)]

    # -- the trainer -------------------------------------------------------------------------

    def score(self, rollout_id: int, samples: list[Sample]) -> dict[str, float]:
        """Score rollout `rollout_id` on the training ranks (the trainer holds the GPUs): its
        rollout/* metrics, the same on every rank (reduced across data-parallel ranks; the
        ranks of one model replica, its TP, PP and CP peers, take the same shard)."""
        driver = self.driver
        data_ranks = driver.data_ranks or list(range(len(self.actors.train)))
        shards = split_by_rank(
            samples, self.config.rollout.n_samples_per_prompt, 1 + max(data_ranks)
        )
        per_rank = [
            t.prepare.remote(rollout_id, shards[dp])
            for t, dp in zip(self.actors.train, data_ranks, strict=True)
        ]
        return calls.get(per_rank)[0]

    def train(self, rollout_id: int) -> list[dict[str, float]]:
        """Train on the rollout `score` scored last: the metrics of each optimizer step."""
        step_metrics = calls.get([t.train.remote(rollout_id) for t in self.actors.train])[0]
        self.driver.trained_version = str(rollout_id)
        return step_metrics


class TrainLoop(Loop):
    """Collect a rollout, score it, train on it, push the weights. The variants differ in how
    a rollout is collected and what runs meanwhile."""

    def collect(self, rollout_id: int) -> RolloutBatch:
        """Rollout `rollout_id`'s samples (`iteration` times this as waiting for rollout)."""
        return self.take(rollout_id)

    def before_training(self, rollout_id: int) -> None:
        """What starts once the rollout is collected, before the trainer scores it."""

    def before_push(self) -> float:
        """Wait for what must finish before the engines take new weights; returns the seconds
        waited."""
        return 0.0

    def iteration(self, rollout_id: int) -> Iteration:
        driver = self.driver
        timings: dict[str, float] = {}
        started = t0 = time.perf_counter()
        batch = self.collect(rollout_id)
        waited = time.perf_counter() - t0
        self.before_training(rollout_id)

        t0 = time.perf_counter()
        driver.handoff.to_training()
        rollout_metrics = self.score(rollout_id, batch.samples)
        timings["perf/log_probs_time"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        step_metrics = self.train(rollout_id)
        timings["perf/train_time"] = time.perf_counter() - t0

        timings["perf/rollout_time"] = waited + self.before_push()
        t0 = time.perf_counter()
        if self.actors.engines:
            driver.handoff.after_training(lambda: driver.pusher.push(rollout_id))
        timings["perf/weight_push_time"] = time.perf_counter() - t0
        if driver.pusher.pushed_bytes is not None:
            timings["perf/weight_push_bytes"] = driver.pusher.pushed_bytes
        timings["perf/iteration_time"] = time.perf_counter() - started

        # The trainer held version rollout_id - 1 (the initial weights are -1) when it trained.
        rollout_metrics = {
            **batch.metrics,
            **rollout_metrics,
            **staleness_metrics(batch.samples, rollout_id - 1, self.config.rollout.max_staleness),
            "rollout/regenerated": float(self.regenerated.pop(rollout_id, 0)),
            "rollout/engine_restarts": float(driver.mender.new_restarts),
            **timings,
        }
        driver.mender.new_restarts = 0
        if self.config.run.dump_rollouts:
            path = dump_path(driver.run_dir / "rollouts", rollout_id)
            write_dump(path, batch.samples, dump_provenance(self.config))
        return rollout_metrics, step_metrics, timings


class InTurnLoop(TrainLoop):
    """Rollout i generates now, from the weights trained on rollout i - 1."""

    description = "in turn (rollout, then training: rollout.max_staleness=0)"


class OverlappedLoop(TrainLoop):
    """Rollouts up to i + k (`rollout.max_staleness`) generate while the trainer trains on
    rollout i. The push waits for them, so the engines never change weights mid-rollout and
    rollout j comes from exactly the weights trained on rollout j - 1 - k; under
    `rollout.partial_rollouts` it does not wait, and the engines take the new weights between
    decode steps. A rollout a plugin audits (`EmberPlugins.audit_rollout`) is not started
    ahead: it generates at the start of its own iteration, from the trainer's weights."""

    @property
    def description(self) -> str:  # type: ignore[override]
        k = self.config.rollout.max_staleness
        return f"overlapped (up to {k} rollout(s) ahead: rollout.max_staleness={k})"

    def before_training(self, rollout_id: int) -> None:
        self.start_ahead(rollout_id)

    def before_push(self) -> float:
        generating = self.generating()
        if not generating or self.config.rollout.partial_rollouts:
            return 0.0
        t0 = time.perf_counter()
        self.driver.mender.wait(generating)
        return time.perf_counter() - t0


class TrainFromDumpLoop(TrainLoop):
    """Train on dumped rollouts (`run.train_from_rollouts`), with no engine and no push.
    `ember.config.check_inputs` read every dump before any process started, and refused one
    of other settings (`dump_provenance`) or one whose checks a checking plugin's run cannot
    pass (`check_dump_audit`); each is read and checked again when its rollout is reached."""

    description = "training on dumped rollouts (run.train_from_rollouts, no engine)"

    def collect(self, rollout_id: int) -> RolloutBatch:
        source = Path(self.config.run.train_from_rollouts)
        path = dump_path(source, rollout_id)
        batch = RolloutBatch(read_dump(path, dump_provenance(self.config)))
        plugins = self.driver.plugins
        if checked_run(self.config, plugins):
            audited = plugins.audit_rollout(rollout_id)
            check_dump_audit(self.config, path, rollout_id, batch.samples, audited)
        why = self.untrainable(batch, rollout_id)
        if why:  # nothing can generate it again: trained as dumped, and said so
            logger.warning(
                "rollout %d of %s: %s; trained as dumped (a dump from other weights, such as a "
                "rollout-only run's, trains off-policy)",
                rollout_id, source, why,
            )  # fmt: skip
        return batch

    def start(self, rollout_id: int) -> None:
        """Nothing generates."""


class RolloutOnlyLoop(Loop):
    """Generate and score rollouts from the weights the engines serve, and dump them; nothing
    trains, nothing is pushed (`run.rollout_only`)."""

    description = "rollout only (run.rollout_only, no trainer)"

    def iteration(self, rollout_id: int) -> Iteration:
        started = time.perf_counter()
        batch = self.driver.mender.get(self.actors.manager.generate.remote(rollout_id))
        timings = {"perf/rollout_time": time.perf_counter() - started}
        path = dump_path(self.driver.run_dir / "rollouts", rollout_id)
        write_dump(path, batch.samples, dump_provenance(self.config))
        timings["perf/iteration_time"] = time.perf_counter() - started
        return {**batch.metrics, **timings}, [], timings


def loop_for(driver: Any) -> Loop:
    """The loop variant the config of `driver` asks for."""
    run = driver.config.run
    if run.rollout_only:
        return RolloutOnlyLoop(driver)
    if run.train_from_rollouts is not None:
        return TrainFromDumpLoop(driver)
    if driver.config.rollout.max_staleness >= 1:
        return OverlappedLoop(driver)
    return InTurnLoop(driver)
