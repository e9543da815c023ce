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
SLIME_CEILING = 0.1
"""slime's train/rollout bar (`--ci-train-rollout-logprob-abs-diff-threshold`), a bar on the
mean |trainer - engine| log-prob: Ember's mean bar where either side computes below float32."""


@dataclasses.dataclass(frozen=True, slots=True)
class MismatchBars:
    """The bars of the rows that compare the trainer's forward with the engine's: the sampled
    tokens' |trainer - engine| log-probs (rows 2 and 7.2, and the CI checker's per-token
    ceiling) and KL(engine || trainer) per response position (rows 3 and 7.3), each a bar on
    the mean and a separate one on the per-token (per-position) maximum, and why these."""

    mean: float
    max: float
    kl_mean: float
    kl_max: float
    why: str

    def log_probs(self) -> str:
        return f"mean <= {self.mean:g}, max <= {self.max:g} ({self.why})"

    def kl(self) -> str:
        return f"mean <= {self.kl_mean:g}, max <= {self.kl_max:g} ({self.why})"


FP32_BARS = MismatchBars(
    mean=1e-4,
    max=5e-4,
    kl_mean=1e-9,
    kl_max=1e-7,
    why="the engine and the trainer both compute in float32",
)
"""Where the engine and the trainer both compute in float32. Measured with `ember certify
examples/smollm2-arith.yaml` (SmolLM2-135M, 30 layers, 32 answers of up to 320 tokens) on a
2-core AMD EPYC: log-prob mean 5.1e-6 and 4.8e-6, per-token max 6.2e-5 and 7.2e-5 (rows 2 and
7.2); KL mean 3.4e-11 and 3.0e-11, max 8.6e-10 and 6.8e-10 (rows 3 and 7.3). Each bar is 7x or
more above its measurement, for longer answers and other processors' summation orders, and
below what a planted fault gives (test_certify.py runs every one at these bars); the maximum
still fails one token off by 2^-10 (9.8e-4)."""

LOW_PRECISION_BARS = MismatchBars(
    mean=SLIME_CEILING,
    max=2.0,
    kl_mean=1e-2,
    kl_max=0.25,
    why="below float32, the two round differently",
)
"""Where either side computes below float32 (or its dtype is unknown: an attached server's).
Measured as `FP32_BARS`, with the engine and the trainer in bfloat16 (9900 and 10240 tokens,
answers of up to 320): log-prob mean 3.5e-2 and 3.7e-2, per-token max 0.68 and 0.45; KL mean
1.9e-3 and 2.1e-3, max 2.9e-2 and 6.0e-2 (a bfloat16 engine with a float32 trainer: 2.9e-2 and
3.1e-2, 0.48 and 0.47; 1.2e-3 and 1.4e-3, 2.6e-2 and 2.6e-2). The mean bar is slime's; the
maxima 3x and 4x above their largest measurements, since a per-token maximum grows with the
number of tokens. What these bars let through of the planted faults is in docs/certify.md."""


FP8_BARS = MismatchBars(
    mean=0.5,
    max=8.0,
    kl_mean=0.1,
    kl_max=4.0,
    why="engine.quantization=fp8_block: activations quantized to FP8 per token group, where a "
    "last-bit difference between two forwards can round a value a whole FP8 step apart",
)
"""Where the engine serves FP8 block weights (W8A8), with or without `train.qat`. Measured with
`ember certify examples/smollm2-arith.yaml --set engine.quantization=fp8_block --set
engine.quantization_group_size=64` on a 2-core AMD EPYC (float32, 1407 and 1421 tokens of
answers up to 64): log-prob mean 0.121 and 0.121, per-token max 2.32 and 1.62; KL mean 2.8e-2
and 2.3e-2, max 1.06 and 0.26. With `train.qat` (1407 and 1002 tokens): 9.3e-2 and 8.3e-2, 1.99
and 1.17; KL 3.0e-11 and 5.9e-4, 7.3e-10 and 3.9e-2: the weights agree, but the engine's own
decode and prefill part (docs/low-precision.md). Each bar about 4x its largest measurement."""

FP8_QAT_BARS = MismatchBars(
    mean=FP8_BARS.mean,
    max=FP8_BARS.max,
    kl_mean=3e-3,
    kl_max=0.2,
    why="engine.quantization=fp8_block with train.qat: the trainer computes with the served "
    "weights; FP8 activations still round a last-bit difference a whole step apart",
)
"""FP8 with `train.qat`: the log-prob bars are FP8's (decode steps part from the trainer's
forward as without QAT: 9.3e-2 and 8.3e-2 against 0.121), the KL bars tighter, so that a QAT
that is off fails rows 3 and 7.3: measured with QAT 3.0e-11 and 5.9e-4 mean, 7.3e-10 and 3.9e-2
max (about 5x under the bars); without, 2.8e-2 and 2.3e-2 mean, 1.06 and 0.26 max (above
them)."""

INT4_BARS = MismatchBars(
    mean=4.0,
    max=60.0,
    kl_mean=2.0,
    kl_max=50.0,
    why="engine.quantization=int4_w4a16 without train.qat: the trainer computes with the "
    "full-precision weights, the engine with their INT4 groups",
)
"""Where the engine serves INT4 weights and the trainer the full-precision ones. Measured as
`FP8_BARS` with `engine.quantization=int4_w4a16` (673 and 1069 tokens): log-prob mean 1.26 and
0.84, per-token max 17.5 and 11.4; KL mean 0.68 and 0.54, max 16.0 and 5.2. Each bar about 3x
its largest measurement. With `train.qat` the dtype's bars apply: the trainer then computes with
the INT4 weights the engine serves, and INT4 leaves the activations alone."""


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
    ORDINARY_KERNEL = "ordinary-kernel"
    """Under `rollout.true_on_policy`, the embedded engine's attention is transformers' SDPA
    again instead of the batch-invariant kernel the trainer runs: "sampled tokens" fails, and
    so do the distribution rows and both after the update (every row barring any difference).
    """


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


EXACT_BARS = MismatchBars(
    mean=0.0,
    max=0.0,
    kl_mean=0.0,
    kl_max=0.0,
    why="rollout.true_on_policy: the engine and the trainer run the same batch-invariant kernels",
)
"""Under `rollout.true_on_policy`: no difference at all (docs/true-on-policy.md)."""


def mismatch_ceiling(
    engine_dtype: str | None,
    trainer_dtype: str | None,
    *,
    exact: bool = False,
    quantization: str | None = None,
    qat: bool = False,
) -> MismatchBars:
    """The bars (`MismatchBars`) of a setup whose engine computes in `engine_dtype` (None:
    unknown, an attached server's) and trainer in `trainer_dtype` (None: float32); `exact`
    (`rollout.true_on_policy`) bars every difference; an engine serving `quantization`
    (`engine.quantization`) has its scheme's bars (FP8 with `qat` tighter KL ones), except INT4
    with `qat`, where the trainer computes with the engine's weights and the dtype's bars hold."""
    if exact:
        return EXACT_BARS
    if quantization == "fp8_block":
        return FP8_QAT_BARS if qat else FP8_BARS
    if quantization == "int4_w4a16" and not qat:
        return INT4_BARS
    if engine_dtype == "float32" and trainer_dtype in (None, "float32"):
        return FP32_BARS
    sides = f"engine dtype {engine_dtype or 'unknown'}, trainer dtype {trainer_dtype or 'float32'}"
    return dataclasses.replace(LOW_PRECISION_BARS, why=f"{sides}: {LOW_PRECISION_BARS.why}")
