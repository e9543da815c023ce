"""`ember certify`: whether a setup trains on the policy its engine samples, row by row.

The certifier builds the run a config describes (its checkpoint, model family, TP/EP/PP layout,
engine, placement, dtypes and sampling), with the `certify` plugin enabled so that the trainer
scores every rollout itself (an audit), and measures, in this order:

1. the initial weights: the engine holds exactly the trainer's (per-tensor SHA-256);
2. rollout 0, from those weights, scored by the trainer: sampled-token log-probs, routing,
   the on-policy start (the first step's ppo_kl), the reference;
3. one update on rollout 0 and a push, then the weights again, the weight version the
   engine reports, and the same prompts generated twice from the new weights (determinism and
   a rollout scored again).

It keeps nothing a run would: no checkpoint is saved, and engines the run attached to (SGLang
`engine.sglang.urls`) get the initial weights back. Each judgement is one of
`ember_core.certify`'s, the ones the `ci_kl_checker` plugin and the device check use.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ember import calls
from ember_core.certify import (
    TOLERANCE,
    MismatchBars,
    at_most,
    exactly_one,
    exactly_zero,
    mismatch_ceiling,
    reference_source,
)

logger = logging.getLogger(__name__)

PLUGIN = "certify"
"""The plugin `ember certify` enables in the run it builds (`ember.certify_plugin`, one of
`ember.config.BUILT_IN_PLUGINS`)."""
CERTIFICATE = "certificate.json"
"""The certificate's file in the run directory."""
PASS, FAIL, REPORTED, NOT_APPLICABLE = "PASS", "FAIL", "reported", "n/a"
TOP_K = 20
"""Ids per position in the full-distribution row: the engine's most likely (SGLang's
`top_logprobs_num` takes the same), the rest of the vocabulary as one outcome."""
DISTRIBUTION_SAMPLES = 16
"""Samples of a rollout the full-distribution row compares (one forward each on both sides)."""


@dataclasses.dataclass(slots=True)
class Row:
    """One check of the certificate."""

    row: str
    """Its number: "1" to "8", "7.x" for the checks again after the update."""
    check: str
    measured: str
    bar: str
    verdict: str
    """PASS, FAIL, reported (measured, no bar) or n/a (does not apply to this setup)."""
    detail: str = ""
    """Why it does not apply, or what failed."""


def run_overrides(config: Any) -> dict[str, Any]:
    """The resolved config `config` (a `RunConfig`) as the certifier runs it: a whole run (not
    half of one) of two rollouts, no checkpoints, evaluation, dumps or plots, the CI checker's
    own switch off (its checks are rows here) and the `certify` plugin enabled.

    Raises:
        ValueError: A colocated GPU run (`ray.colocate`): its engines and trainer hold the GPUs
            in turn, and the certificate compares them side by side.
    """
    from ember.placement import colocated_on_gpu

    if colocated_on_gpu(config):
        raise ValueError(
            "ray.colocate=true on GPUs: the engines and the trainer hold the GPUs in turn, and "
            "the certificate compares them side by side; certify the setup with "
            "ray.colocate=false (the same model, layout, engine and dtypes)"
        )
    data = config.to_dict()
    run = data.setdefault("run", {})
    run.update(num_rollouts=2, save_interval=0, eval_interval=0, plot=False)
    run.update(rollout_only=False, train_from_rollouts=None)
    run.update(dump_rollouts=False, tensorboard=False, wandb_project=None)
    data.setdefault("ci", {})["test"] = False
    data["plugins"] = [*(p for p in data.get("plugins") or [] if p != PLUGIN), PLUGIN]
    return data


