"""The consistency checks, one implementation each: what passes, by which bar.

`ember certify` measures a run's setup and judges each measurement here; the `ci_kl_checker`
plugin judges a training run's metrics here, and the device check its figures. Every judgement
fails on NaN (a comparison with NaN is false).

The planted faults (`Fault`) are the certifier's own test: `ember certify --plant FAULT` sets
`PLANT_ENV` in the processes of the run, and the code each fault lives in asks `planted`. A
certificate that passes with a fault planted proves its check blind.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
from collections.abc import Sequence
from typing import Any

TOLERANCE = 1e-8
"""An exact quantity (a KL of identical log-probs, a difference of identical weights) passes
when its absolute value is strictly below this: float32 sums of exact zeros stay far under it,
one differing token does not."""
FP32_MAX_ABS_DIFF = 1e-4
"""The |trainer - engine| log-prob bar, mean and per-token maximum, where the engine and the
trainer both compute in float32 (measured: about 1e-7 on CPU, DESIGN section 10)."""
SLIME_CEILING = 0.1
"""The |trainer - engine| log-prob bar otherwise: slime's train/rollout ceiling
(`--ci-train-rollout-logprob-abs-diff-threshold`), for the mean and the per-token maximum."""
PLANT_ENV = "EMBER_CERTIFY_PLANT"
"""The environment variable that names a planted fault (`Fault`) in every process of a run."""


class Fault(enum.StrEnum):
    """A fault `ember certify --plant` puts into the run, and the row it must fail."""

    DROPPED_TENSOR = "dropped-tensor"
    """The weight push leaves out one tensor (broadcast and IPC): "weights arrive" after the
    update fails."""
    TEMPERATURE = "temperature"
    """The trainer scores at temperature 1 whatever the rollout's: "sampled tokens" fails
    (where the rollout temperature is not 1)."""
    REPLAY_OFF = "replay-off"
    """Routing replay records the engine's experts but does not replay them: "routing" fails."""
    REFERENCE = "reference"
    """The reference model the run holds has its weights scaled by 1.01 (not the second one
    built from `train.ref_load` to check it against): "reference" fails."""
    STALE_VERSION = "stale-version"
    """The engine takes the pushed weights but keeps its old weight version: "weight version"
    after the update fails."""


def planted(fault: Fault) -> bool:
    """Whether `fault` is planted in this process (`PLANT_ENV`)."""
    return os.environ.get(PLANT_ENV) == fault.value


def exactly_zero(value: float) -> bool:
    """|value| < `TOLERANCE`."""
    return abs(value) < TOLERANCE


def exactly_one(value: float) -> bool:
    """value == 1.0 (an agreement fraction with nothing disagreeing)."""
    return value == 1.0


def at_most(value: float, ceiling: float) -> bool:
    """value <= ceiling."""
    return value <= ceiling


def at_least(value: float, floor: float) -> bool:
    """value >= floor."""
    return value >= floor


def finite(*values: float) -> bool:
    """Every value is a finite number (None and other non-numbers are not)."""
    return all(isinstance(v, int | float) and math.isfinite(v) for v in values)


def shifted_experts(samples: Sequence[Any], num_experts: int) -> list[Any]:
    """Copies of `samples` (`ember_core.types.Sample`) whose recorded experts are each moved to
    the next expert id: a routing no router chooses by itself, so a forward follows it only by
    replaying it. Where the trainer's own routing agrees with the engine's anyway (float32),
    replaying the recorded experts could not tell replay from none."""
    shifted = []
    for sample in samples:
        experts = sample.rollout_routed_experts
        if experts is not None:
            experts = (experts + 1) % num_experts
        shifted.append(dataclasses.replace(sample, rollout_routed_experts=experts))
    return shifted


def reference_source(
    ref_load: str | os.PathLike[str] | None, hf_load: str | os.PathLike[str] | None
) -> str | None:
    """Where a run's reference model comes from when that is not the actor's start:
    `train.ref_load` (`ref_load`) where it names other weights than the actor's checkpoint
    (`train.hf_load`, `hf_load`), as when RL continues from a checkpoint or an SFT model is the
    reference. None: the reference is the actor's initial weights, and at rollout 0 the two
    agree exactly. Otherwise they need not, and the check is the reference against a second
    model built from `ref_load`."""
    if ref_load is None:
        return None
    source = os.path.normpath(os.fspath(ref_load))
    if hf_load is not None and source == os.path.normpath(os.fspath(hf_load)):
        return None
    return source


def mismatch_ceiling(engine_dtype: str | None, trainer_dtype: str | None) -> tuple[float, str]:
    """The |trainer - engine| log-prob bar (mean and per-token maximum) of a setup whose engine
    computes in `engine_dtype` (None: unknown, an attached server's) and trainer in
    `trainer_dtype` (None: float32), and why."""
    if engine_dtype == "float32" and trainer_dtype in (None, "float32"):
        return FP32_MAX_ABS_DIFF, "the engine and the trainer both compute in float32"
    return SLIME_CEILING, (
        f"engine dtype {engine_dtype or 'unknown'}, trainer dtype {trainer_dtype or 'float32'} "
        "(slime's ceiling)"
    )
