"""Forward-only scoring of a rollout: the reference, old-actor and critic passes of ``prepare``."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from ember_core.hookspecs import Phase, Role
from ember_core.plugins import EmberPlugins
from ember_core.types import Sample
from ember_megatron_backend import pipeline
from ember_megatron_backend.batches import MicroBatch, pack_micro_batch
from ember_megatron_backend.forward import ForwardOutput, Layout, score_batch
from ember_megatron_backend.routing import RoutingRecorder

__all__ = ["ScoringPass", "score_passes"]


@dataclass(frozen=True, slots=True)
class ScoringPass:
    """One forward-only pass over every micro-batch of a rollout."""

    key: str
    """Name of the pass's results in ``score_passes``' answer."""
    model: Any
    """The model that runs it (possibly DDP-wrapped)."""
    role: Role
    """Its role: what the forward contexts receive, and "actor"/"ref" (log-probs; the actor's
    with entropy) or "critic" (values)."""
    phase: Phase
    """Why it runs (``Phase.LOG_PROB``, or ``Phase.REPLAY_CHECK`` for the reference's check)."""
    routing: Tensor | None = None
    """[B, 4] routing counts to record into (``RoutingRecorder.record``); None records none."""


def score_passes(
    samples: list[Sample],
    plan: list[list[int]],
    layouts: list[Layout | None],
    passes: list[ScoringPass],
    *,
    plugins: EmberPlugins,
    recorder: RoutingRecorder,
    temperature: float,
) -> dict[str, ForwardOutput]:
    """Run `passes` over the micro-batches of `plan` (collective).

    Each micro-batch's forward runs inside the plugins' `forward_context(role, phase, mb)`, and
    inside `recorder.record` when the pass has routing counts and the model has routers.
    Without pipeline parallelism each micro-batch goes through every pass in turn; with it,
    each pass runs all micro-batches through one schedule (``pipeline.score``), and every rank
    receives the last stage's results.

    Args:
        samples: The rank's samples.
        plan: Sample indices per micro-batch.
        layouts: Per micro-batch, the padded layout to use (``MicroBatch.layout``) or None.
        passes: The passes, in order.
        plugins: Whose forward contexts wrap the passes.
        recorder: The actor's routing recorder.
        temperature: Rollout temperature of the policy roles.

    Returns:
        By pass key, per-sample CPU results in sample order.
    """

    def context(step: ScoringPass, mb: MicroBatch) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(plugins.forward_context(step.role, step.phase, mb))
        if step.routing is not None and recorder.active:
            stack.enter_context(recorder.record(mb, step.routing))
        return stack

    def pack(step: ScoringPass, k: int) -> MicroBatch:
        return pack_micro_batch(step.model, samples, plan[k], layouts[k])

    def options(step: ScoringPass) -> dict[str, Any]:
        return dict(
            role=step.role.value, temperature=temperature, with_entropy=step.role == Role.ACTOR
        )

    outputs: dict[str, list[tuple[list[int], ForwardOutput]]] = {p.key: [] for p in passes}
    if pipeline.is_pipelined():
        for step in passes:
            micro_batches = [pack(step, k) for k in range(len(plan))]
            context_of = functools.partial(context, step)
            out = pipeline.score(step.model, micro_batches, context=context_of, **options(step))
            outputs[step.key].append(([i for mb in micro_batches for i in mb.indices], out))
    else:
        for k in range(len(plan)):
            for step in passes:
                mb = pack(step, k)
                with context(step, mb):
                    out = score_batch(
                        step.model, mb.packed, mb.layout, window=mb.window, **options(step)
                    )
                outputs[step.key].append((mb.indices, out))
    return {key: _in_sample_order(pieces, len(samples)) for key, pieces in outputs.items()}


def _in_sample_order(pieces: list[tuple[list[int], ForwardOutput]], n: int) -> ForwardOutput:
    """Per-sample CPU results of `n` samples from (sample indices, their results) pieces."""
    results: dict[str, list[Any] | None] = {}
    for key in ("log_probs", "entropy", "values"):
        if getattr(pieces[0][1], key) is None:
            results[key] = None
            continue
        placed: list[Any] = [None] * n
        for indices, out in pieces:
            for i, value in zip(indices, getattr(out, key), strict=True):
                placed[i] = value.detach().cpu()
        results[key] = placed
    return ForwardOutput(**results)
