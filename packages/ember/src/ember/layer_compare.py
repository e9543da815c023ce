"""`ember certify --layers`: the engine's decode path against the trainer's forward, layer by
layer and op by op, bitwise and by magnitude, and the first op where the two part.

The engine decodes every sample of rollout 0 again as a rollout decodes it (prefill of the
prompts, then one token per step from its KV cache, in the rollout's order and batches), taking
the sampled tokens instead of drawing new ones (`HFEngine.trace`); the trainer runs its
old-log-prob pass over the same samples in `prepare`'s micro-batches
(`MegatronWorker.trace_layers`). Both record, for the first N samples, every decoder layer's
input norm, attention, pre-MLP norm, router logits and chosen experts (MoE layers), MLP and
output, then the final norm; the sampled tokens' log-probs close the list.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ember_rollout.layer_trace import FINAL_OPS, LAYER_OPS

__all__ = [
    "LAYERS_FILE",
    "LayerComparison",
    "OpDiff",
    "compare_layers",
    "compare_traces",
    "first_difference",
    "layers_table",
    "one_sided",
    "refusal",
    "write_layers",
]

LAYERS_FILE = "layers.json"
"""The comparison in the run directory."""
LOG_PROBS = "log_probs"


@dataclass(frozen=True, slots=True)
class OpDiff:
    """One op of one layer over every compared position."""

    layer: int
    """Decoder layer (the number of layers for the final norm and the log-probs)."""
    op: str
    positions: int
    """Positions compared."""
    equal: int
    """Positions whose values are bitwise equal on both sides (for `experts`: the same set)."""
    max_abs: float | None
    """Largest |engine - trainer| over every element (None for `experts`; inf where either
    side holds a value that is not finite)."""
    dtypes: str | None = None
    """"engine dtype vs trainer dtype" where they differ (then no position is bitwise equal)."""

    @property
    def exact(self) -> bool:
        return self.equal == self.positions


def _ordered_keys(keys: set[tuple[int, str]]) -> list[tuple[int, str]]:
    order = {op: k for k, op in enumerate((*LAYER_OPS, *FINAL_OPS, LOG_PROBS))}
    return sorted(keys, key=lambda key: (key[0], order[key[1]]))


def compare_traces(
    engine: Sequence[Mapping[tuple[int, str], torch.Tensor]],
    trainer: Sequence[Mapping[tuple[int, str], torch.Tensor]],
    engine_log_probs: Sequence[Sequence[float]],
    trainer_log_probs: Sequence[torch.Tensor],
    *,
    num_layers: int,
) -> list[OpDiff]:
    """Per (layer, op) both sides recorded, in the order a forward runs them, then the log-probs.

    Raises:
        ValueError: The sides recorded different positions for a sample (names it).
    """
    totals: dict[tuple[int, str], dict[str, Any]] = {}

    def add(key: tuple[int, str], equal: torch.Tensor, largest: float | None) -> None:
        total = totals.setdefault(key, {"positions": 0, "equal": 0, "max_abs": None})
        total["positions"] += len(equal)
        total["equal"] += int(equal.sum())
        if largest is not None:
            total["max_abs"] = max(total["max_abs"] or 0.0, largest)

    def largest(a: torch.Tensor, b: torch.Tensor) -> float:
        diff = (a.double() - b.double()).abs()
        return float(torch.nan_to_num(diff, nan=math.inf).max())

    for index, (ours, theirs) in enumerate(zip(engine, trainer, strict=True)):
        for key in ours.keys() & theirs.keys():
            a, b = ours[key], theirs[key]
            if a.shape[0] != b.shape[0]:
                raise ValueError(
                    f"sample {index}: {key[1]} of layer {key[0]} covers {a.shape[0]} positions "
                    f"in the engine and {b.shape[0]} in the trainer"
                )
            if not a.numel():
                continue
            a, b = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
            if key[1] == "experts":
                add(key, (a.sort(-1).values == b.to(a.dtype).sort(-1).values).all(-1), None)
            else:
                same_dtype = a.dtype == b.dtype
                equal = (a == b).all(-1) if same_dtype else torch.zeros(len(a), dtype=torch.bool)
                add(key, equal, largest(a, b))
                if not same_dtype:
                    totals[key]["dtypes"] = f"{_name(a.dtype)} vs {_name(b.dtype)}"
    for ours, theirs in zip(engine_log_probs, trainer_log_probs, strict=True):
        a = torch.tensor(list(ours), dtype=torch.float32)
        b = theirs.to(torch.float32)
        if len(a):
            add((num_layers, LOG_PROBS), a == b, largest(a, b))
    return [OpDiff(layer=k[0], op=k[1], **totals[k]) for k in _ordered_keys(set(totals))]


def one_sided(
    engine: Sequence[Mapping[tuple[int, str], torch.Tensor]],
    trainer: Sequence[Mapping[tuple[int, str], torch.Tensor]],
) -> list[str]:
    """Ops only one side recorded ("engine: layer 2 router_logits"), which `compare_traces`
    cannot compare."""
    ours = {k for trace in engine for k in trace}
    theirs = {k for trace in trainer for k in trace}
    return [
        f"{side}: layer {layer} {op}"
        for side, keys in (("engine", ours - theirs), ("trainer", theirs - ours))
        for layer, op in _ordered_keys(keys)
    ]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def first_difference(diffs: Sequence[OpDiff]) -> OpDiff | None:
    """The first op, in forward order, where some position differs; None: bitwise equal."""
    return next((d for d in diffs if not d.exact), None)


def layers_table(diffs: Sequence[OpDiff], *, num_layers: int, unmatched: Sequence[str] = ()) -> str:
    """One line per op: layer, op, positions bitwise equal, largest difference (and the dtypes
    where they differ); then the ops one side alone recorded, and the first difference."""
    lines = [f"{'layer':<6} {'op':<14} {'bitwise equal':>20} {'max |engine - trainer|':>24}"]
    for d in diffs:
        where = "final" if d.layer >= num_layers else str(d.layer)
        largest = "-" if d.max_abs is None else f"{d.max_abs:.3e}"
        share = f"{d.equal}/{d.positions}"
        dtypes = f"  (dtypes differ: {d.dtypes})" if d.dtypes else ""
        lines.append(f"{where:<6} {d.op:<14} {share:>20} {largest:>24}{dtypes}")
    if unmatched:
        lines.append(f"recorded by one side only: {'; '.join(unmatched)}")
    first = first_difference(diffs)
    if first is None:
        lines.append("every op is bitwise equal on both sides")
    else:
        where = "after the last layer" if first.layer >= num_layers else f"layer {first.layer}"
        lines.append(f"first difference: {where}, {first.op}")
    return "\n".join(lines)


def write_layers(
    run_dir: Path,
    diffs: Sequence[OpDiff],
    setup: Mapping[str, Any],
    *,
    unmatched: Sequence[str] = (),
    redecode: OpDiff | None = None,
) -> Path:
    """`layers.json` in the run directory: the setup, every op's figures, the ops one side alone
    recorded, the re-decode against the rollout, the first difference."""
    first = first_difference(diffs)
    path = Path(run_dir) / LAYERS_FILE
    document = {
        "setup": dict(setup),
        "ops": [asdict(d) for d in diffs],
        "one_sided": list(unmatched),
        "redecode_vs_rollout": None if redecode is None else asdict(redecode),
        "first_difference": None if first is None else asdict(first),
    }
    path.write_text(json.dumps(document, indent=2) + "\n")
    return path


def refusal(config: Any) -> str | None:
    """Why `ember certify --layers` cannot compare this setup, in one line; None if it can."""
    parallel = config.train.parallel
    sizes = {
        name: getattr(parallel, name)
        for name in ("tensor_parallel", "pipeline_parallel", "expert_parallel", "context_parallel")
        if getattr(parallel, name, 1) > 1
    }
    named = [f"train.parallel.{k}={v}" for k, v in sizes.items()]
    if config.ray.data_parallel > 1:
        named.append(f"ray.data_parallel={config.ray.data_parallel}")
    if named:
        return f"--layers compares one training rank with the engine; {', '.join(named)}"
    if config.engine.kind != "hf":
        return (
            "--layers reads every op of the embedded engine (engine.kind=hf); an SGLang server "
            "returns no op inside a layer through its API (docs/true-on-policy.md says what it "
            "can return)"
        )
    return None


@dataclass(frozen=True, slots=True)
class LayerComparison:
    """What `compare_layers` measured."""

    diffs: list[OpDiff]
    """Per op, engine against trainer."""
    unmatched: list[str]
    """Ops one side alone recorded (`one_sided`)."""
    redecode: OpDiff | None
    """The traced decode's log-probs of every sample of rollout 0 against those the rollout
    reported for the same tokens: the trace decodes them all in rollout 0's order, and where its
    batches are not the rollout's (a rollout generated over several calls, refilled groups) and
    that changes a reduction, the engine's side of the comparison is not the rollout's. None
    where the samples carry no engine log-probs."""
    scope: dict[str, Any]
    """Samples, positions, sampled tokens, dtypes, layers."""


def compare_layers(driver: Any, count: int) -> LayerComparison:
    """Build the run of `driver`, generate rollout 0 and trace its first `count` samples
    through the engine's decode path and the trainer's forward."""
    from ember import calls
    from ember.certify import engine_dtype

    config = driver.config
    driver.run_dir.mkdir(parents=True, exist_ok=True)
    driver.start()
    driver.build()
    driver.load_initial_weights()
    # Every sample is decoded again, in rollout 0's order, so that the engine's batches are
    # the rollout's where it generated them in one call; the first `count` are recorded.
    everything = [s for s in driver.loop.take(0).samples if s.response_length > 0]
    samples = everything[:count]
    if not samples:
        raise ValueError("rollout 0 has no sample with a response to compare")
    sequences = [
        (s.tokens[: s.total_length - s.response_length], s.tokens[-s.response_length :])
        for s in everything
    ]
    engine = driver.actors.engines[0]
    temperature = config.rollout.temperature
    ours = calls.get(engine.trace_layers.remote(sequences, temperature, len(samples)))
    if ours is None:  # `refusal` says this before anything starts
        raise ValueError("the engine cannot trace its layers")
    # The trainer forwards every sample too, in the micro-batches its old-log-prob pass uses.
    ranks = driver.actors.train
    [theirs] = calls.get([rank.trace_layers.remote(0, everything, len(samples)) for rank in ranks])
    num_layers = config.train.model_config().num_layers
    traced_log_probs = ours[1][: len(samples)]
    trainer_log_probs = theirs[1][: len(samples)]
    diffs = compare_traces(
        ours[0], theirs[0], traced_log_probs, trainer_log_probs, num_layers=num_layers
    )
    unmatched = one_sided(ours[0], theirs[0])
    reported = [s.rollout_log_probs for s in everything]
    redecode = None
    if all(r is not None for r in reported):
        reported_tensors = [torch.tensor(r, dtype=torch.float32) for r in reported]
        [redecode] = compare_traces([], [], ours[1], reported_tensors, num_layers=num_layers)
    scope = {
        "samples": len(samples),
        "positions": sum(s.total_length - 1 for s in samples),
        "response_tokens": sum(s.response_length for s in samples),
        "engine_dtype": engine_dtype(config),
        "train_dtype": config.train.dtype,
        "num_layers": num_layers,
    }
    return LayerComparison(diffs, unmatched, redecode, scope)