def weights_row(
    row: str,
    trainer: Mapping[str, str],
    engines: Sequence[Mapping[str, str | None] | None],
    when: str,
) -> Row:
    """Whether every engine serves each tensor the trainer holds, byte for byte (digests by
    transformers name)."""
    check = f"weights arrive ({when})"
    bar = "every tensor equal (SHA-256)"
    if not trainer:
        return Row(row, check, "no tensor digests from the trainer", bar, FAIL)
    if any(e is None for e in engines):
        detail = "the engine cannot report its tensors (an SGLang server)"
        return Row(row, check, "not measured", bar, NOT_APPLICABLE, detail)
    missing, differing = [], []
    for name, digest in trainer.items():
        for engine in engines:
            assert engine is not None
            if engine.get(name) is None:
                missing.append(name)
            elif engine[name] != digest:
                differing.append(name)
    equal = len(trainer) * len(engines) - len(missing) - len(differing)
    measured = f"{equal}/{len(trainer) * len(engines)} tensors equal"
    if len(engines) > 1:
        measured += f" over {len(engines)} engines"
    if not missing and not differing:
        return Row(row, check, measured, bar, PASS)
    parts = []
    if differing:
        parts.append(f"differ: {_names(differing)}")
    if missing:
        parts.append(f"not served: {_names(missing)}")
    return Row(row, check, measured, bar, FAIL, "; ".join(parts))


def _names(names: list[str], shown: int = 3) -> str:
    unique = sorted(set(names))
    more = f" and {len(unique) - shown} more" if len(unique) > shown else ""
    return ", ".join(unique[:shown]) + more


def _number(metrics: Mapping[str, Any], key: str) -> float | None:
    value = metrics.get(key)
    return None if value is None else float(value)


def loaded_alike_row(
    row: str,
    pushed: Sequence[Sequence[Sequence[float]] | None],
    loaded: Sequence[Sequence[Sequence[float]] | None],
    when: str,
    sequences: int | None = None,
) -> Row:
    """Where an engine's tensors cannot be read: per engine and server, the log-probs it
    gives the same sequences (`sequences` of them, where known) with the pushed weights
    (`pushed`) and with the same weights loaded from a checkpoint (`loaded`) must be equal."""
    check = f"weights arrive ({when})"
    bar = f"push and checkpoint load score alike (max |diff| < {TOLERANCE:g})"
    if any(p is None for p in pushed):
        detail = "the engine can neither report its tensors nor score a sequence"
        return Row(row, check, "not measured", bar, NOT_APPLICABLE, detail)
    try:
        gaps = [
            abs(a - b)
            for engine_p, engine_l in zip(pushed, loaded, strict=True)
            for server_p, server_l in zip(engine_p, engine_l, strict=True)  # type: ignore[arg-type]
            for a, b in zip(server_p, server_l, strict=True)
        ]
    except ValueError:  # a length differs
        return Row(row, check, "different numbers of tokens scored", bar, FAIL)
    if not gaps:
        return Row(row, check, "no token scored", bar, FAIL)
    largest = max(gaps)
    measured = f"max |diff| {largest:.2e} over {len(gaps)} tokens"
    if sequences is not None:
        measured += f" of {sequences} sequences (sampled)"
    return Row(row, check, measured, bar, PASS if exactly_zero(largest) else FAIL)


def log_prob_row(
    row: str,
    metrics: Mapping[str, Any],
    bars: MismatchBars,
    when: str,
    answers: Sequence[int] = (),
) -> Row:
    """Sampled-token agreement: the mean and per-token maximum |trainer - engine| log-prob,
    each against its own bar; `answers`, the scored samples' response lengths, say over how
    many tokens (a per-token maximum grows with them)."""
    check = f"sampled-token log-probs ({when})"
    mean = _number(metrics, "rollout/train_rollout_logprob_abs_diff")
    largest = _number(metrics, "rollout/train_rollout_logprob_max_abs_diff")
    bar = bars.log_probs()
    if mean is None or largest is None:
        return Row(row, check, "not logged", bar, FAIL, "the engine returned no log-probs")
    ok = at_most(mean, bars.mean) and at_most(largest, bars.max)
    measured = f"mean {mean:.2e}, max {largest:.2e}"
    if answers:
        measured += f" over {sum(answers)} tokens (answers of up to {max(answers)})"
    return Row(row, check, measured, bar, PASS if ok else FAIL)


