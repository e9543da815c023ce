"""`ember certify --layers`: the engine's decode path against the trainer's forward, layer by
layer and op by op, bitwise and by magnitude, and the first op where the two part.

The engine decodes each sampled sequence again as a rollout decodes it (prefill of the prompt,
then one token per step from its KV cache, the sequences batched as the engine batches them),
taking the sampled tokens instead of drawing new ones (`HFEngine.trace`); the trainer runs its
old-log-prob forward of the same samples (`MegatronWorker.trace_layers`). Both record every
decoder layer's input norm, attention, pre-MLP norm, router logits and chosen experts (MoE
layers), MLP and output, then the final norm; the sampled tokens' log-probs close the list.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ember_rollout.layer_trace import FINAL_OPS, LAYER_OPS

__all__ = ["LAYERS_FILE", "OpDiff", "compare_traces", "first_difference", "layers_table"]

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
    """Largest |engine - trainer| over every element (None for `experts`)."""

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
                add(key, equal, float((a.double() - b.double()).abs().max()))
    for ours, theirs in zip(engine_log_probs, trainer_log_probs, strict=True):
        a = torch.tensor(list(ours), dtype=torch.float32)
        b = theirs.to(torch.float32)
        if len(a):
            add((num_layers, LOG_PROBS), a == b, float((a.double() - b.double()).abs().max()))
    return [OpDiff(layer=k[0], op=k[1], **totals[k]) for k in _ordered_keys(set(totals))]


def first_difference(diffs: Sequence[OpDiff]) -> OpDiff | None:
    """The first op, in forward order, where some position differs; None: bitwise equal."""
    return next((d for d in diffs if not d.exact), None)


def layers_table(diffs: Sequence[OpDiff], *, num_layers: int) -> str:
    """One line per op: layer, op, positions bitwise equal, largest difference."""
    lines = [f"{'layer':<6} {'op':<14} {'bitwise equal':>20} {'max |engine - trainer|':>24}"]
    for d in diffs:
        where = "final" if d.layer >= num_layers else str(d.layer)
        largest = "-" if d.max_abs is None else f"{d.max_abs:.3e}"
        share = f"{d.equal}/{d.positions}"
        lines.append(f"{where:<6} {d.op:<14} {share:>20} {largest:>24}")
    first = first_difference(diffs)
    if first is None:
        lines.append("every op is bitwise equal on both sides")
    else:
        where = "after the last layer" if first.layer >= num_layers else f"layer {first.layer}"
        lines.append(f"first difference: {where}, {first.op}")
    return "\n".join(lines)


def write_layers(run_dir: Path, diffs: Sequence[OpDiff], setup: Mapping[str, Any]) -> Path:
    """`layers.json` in the run directory: the setup, every op's figures, the first difference."""
    first = first_difference(diffs)
    path = Path(run_dir) / LAYERS_FILE
    document = {
        "setup": dict(setup),
        "ops": [asdict(d) for d in diffs],
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
    if sizes:
        named = ", ".join(f"train.parallel.{k}={v}" for k, v in sizes.items())
        return f"--layers compares one training rank with the engine; {named}"
    if config.engine.kind != "hf":
        return (
            "--layers reads every layer of the embedded engine (engine.kind=hf); an SGLang "
            "server returns no per-layer states through its API (docs/true-on-policy.md says "
            "what it can return)"
        )
    return None


def compare_layers(driver: Any, count: int) -> tuple[list[OpDiff], dict[str, Any]]:
    """Build the run of `driver`, generate rollout 0 and trace its first `count` samples
    through the engine's decode path and the trainer's forward.

    Returns:
        The per-op figures and what was compared (samples, tokens, dtypes).
    """
    from ember import calls
    from ember.certify import engine_dtype

    config = driver.config
    driver.run_dir.mkdir(parents=True, exist_ok=True)
    driver.start()
    driver.build()
    driver.load_initial_weights()
    samples = [s for s in driver.loop.take(0).samples if s.response_length > 0][:count]
    if not samples:
        raise ValueError("rollout 0 has no sample with a response to compare")
    sequences = [
        (s.tokens[: s.total_length - s.response_length], s.tokens[-s.response_length :])
        for s in samples
    ]
    engine = driver.actors.engines[0]
    ours = calls.get(engine.trace_layers.remote(sequences, config.rollout.temperature))
    if ours is None:  # `refusal` says this before anything starts
        raise ValueError("the engine cannot trace its layers")
    [theirs] = calls.get([rank.trace_layers.remote(samples) for rank in driver.actors.train])
    num_layers = config.train.model_config().num_layers
    diffs = compare_traces(ours[0], theirs[0], ours[1], theirs[1], num_layers=num_layers)
    scope = {
        "samples": len(samples),
        "positions": sum(s.total_length - 1 for s in samples),
        "response_tokens": sum(s.response_length for s in samples),
        "engine_dtype": engine_dtype(config),
        "train_dtype": config.train.dtype,
        "num_layers": num_layers,
    }
    return diffs, scope