def top_k_kl(engine: Any, trainer: Any) -> Any:
    """KL(engine || trainer) per position [R] over k + 1 outcomes: the engine's top-k ids and
    the rest of the vocabulary as one. That is the KL of the two distributions coarsened to
    those outcomes, a lower bound on the full KL, and the full KL itself when the k ids cover
    the vocabulary (the rest then has no mass on either side).

    Args:
        engine: [R, k + 1] the engine's log-probs of its top-k ids, then of the rest.
        trainer: [R, k + 1] the trainer's log-probs of the same outcomes.
    """
    import torch

    # Each side renormalised over the k + 1 outcomes: float32 log-softmax sums to 1 only to
    # within about 1e-7, which would make a KL of equal distributions slightly negative.
    engine = engine.double() - engine.double().logsumexp(-1, keepdim=True)
    trainer = trainer.double() - trainer.double().logsumexp(-1, keepdim=True)
    p = engine.exp()
    gap = torch.where(p > 0, engine - trainer, torch.zeros_like(p))  # 0 log 0 = 0
    return (p * gap).sum(-1)


def distribution_row(
    row: str,
    kl: Any | None,
    bars: MismatchBars,
    *,
    k: int,
    vocab: int,
    when: str,
    detail: str = "",
) -> Row:
    """Full-distribution agreement: KL(engine || trainer) per response position, mean and max."""
    check = f"full-distribution KL ({when})"
    bar = bars.kl()
    if kl is None:
        return Row(row, check, "not measured", bar, NOT_APPLICABLE, detail)
    scope = "the whole vocabulary" if k >= vocab else f"top-{k} ids + the rest of {vocab}"
    mean, largest = float(kl.mean()), float(kl.max())
    ok = at_most(mean, bars.kl_mean) and at_most(largest, bars.kl_max)
    measured = f"mean {mean:.2e}, max {largest:.2e} over {scope}"
    return Row(row, check, measured, bar, PASS if ok else FAIL, detail)


def routing_row(
    row: str,
    metrics: Mapping[str, Any],
    *,
    moe: bool,
    replaying: bool,
    when: str,
) -> Row:
    """The trainer's own routing against the engine's recorded experts
    (rollout/routing_agreement, reported) and, under routing replay, the experts the audit's
    probe forward used against the ones it was given to replay: the engine's, each moved to
    the next expert id (rollout/shifted_replay_agreement: exactly 1). Experts no router picks
    by itself are followed only by a forward that replays; the engine's own experts would be
    followed by one that does not too wherever the trainer's routing agrees with the engine's
    (float32)."""
    check = f"routing ({when})"
    bar = "with replay exactly 1 (without: reported)"
    if not moe:
        return Row(row, check, "", bar, NOT_APPLICABLE, "a dense model: no router")
    natural = _number(metrics, "rollout/routing_agreement")
    if not replaying:
        detail = "no routed experts recorded: r3_routing is off"
        if natural is None:
            return Row(row, check, "", bar, NOT_APPLICABLE, detail)
        return Row(row, check, f"without replay {natural:.4f}", bar, REPORTED)
    without = "not logged" if natural is None else f"{natural:.4f}"
    replayed = _number(metrics, "rollout/shifted_replay_agreement")
    if replayed is None:
        measured = f"without replay {without}; with replay not logged"
        detail = "r3_routing is on, but no forward replayed the shifted experts"
        return Row(row, check, measured, bar, FAIL, detail)
    measured = f"without replay {without}; with replay {replayed:.4f} (shifted experts)"
    return Row(row, check, measured, bar, PASS if exactly_one(replayed) else FAIL)


def on_policy_row(steps: Sequence[Mapping[str, Any]]) -> Row:
    """The first step's ppo_kl against the trainer's own old log-probs: exactly 0."""
    check = "on-policy start (first step)"
    bar = f"|ppo_kl| and max |old - new| < {TOLERANCE:g}"
    first = steps[0] if steps else {}
    kl, largest = _number(first, "train/ppo_kl"), _number(first, "train/ppo_kl_abs_max")
    if kl is None or largest is None:
        return Row("5", check, "not logged", bar, FAIL)
    ok = exactly_zero(kl) and exactly_zero(largest)
    measured = f"ppo_kl {kl:.2e}, max {largest:.2e}"
    return Row("5", check, measured, bar, PASS if ok else FAIL)


def reference_row(
    metrics: Mapping[str, Any], *, reference: bool, replaying: bool, source: str | None = None
) -> Row:
    """The reference at the start. Where it is the actor's initial weights: against the actor
    (the reference replaying the rollout's routing under routing replay), exactly equal
    log-probs. Where it comes from a checkpoint of its own (`source`, `train.ref_load` naming
    other weights than the actor's: RL continued from a checkpoint, an SFT model as reference)
    the actor need not agree with it: against a second model built from that checkpoint,
    exactly equal log-probs (each scoring with its own routing)."""
    if source is not None:
        check = "reference is train.ref_load (start)"
        bar = f"max |reference - rebuilt from train.ref_load| < {TOLERANCE:g}"
        key = "rollout/ref_rebuilt_log_probs_max_abs_diff"
    else:
        check = "reference equals actor (start)"
        bar = f"max |actor - reference| < {TOLERANCE:g}"
        key = (
            "rollout/ref_replayed_log_probs_max_abs_diff"
            if replaying
            else "rollout/log_probs_ref_max_abs_diff"
        )
    if not reference:
        detail = "the config builds no reference model (no KL loss or penalty, no train.ref_load)"
        return Row("6", check, "", bar, NOT_APPLICABLE, detail)
    value = _number(metrics, key)
    if value is None:
        return Row("6", check, "not logged", bar, FAIL, f"{key} missing")
    replayed = ", routing replayed" if replaying and source is None else ""
    verdict = PASS if exactly_zero(value) else FAIL
    return Row("6", check, f"max {value:.2e}{replayed}", bar, verdict)


def version_row(versions: Sequence[str | None], expected: str) -> Row:
    """Every sample generated after the push carries the pushed weight version."""
    check = "weight version (after the update)"
    bar = f"every sample's version is {expected!r}"
    seen = sorted({str(v) for v in versions})
    measured = "versions " + ", ".join(seen)
    ok = bool(versions) and all(str(v) == expected for v in versions)
    return Row("7.5", check, measured, bar, PASS if ok else FAIL)


def determinism_row(
    first: Sequence[Sequence[int]], second: Sequence[Sequence[int]], *, seeded: bool
) -> Row:
    """The same requests (same prompts, same seeds) twice: the same tokens, where the engine
    takes a seed per request (`seeded`); reported where it does not. Both generations start
    from the same position of the prompt stream (`generate_again`), so groups the dynamic
    filter drops are replaced by the same prompts each time."""
    check = "determinism (same request twice)"
    same = sum(a == b for a, b in zip(first, second, strict=True))
    measured = f"{same}/{len(first)} samples equal"
    bar = "every sample's tokens equal"
    if not seeded:
        detail = "the engine takes no seed per request (SGLang): reported, not required"
        return Row("8", check, measured, bar, REPORTED, detail)
    verdict = PASS if same == len(first) and len(first) == len(second) else FAIL
    return Row("8", check, measured, bar, verdict)


def generate_again(manager: Any, rollout_id: int, prompts: list[Any], times: int = 2) -> list[Any]:
    """`prompts` generated as rollout `rollout_id` by the run's rollout manager `times` times,
    each from the same position of the prompt stream (its state taken before the first and
    put back before each): under the dynamic filter a group the new weights leave without
    signal is dropped and replaced by the stream's next prompts, which one generation would
    otherwise move on for the next. The filter stays as configured: row 8 certifies the
    generation the run does."""
    stream = calls.get(manager.state_dict.remote())
    batches = []
    for _ in range(times):
        calls.get(manager.load_state_dict.remote(stream))
        batches.append(calls.get(manager.generate.remote(rollout_id, prompts)))
    return batches


def passed(rows: Sequence[Row]) -> bool:
    """No row failed."""
    return all(r.verdict != FAIL for r in rows)


def table(rows: Sequence[Row]) -> str:
    """The certificate as a fixed-width table, one line per row (details indented below)."""
    header = ("row", "check", "measured", "bar", "verdict")
    cells = [header] + [(r.row, r.check, r.measured, r.bar, r.verdict) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    lines = []
    for i, cell in enumerate(cells):
        lines.append("  ".join(v.ljust(w) for v, w in zip(cell, widths, strict=True)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
        elif rows[i - 1].detail:
            lines.append(" " * (widths[0] + 2) + rows[i - 1].detail)
    return "\n".join(lines)


def write_certificate(run_dir: Path, rows: Sequence[Row], setup: Mapping[str, Any]) -> Path:
    """The certificate as JSON in `run_dir` (`CERTIFICATE`)."""
    path = Path(run_dir) / CERTIFICATE
    document = {
        "passed": passed(rows),
        "setup": dict(setup),
        "rows": [dataclasses.asdict(r) for r in rows],
    }
    path.write_text(json.dumps(document, indent=2) + "\n")
    return path


def describe_setup(config: Any) -> dict[str, Any]:
    """What the certificate is of: model, family, layout, engine, dtypes, sampling (no loop:
    the rows are measured in turn whatever `rollout.async` says, `ember.certify_matrix`)."""
    model = config.train.model_config()
    parallel = config.train.parallel
    engine = config.engine
    return {
        "model": config.train.hf_load or config.train.model,
        "family": model.family,
        "experts": getattr(model, "num_experts", None),
        "layout": {
            "tp": parallel.tensor_parallel,
            "pp": parallel.pipeline_parallel,
            "ep": parallel.expert_parallel,
            "data_parallel": config.ray.data_parallel,
        },
        "engine": engine.kind,
        "engines": config.ray.num_engines,
        "engine_dtype": engine_dtype(config),
        "trainer_dtype": config.train.dtype,
        "temperature": config.rollout.temperature,
        "plugins": [p for p in config.plugins if p != PLUGIN],
    }


def engine_dtype(config: Any) -> str | None:
    """The dtype the run's engine computes in where the config says it (None: an attached
    server's, or SGLang's own choice)."""
    engine = config.engine
    if engine.kind == "hf":
        return engine.hf.dtype
    sglang = engine.sglang
    return None if sglang.urls or sglang.dtype in (None, "auto") else sglang.dtype


def certify(driver: Any) -> list[Row]:
    """Build the run of `driver` (a `Driver` over `run_overrides`), measure every row, and
    leave attached engines with the initial weights again (whatever happened)."""
    from ember.versions import INITIAL_WEIGHT_VERSION

    driver.run_dir.mkdir(parents=True, exist_ok=True)
    driver.start()
    driver.build()
    driver.load_initial_weights()
    try:
        return _ordered(Certifier(driver).rows())
    finally:
        engine = driver.config.engine
        if engine.kind == "sglang" and engine.sglang.urls and driver.actors is not None:
            path, initial = str(driver.init_dir), INITIAL_WEIGHT_VERSION
            calls.get(
                [e.update_weights_from_disk.remote(path, initial) for e in driver.actors.engines]
            )


class Certifier:
    """The measurements of one certificate, over the actors of a built `Driver`."""

    def __init__(self, driver: Any) -> None:
        config = driver.config
        self.driver, self.config, self.actors = driver, config, driver.actors
        self.model = config.train.model_config()
        self.moe = bool(getattr(self.model, "num_experts", 0))
        self.replaying = "r3_routing" in config.plugins
        algorithm = config.algorithm
        self.reference = bool(
            algorithm.use_kl_loss or algorithm.kl_coef > 0 or config.train.ref_load
        )
        self.source = reference_source(config.train.ref_load, config.train.hf_load)
        """The reference's own checkpoint, where it is not the actor's start (row 6)."""
        self.readable = config.engine.kind == "hf"
        """The engine's tensors can be read (the embedded engine; not an SGLang server)."""
        self.bars = mismatch_ceiling(
            engine_dtype(config),
            config.train.dtype,
            exact=config.rollout.true_on_policy,
            quantization=config.engine.quantization,
            qat=config.train.qat,
        )
        self.k = min(TOP_K, self.model.vocab_size)

    def rows(self) -> list[Row]:
        """Rollout 0 from the initial weights (rows 1-6), one update and a push, then the same
        prompts twice from the new weights (rows 7.x and 8)."""
        from ember.versions import INITIAL_WEIGHT_VERSION
        from ember_rollout.rollout import prompts_of

        driver, moe, replaying = self.driver, self.moe, self.replaying
        batch = driver.loop.take(0)
        if self.readable:
            rows = [self.digests("1", "initial load")]
        else:  # the initial weights by the run's transport, then from the initial export
            driver.pusher.send(INITIAL_WEIGHT_VERSION)
            initial = (driver.init_dir, INITIAL_WEIGHT_VERSION)
            rows = [self.loaded_alike("1", "initial load", batch.samples, *initial)]
        scored = driver.score(0, batch.samples)  # an audit: with the shifted-experts probe
        rows.append(self.distribution("3", "start", batch.samples))  # before the update
        steps = driver.train(0)
        answers = [s.response_length for s in batch.samples]
        rows.append(log_prob_row("2", scored, self.bars, "start", answers))
        rows.append(routing_row("4", scored, moe=moe, replaying=replaying, when="start"))
        rows.append(on_policy_row(steps))
        rows.append(
            reference_row(scored, reference=self.reference, replaying=replaying, source=self.source)
        )
        arrived, went_through = self.push()
        if not went_through:  # refused: the engine serves the old weights, nothing to measure
            return [*rows, arrived]
        again = generate_again(self.actors.manager, 1, prompts_of(batch.samples))
        rows.append(version_row([s.weight_version for s in again[0].samples], "0"))
        rows += self.after_update(again[0].samples, scored_ok=rows[-1].verdict == PASS)
        tokens = [[s.tokens for s in b.samples] for b in again]
        rows.append(determinism_row(*tokens, seeded=self.readable))
        # Where the engine's tensors cannot be read, row 7.1 reloads the update from disk:
        # last, so that rows 7.2-7.5 and 8 measure what the push itself left in the engine.
        rows.append(arrived if arrived is not None else self.reloaded_alike(batch.samples))
        return rows

    def push(self) -> tuple[Row | None, bool]:
        """Push the updated weights as version 0. Returns row 7.1 where it is known now (a
        FAIL when the push was refused; the digests on the embedded engine; None where it
        needs the reload from disk, `reloaded_alike`) and whether the push went through."""
        when = "after the update"
        try:
            self.driver.push_weights(0)
        except Exception as exc:  # refused: the engine keeps the old weights
            cause = getattr(exc, "cause", None) or exc  # a Ray actor's error wraps the engine's
            detail = f"the push failed: {type(cause).__name__}: {cause}"
            return Row("7.1", f"weights arrive ({when})", "", "", FAIL, detail), False
        return (self.digests("7.1", when) if self.readable else None), True

    def reloaded_alike(self, samples: list[Any]) -> Row:
        """Row 7.1 where the engine's tensors cannot be read: the trainer's update exported,
        the engine's scores of rollout 0's sequences with the pushed weights against the same
        weights loaded from that export."""
        export = self.driver.run_dir / "certify-weights"
        try:
            calls.get([t.export_hf.remote(str(export)) for t in self.actors.train])
            return self.loaded_alike("7.1", "after the update", samples, export, "0")
        finally:
            shutil.rmtree(export, ignore_errors=True)

    def after_update(self, samples: list[Any], *, scored_ok: bool) -> list[Row]:
        """Rows 7.2-7.4 on samples generated from the pushed weights (not scored when they
        do not carry the pushed version: the trainer refuses to audit older samples)."""
        when = "after the update"
        if not scored_ok:
            detail = "not scored: the samples do not carry the pushed version (row 7.5)"
            return [Row("7.2", f"sampled-token log-probs ({when})", "", "", FAIL, detail)]
        rescored = self.driver.score(1, samples)
        return [
            log_prob_row("7.2", rescored, self.bars, when, [s.response_length for s in samples]),
            self.distribution("7.3", when, samples),
            routing_row("7.4", rescored, moe=self.moe, replaying=self.replaying, when=when),
        ]

    def digests(self, row: str, when: str) -> Row:
        """Row 1 on the embedded engine: per-tensor SHA-256, trainer against engine."""
        dtype = engine_dtype(self.config)
        held = calls.get([t.weights_digests.remote(dtype) for t in self.actors.train])
        trainer = next((d for d in held if d), {})
        shapes = {name: shape for name, (shape, _) in trainer.items()}
        served = calls.get([e.weights_digests.remote(shapes) for e in self.actors.engines])
        return weights_row(row, {n: d for n, (_, d) in trainer.items()}, served, when)

    def loaded_alike(
        self, row: str, when: str, samples: list[Any], path: Path, version: str
    ) -> Row:
        """Row 1 where the engine's tensors cannot be read: the engine scores every sequence
        of `samples` with the weights pushed and with the same weights loaded from disk. A
        sample of what the weights do, not a reading of every tensor: an expert no sequence
        is routed to goes unchecked."""
        engines = self.actors.engines
        sequences = [s.tokens for s in samples]
        pushed = calls.get([e.prompt_log_probs.remote(sequences) for e in engines])
        calls.get([e.update_weights_from_disk.remote(str(path), version) for e in engines])
        loaded = calls.get([e.prompt_log_probs.remote(sequences) for e in engines])
        return loaded_alike_row(row, pushed, loaded, when, len(sequences))

    def distribution(self, row: str, when: str, samples: list[Any]) -> Row:
        """Row 3: the engine's top-k against the trainer's log-probs of the same ids."""
        import torch

        scope = dict(k=self.k, vocab=self.model.vocab_size, when=when)
        if self.config.train.parallel.pipeline_parallel > 1:
            detail = "not built for pipeline parallelism yet (train.parallel.pipeline_parallel)"
            return distribution_row(row, None, self.bars, **scope, detail=detail)
        chosen = samples[:DISTRIBUTION_SAMPLES]
        temperature = self.config.rollout.temperature
        engine = self.actors.engines[0]
        replay = self.replaying and self.moe  # as the trainer's forward does under R3
        top = calls.get(engine.top_log_probs.remote(chosen, self.k, temperature, replay=replay))
        if top is None:
            detail = "the engine does not report its distribution (an SGLang server)"
            return distribution_row(row, None, self.bars, **scope, detail=detail)
        ids = [i for i, _ in top]
        held = calls.get([t.log_probs_at.remote(chosen, ids) for t in self.actors.train])[0]
        kl = torch.cat([top_k_kl(e, t) for (_, e), t in zip(top, held, strict=True)])
        detail = "engine and trainer replay the rollout's experts" if replay else ""
        return distribution_row(row, kl, self.bars, **scope, detail=detail)


def _ordered(rows: list[Row]) -> list[Row]:
    return sorted(rows, key=lambda r: [int(x) for x in r.row.split(".")])
