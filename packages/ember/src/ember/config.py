"""The run config: every package's sections, plugin sections, YAML files and `--set` overrides."""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from ember_core.algorithms import OFF_POLICY_CORRECTIONS
from ember_core.config import (
    AlgorithmConfig,
    CIConfig,
    SamplingConfig,
    check,
    from_dict,
    resolve_tis,
    to_dict,
)
from ember_core.plugins import EmberPlugins, installed_plugins
from ember_megatron_backend.config import BackendConfig, is_hf_checkpoint
from ember_rollout.config import RolloutSections

logger = logging.getLogger(__name__)


def _examples_dir() -> Path:
    """The copy inside the package once installed; the repository's examples/ in a checkout."""
    packaged = Path(__file__).resolve().parent / "examples"
    return packaged if packaged.is_dir() else Path(__file__).resolve().parents[4] / "examples"


EXAMPLES_DIR = _examples_dir()
DEFAULT_CONFIG = "default"
"""The example `ember train` runs with no config argument (examples/default.yaml)."""
EVAL_SET_NAME = re.compile(r"[A-Za-z0-9_.-]+")
"""What an eval set's name may hold: it becomes part of metric keys (`eval/<name>/reward`)."""
BUILT_IN_PLUGINS = {"certify": "ember.certify_plugin"}
"""Plugins that are part of this package, not installed ones (`ember plugins` does not list
them): `ember certify` enables `certify` in the run it builds."""


def load_plugins(enabled: Sequence[str]) -> EmberPlugins:
    """The enabled plugins, installed or built in (`BUILT_IN_PLUGINS`), loaded and registered."""
    return EmberPlugins.load(enabled, BUILT_IN_PLUGINS)


@dataclass(kw_only=True, slots=True)
class RunSection:
    """The run as a whole: length, output directory, checkpoints and logging."""

    name: str = "ember"
    """Run name; the default directory is runs/<name>-<timestamp>."""
    dir: str | None = None
    """Output directory (config, metrics.jsonl, TensorBoard, checkpoints, plots)."""
    num_rollouts: int = 30
    """Rollouts (RL iterations) to run."""
    save_interval: int = 10
    """Save a checkpoint every this many rollouts (and after the last one); 0 disables."""
    keep_checkpoints: int = 2
    """Newest checkpoints kept on disk; older complete ones are deleted after a save."""
    eval_interval: int = 0
    """Evaluate every eval set after every this many rollouts (rollouts interval - 1,
    2 x interval - 1, ...) and after the last one, logging `eval/<set>/*` records; 0 turns
    evaluation off."""
    eval_prompts: int = 32
    """Prompts per eval set: the first this many of each set."""
    eval_temperature: float = 0.01
    """Sampling temperature of evaluations (top_p and top_k are the rollout's)."""
    eval_samples_per_prompt: int = 1
    """Responses per eval prompt; above 1, `eval/<set>/pass@<n>` is logged too (the fraction
    of prompts with a response of full reward, 1.0)."""
    eval_sets: dict[str, str] = field(default_factory=dict)
    """Eval sets by name: a path like `data.prompt_data`'s (JSONL, parquet, parquet shards or a
    glob, or a datasets directory, read with the data section's keys), or `toy` (the toy
    task's prompts drawn with data.toy.seed + 1). Empty: one set named `toy` when the run trains
    on the toy task (a run on `data.prompt_data` must name its sets)."""
    dump_rollouts: bool = False
    """Write every rollout's samples to rollouts/<id>.jsonl in the run directory (tokens,
    rewards, loss masks, the engine's log-probs, weight versions and metadata: what
    `train_from_rollouts` trains on), under a header line with the run's provenance (sampling
    settings, group size, model and tokenizer: `dump_provenance`), and the routed experts,
    where recorded, in a binary side file <id>.experts.safetensors. Each file is written under
    a temporary name and renamed."""
    rollout_only: bool = False
    """Generate, score and dump rollouts (as `dump_rollouts` does) without training: no trainer
    process, no weight push, no checkpoint. Every rollout comes from the weights of
    `train.hf_load` (an HF checkpoint, for example an earlier run's hf_init). With
    `train_from_rollouts` on the dump, the two halves of a run debug apart (`ember train
    --rollout-only`)."""
    train_from_rollouts: str | None = None
    """Train on the rollouts an earlier run dumped (its rollouts/ directory, rollout i read
    from <i>.jsonl) instead of generating them: no engine process, no weight push, no
    evaluation, no checkpoint. The same config and seed train as the run that dumped them did
    (`ember train --train-from-rollouts DIR`). Every dump is read before any process starts,
    and refused in one line: one whose provenance differs from this run's (another
    temperature, top-p, top-k, group size, model or tokenizer), one without it (written before
    dumps recorded it), and, where a plugin checks the run (the CI checker), a rollout its
    checks cannot pass: audited with samples from weights older than the trainer's, or staler
    than `rollout.max_staleness` (a rollout-only run's dump comes from the initial weights)."""
    tensorboard: bool = True
    """Write TensorBoard events to <dir>/tensorboard."""
    wandb_project: str | None = None
    """Log to this wandb project too (needs `pip install wandb`)."""
    plot: bool = True
    """Write PNG curves to <dir>/plots at the end of the run."""

    def __post_init__(self) -> None:
        check(self.num_rollouts >= 1, "num_rollouts", self.num_rollouts, ">= 1")
        check(self.save_interval >= 0, "save_interval", self.save_interval, ">= 0")
        check(self.keep_checkpoints >= 1, "keep_checkpoints", self.keep_checkpoints, ">= 1")
        check(self.eval_interval >= 0, "eval_interval", self.eval_interval, ">= 0")
        check(self.eval_prompts >= 1, "eval_prompts", self.eval_prompts, ">= 1")
        check(self.eval_temperature > 0, "eval_temperature", self.eval_temperature, "> 0")
        check(
            not (self.rollout_only and self.train_from_rollouts is not None),
            "rollout_only",
            self.rollout_only,
            "false with train_from_rollouts (one half of a run at a time)",
        )
        check(
            self.eval_samples_per_prompt >= 1,
            "eval_samples_per_prompt",
            self.eval_samples_per_prompt,
            ">= 1",
        )
        for name, source in self.eval_sets.items():
            check(
                bool(EVAL_SET_NAME.fullmatch(str(name))),
                f"eval_sets.{name}",
                source,
                "a set name of letters, digits, '_', '-' or '.' (it names metrics)",
            )
            check(
                isinstance(source, str) and bool(source),
                f"eval_sets.{name}",
                source,
                "a path (JSONL, parquet or a datasets directory) or 'toy'",
            )


@dataclass(kw_only=True, slots=True)
class RaySection:
    """Where the pieces run."""

    enabled: Literal["auto", True, False] = "auto"
    """Whether the run's roles (training ranks, engines, the rollout manager) are Ray actors,
    each a process of its own (true), or plain objects in the `ember train` process, each on
    threads of its own (false). auto: in this process when every role fits one (one training
    rank, one embedded `hf` engine, no GPUs, no `address`), Ray otherwise. In one process
    nothing is serialised and weights are copied straight into the engine (`weights.transport`
    direct); an engine cannot fail apart from the run there, so `fault_tolerance` applies
    under Ray only. `ember train` prints which it uses."""
    address: str | None = None
    """Ray cluster to join ("auto" or host:port); None starts a local Ray."""
    num_cpus: int | None = None
    """CPUs of a local Ray; None: all of this machine's."""
    object_store_mb: int | None = None
    """Object store of a local Ray, in MiB; None: Ray's default (30% of memory). What passes
    through it is samples and metrics (weights travel by torch.distributed), so a small store
    suffices for small runs, and Ray starts faster with one (about 1 s on a 2-core machine);
    Ray spills objects to disk when it is full."""
    data_parallel: int = 1
    """Training ranks (Ray actors, one torch.distributed process each)."""
    gpus_per_rank: float = 0.0
    """GPUs per training rank: 0 trains on CPU, 1 gives each rank a GPU of its own, a fraction
    below 1 is a share of one GPU. Ranks never share a GPU with each other (NCCL refuses two
    ranks of one group on one device): with several ranks, a share of 0.5 or less needs
    `colocate: true`, where rank i shares GPU i with engine i."""
    colocate: bool = True
    """With GPUs on both sides, training rank i and engine i share GPU i (one placement group,
    one bundle per GPU; `gpus_per_rank + gpus_per_engine` must fit in 1). SGLang engines
    release their GPU memory while the trainer trains and the trainer moves its state to CPU
    memory while the engines generate; the embedded `hf` engine keeps its weights in place.
    False: each side has GPUs of its own."""
    num_engines: int = 1
    """Rollout engine actors."""
    gpus_per_engine: float = 0.0
    """GPUs per rollout engine actor: 0 generates on CPU, a fraction below 1 is a share of one
    GPU, a whole number N gives the engine N GPUs of one node (SGLang tensor parallelism).
    Shares of 0.5 or less with colocate: false pack engines onto one GPU: embedded engines and
    attached SGLang servers only; two launched SGLang servers on one GPU are refused (sglang
    sizes each one's KV pool from memory the others are still filling, and NCCL refuses two
    ranks of the weight group on one GPU)."""
    threads_per_actor: int | None = None
    """torch threads of each actor; None divides this machine's cores between them."""
    placement_timeout_s: float = 120.0
    """Seconds to wait for the cluster to grant the placement groups' GPUs (other jobs may hold
    them) before the run fails, naming what it waited for."""

    def __post_init__(self) -> None:
        check(self.data_parallel >= 1, "data_parallel", self.data_parallel, ">= 1")
        check(
            self.object_store_mb is None or self.object_store_mb >= 80,
            "object_store_mb",
            self.object_store_mb,
            ">= 80 (Ray's minimum object store is 75 MiB) or null",
        )
        if self.address is not None and self.object_store_mb is not None:
            raise ValueError(
                f"object_store_mb={self.object_store_mb}: sizes the Ray this run starts, and "
                f"address={self.address!r} joins a running one (size its store where it starts: "
                "`ray start --object-store-memory`)"
            )
        check(
            0 <= self.gpus_per_rank <= 1,
            "gpus_per_rank",
            self.gpus_per_rank,
            "0 (CPU), a share of one GPU, or 1: a training rank is one process on one device",
        )
        check(self.num_engines >= 1, "num_engines", self.num_engines, ">= 1")
        check(
            0 <= self.gpus_per_engine < 1 or float(self.gpus_per_engine).is_integer(),
            "gpus_per_engine",
            self.gpus_per_engine,
            "0 (CPU), a share of one GPU (< 1), or a whole number of GPUs",
        )
        check(self.placement_timeout_s > 0, "placement_timeout_s", self.placement_timeout_s, "> 0")
        if self.colocate and self.gpus_per_rank > 0 and self.gpus_per_engine > 0:
            shares = self.gpus_per_rank + self.gpus_per_engine
            check(
                shares <= 1 + 1e-9,
                "gpus_per_engine",
                self.gpus_per_engine,
                f"at most 1 - gpus_per_rank = {1 - self.gpus_per_rank:g} with colocate: true "
                f"(rank i and engine i share GPU i; {self.gpus_per_rank:g} + "
                f"{self.gpus_per_engine:g} = {shares:g} > 1); set colocate: false to give the "
                "engines GPUs of their own",
            )
        colocated = self.colocate and self.gpus_per_rank > 0 and self.gpus_per_engine > 0
        if not colocated and 0 < self.gpus_per_rank < 1 and self.data_parallel > 1:
            # NCCL 2.30.7 src/init.cc 1057 (initTransportsRank): two ranks of one communicator
            # on one device fail with "Multiple Ranks are using the same GPU/Partition"
            # (ncclInvalidUsage), and GPU ranks train over NCCL. Only a colocated layout shares
            # a rank's GPU, with an engine.
            per_gpu = int(1 / self.gpus_per_rank + 1e-9)
            check(
                per_gpu < 2,
                "gpus_per_rank",
                self.gpus_per_rank,
                f"1, or a share above 0.5: {per_gpu} of the data_parallel {self.data_parallel} "
                "ranks would share one GPU, and NCCL refuses two ranks of one group on one GPU",
            )


@dataclass(kw_only=True, slots=True)
class FaultToleranceSection:
    """What happens when a rollout engine dies or hangs (docs/architecture.md, "Engine
    failures").

    While an engine generates, the rollout manager waits on it for at most
    `health_check_interval_s` at a time; each time it has not answered, it probes the engine
    (a call on a thread of the engine's own that answers beside generation, and for SGLang a
    GET /health of each server) and counts it hung when no answer comes within
    `health_check_timeout_s`. The driver probes every engine before each weight push. A crashed
    engine is seen at once (Ray reports the actor's death, or the server's requests fail and
    its probe confirms it). A failed engine is killed and leaves the pool; the requests it held
    are generated anew on the live engines; the driver starts a replacement in its slot, loads
    the trainer's current weights into it, and puts it back in the pool.
    """

    enabled: bool = True
    """Replace failed engines; false: the first engine failure stops the run (with the error
    that names it and the resume command)."""
    health_check_interval_s: float = 10.0
    """How long the manager waits on a generating engine before probing it."""
    health_check_timeout_s: float = 30.0
    """An engine that does not answer a probe within this is hung; each SGLang server's GET
    /health gets as long (sglang 0.5.23 answers it with a one-token generate that may take up
    to its SGLANG_HEALTH_CHECK_TIMEOUT, 20 s by default, on a busy server)."""
    first_start_timeout_s: float = 600.0
    """The grace a replacement has to load the model (or launch its SGLang servers) and answer
    before it counts as failed too."""
    max_restarts: int = 3
    """Replacements per engine slot over the run; one more failure of that slot stops the
    run."""

    def __post_init__(self) -> None:
        for key in ("health_check_interval_s", "health_check_timeout_s", "first_start_timeout_s"):
            check(getattr(self, key) > 0, key, getattr(self, key), "> 0 (seconds)")
        check(self.max_restarts >= 0, "max_restarts", self.max_restarts, "an integer >= 0")


WEIGHT_TRANSPORTS = ("broadcast", "ipc", "disk", "direct")
"""How the trainer's weights can reach the engines (`weights.transport`)."""


@dataclass(kw_only=True, slots=True)
class WeightsSection:
    """How the actor's weights reach the rollout engines after each rollout. The training
    ranks send them; they never pass through the driver process."""

    transport: str = "auto"
    """broadcast: the training rank that holds the gathered weights broadcasts them in
    flattened buckets over a process group it forms with the engines (gloo into the embedded
    `hf` engine; to SGLang servers NCCL when the trainer and the servers are both on GPUs,
    gloo otherwise). ipc: buckets handed to SGLang servers on the training ranks' GPUs as CUDA
    IPC handles (SGLang with `ray.colocate: true` on GPUs; rank i feeds engine i). disk: an HF
    checkpoint under the run directory that every engine loads (a debugging fallback; attached
    servers must see the path). direct: the trainer's tensors copied straight into the embedded
    engine's model, in buckets, nothing serialised (a run in one process, `ray.enabled`).
    auto: direct in one process, ipc for SGLang colocated on GPUs, broadcast otherwise (disk
    for an engine kind that cannot join a weight group)."""
    bucket_mb: int = 512
    """MiB of flattened tensors per bucket (broadcast and ipc): beyond the model, the sending
    rank holds about two buckets' worth at a time."""

    def __post_init__(self) -> None:
        check(
            self.transport == "auto" or self.transport in WEIGHT_TRANSPORTS,
            "transport",
            self.transport,
            f"auto or one of {', '.join(WEIGHT_TRANSPORTS)}",
        )
        check(self.bucket_mb >= 1, "bucket_mb", self.bucket_mb, "an integer >= 1 (MiB)")

    @property
    def bucket_bytes(self) -> int:
        return self.bucket_mb << 20


@dataclass(kw_only=True, slots=True)
class RunConfig(RolloutSections):
    """A whole run: the top level of a run config file.

    The rollout package's sections (`engine`, `data`, `reward`, `group_sampling`) come from
    `RolloutSections`, so a run config is what `RolloutGenerator.from_config` reads.
    """

    run: RunSection = field(default_factory=RunSection)
    """The run as a whole."""
    ray: RaySection = field(default_factory=RaySection)
    """Placement."""
    rollout: SamplingConfig = field(default_factory=SamplingConfig)
    """Rollout sampling."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """RL objective."""
    train: BackendConfig = field(default_factory=BackendConfig)
    """Megatron training: model, parallelism, optimizer, steps."""
    plugins: list[str] = field(default_factory=list)
    """Plugins to enable by entry-point name; installed plugins stay off unless listed."""
    ci: CIConfig = field(default_factory=CIConfig)
    """CI-only invariants."""
    weights: WeightsSection = field(default_factory=WeightsSection)
    """Weight transfer from the trainer to the engines."""
    fault_tolerance: FaultToleranceSection = field(default_factory=FaultToleranceSection)
    """Engine health checks and replacement."""
    plugin_sections: dict[str, Any] = field(default_factory=dict)
    """Each enabled plugin's parsed section, by name (filled from top-level keys)."""

    def to_dict(self) -> dict[str, Any]:
        """The plain-data form, with plugin sections back at the top level."""
        data = {
            f.name: to_dict(getattr(self, f.name))
            if dataclasses.is_dataclass(getattr(self, f.name))
            else getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "plugin_sections"
        }
        for name, section in self.plugin_sections.items():
            data[name] = to_dict(section) if dataclasses.is_dataclass(section) else section
        return data


def _set_path(data: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = data
    for i, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ValueError(f"--set {dotted}: {'.'.join(keys[: i + 1])} is not a section")
        node = child
    node[keys[-1]] = value


def parse_overrides(items: Sequence[str]) -> list[tuple[str, Any]]:
    """Parse `a.b=value` strings; values are read as YAML scalars (`null`, `1e-3`, `[a, b]`)."""
    parsed = []
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(
                f"--set {item!r}: expected KEY=VALUE, for example rollout.temperature=0.7"
            )
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        parsed.append((key.strip(), value))
    return parsed


def resolve_config_path(config: str | None) -> Path:
    """A config argument as a file: a path, or the name of a file under examples/."""
    name = config or DEFAULT_CONFIG
    path = Path(name)
    if path.is_file():
        return path
    for candidate in (EXAMPLES_DIR / name, EXAMPLES_DIR / f"{name}.yaml"):
        if candidate.is_file():
            return candidate
    known = sorted(p.stem for p in EXAMPLES_DIR.glob("*.yaml")) if EXAMPLES_DIR.is_dir() else []
    raise ValueError(
        f"config {name!r}: no such file, and no example of that name ({', '.join(known)})"
    )


def read_yaml(path: str | Path) -> Any:
    """Parse a YAML file; a syntax error becomes one line, `FILE:LINE:COLUMN: problem`.

    Raises:
        ValueError: The file does not parse; the message names where and what PyYAML expected.
    """
    path = Path(path)
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = exc.problem or exc.context or "not valid YAML"
        if exc.problem and exc.context:
            context = exc.context
            if exc.context_mark is not None:
                cm = exc.context_mark
                context += f" at line {cm.line + 1}, column {cm.column + 1}"
            problem += f" ({context})"
        raise ValueError(f"{where}: {problem}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid YAML ({exc})") from None


CORRECTION_FLAGS = ("use_rollout_log_probs", "use_tis", "tis_mode", "tis_level")
"""The `algorithm` keys a named `algorithm.off_policy_correction` sets."""


def _yield_to_overrides(data: dict[str, Any], overridden: set[str]) -> None:
    """Let an override of the off-policy correction replace the file's, whichever way the
    file says it: `--set algorithm.off_policy_correction=NAME` drops the file's flags of
    `CORRECTION_FLAGS` (unless also overridden), and overriding a flag drops the file's
    correction name. Within one layer, a name and a flag that disagree stay refused."""
    algorithm = data.get("algorithm")
    if not isinstance(algorithm, dict):
        return
    if "algorithm.off_policy_correction" in overridden:
        for flag in CORRECTION_FLAGS:
            if f"algorithm.{flag}" not in overridden:
                algorithm.pop(flag, None)
    elif any(f"algorithm.{flag}" in overridden for flag in CORRECTION_FLAGS):
        algorithm.pop("off_policy_correction", None)


def load_config(
    config: str | Path | Mapping[str, Any] | None = None,
    *,
    overrides: Sequence[str] = (),
    plugins: Sequence[str] | None = None,
) -> tuple[RunConfig, EmberPlugins]:
    """Read a run config, apply overrides, load the enabled plugins and parse their sections.

    Args:
        config: A YAML file, an example name, an already-read mapping, or None for the default.
        overrides: `key=value` strings (`--set`), applied after the file.
        plugins: Replaces the file's `plugins` list when given (`--plugins`).

    Returns:
        The validated config and the loaded plugins (already configured).

    Raises:
        ValueError: One line naming the bad key, its value and what is allowed.
    """
    if isinstance(config, Mapping):
        data = dict(config)
    else:
        path = resolve_config_path(str(config) if config is not None else None)
        data = read_yaml(path) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of sections at the top level")
        data.setdefault("run", {}).setdefault("name", path.stem)
    parsed = parse_overrides(overrides)
    _yield_to_overrides(data, {key for key, _ in parsed})
    for key, value in parsed:
        _set_path(data, key, value)
    if plugins is not None:
        data["plugins"] = list(plugins)
    if "ci_disable_kl_checker" in data:  # the global switch's other name
        _set_path(data, "ci_kl_checker.disable", data.pop("ci_disable_kl_checker"))

    enabled = data.get("plugins") or []
    if isinstance(enabled, str):
        enabled = [p.strip() for p in enabled.split(",") if p.strip()]
    host = load_plugins(enabled)
    section_types = host.config_sections()
    fields = {f.name for f in dataclasses.fields(RunConfig)} - {"plugin_sections"}
    installed = installed_plugins()
    core: dict[str, Any] = {}
    sections: dict[str, Any] = {}
    for key, value in data.items():
        if key in fields:
            core[key] = value
        elif key in section_types:
            sections[key] = from_dict(section_types[key], value or {}, prefix=key)
        elif key in installed:
            logger.info("section %r ignored: plugin %r is not enabled", key, key)
        else:
            known = ", ".join(sorted(fields | set(section_types)))
            raise ValueError(f"{key}: unknown top-level key; known: {known}")
    for name, cls in section_types.items():
        sections.setdefault(name, from_dict(cls, {}, prefix=name))
    core["plugins"] = enabled
    run_config = from_dict(RunConfig, core)
    resolve_tis(run_config.algorithm, run_config.rollout)
    check_engine_log_probs(run_config)
    check_partial_rollouts(run_config)
    check_true_on_policy(run_config)
    check_quantization(run_config)
    weight_transport(run_config)
    from ember.layout import plan_layout

    plan_layout(run_config)  # the layout rules that span sections, before any process starts
    run_config.plugin_sections = sections
    host.configure(run_config, sections)
    return run_config, host


SGLANG_GREEDY_TEMPERATURE = 1e-6
"""sglang 0.5.23 `sampling_params.py`: a temperature below this becomes greedy decoding (top_k
1, temperature 1)."""


def check_engine_log_probs(config: RunConfig) -> None:
    """Refuse the sampling settings under which SGLang's log-probs lose their tempered meaning.

    Rollout log-probs mean log softmax(logits / rollout.temperature) of the sampled token over
    the whole vocabulary, on every engine and whatever top-k/top-p filter sampled it. sglang
    0.5.23 (`srt/layers/sampler.py`) answers a batch whose requests all have top_k <= 1 with the
    log softmax of the untempered logits, and makes a temperature below 1e-6 greedy with
    temperature 1, so at a temperature other than 1 its numbers would not be the ones the
    trainer's `PolicyHead` divides by the temperature. The embedded engine reports the tempered
    log-probs in both cases.

    Raises:
        ValueError: One line naming the keys and values.
    """
    if config.engine.kind != "sglang":
        return
    rollout = config.rollout
    if rollout.temperature < SGLANG_GREEDY_TEMPERATURE:
        raise ValueError(
            f"rollout.temperature={rollout.temperature!r} with engine.kind=sglang: SGLang "
            f"decodes greedily below {SGLANG_GREEDY_TEMPERATURE:g} and returns untempered "
            f"log-probs; expected rollout.temperature >= {SGLANG_GREEDY_TEMPERATURE:g}"
        )
    if rollout.top_k == 1 and rollout.temperature != 1.0:
        raise ValueError(
            f"rollout.top_k=1 with engine.kind=sglang and rollout.temperature="
            f"{rollout.temperature:g}: SGLang returns greedy requests' log-probs before the "
            "temperature, the trainer divides by it; set rollout.top_k=-1 or >= 2, or "
            "rollout.temperature=1"
        )


PARTIAL_ROLLOUT_ENGINES = ("hf", "sglang")
"""Engine kinds that take new weights mid-generation (`rollout.partial_rollouts`): the
embedded engine between decode steps; SGLang servers paused in place around each update
(sglang 0.5.23 `/pause_generation` mode "in_place", then `/continue_generation`; the servers
record the spans by version and run without the radix cache, see `ember_rollout.sglang_weights.
WeightUpdates`)."""


def check_partial_rollouts(config: RunConfig) -> None:
    """Refuse `rollout.partial_rollouts` with an engine that cannot take weights while it
    generates.

    Raises:
        ValueError: One line naming the settings.
    """
    kind = config.engine.kind
    if config.rollout.partial_rollouts and kind not in PARTIAL_ROLLOUT_ENGINES:
        raise ValueError(
            f"rollout.partial_rollouts=true with engine.kind={kind}: only the "
            f"{' and '.join(PARTIAL_ROLLOUT_ENGINES)} engines take new weights mid-generation; "
            "set rollout.partial_rollouts=false (rollouts ahead then finish before each push) "
            f"or engine.kind={PARTIAL_ROLLOUT_ENGINES[0]}"
        )


def check_true_on_policy(config: RunConfig) -> None:
    """Refuse `rollout.true_on_policy` where engine and trainer cannot run the same kernels.

    Raises:
        ValueError: One line naming the keys and values.
    """
    if not config.rollout.true_on_policy:
        return
    engine, train = config.engine, config.train
    why = None
    if engine.kind != "hf":
        # sglang 0.5.23: --enable-deterministic-inference makes a server batch-invariant with
        # its own Triton/DeepGEMM kernels, CUDA only (srt/batch_invariant_ops/
        # batch_invariant_ops.py 252-340, 1010-1036), which sum in other orders than the
        # trainer's; megatron-core 0.16.1's batch-invariant mode imports Transformer Engine
        # unconditionally (transformer/custom_layers/batch_invariant_kernels.py 524-533) and
        # leaves the local attention's baddbmm and RMSNorm alone (952-965).
        why = (
            f"engine.kind={engine.kind}: only the embedded engine (hf) runs the trainer's "
            "batch-invariant kernels; SGLang's deterministic inference is batch-invariant with "
            "kernels of its own, not the trainer's (docs/true-on-policy.md, the GPU path)"
        )
    elif engine.hf.dtype != train.dtype:
        why = (
            f"engine.hf.dtype={engine.hf.dtype} with train.dtype={train.dtype}: the two sides "
            "compute bit for bit alike only in one dtype; set both to float32 or bfloat16"
        )
    else:
        parallel = train.parallel
        split = {
            name: getattr(parallel, name)
            for name in (
                "tensor_parallel",
                "pipeline_parallel",
                "expert_parallel",
                "expert_tensor_parallel",
                "context_parallel",
            )
            if getattr(parallel, name) not in (1, None)  # expert_tensor_parallel None: the TP
        }
        if split:
            named = ", ".join(f"train.parallel.{k}={v}" for k, v in split.items())
            why = f"{named}: the mode runs the model whole on each rank (layout 1); set it to 1"
    if why is not None:
        raise ValueError(f"rollout.true_on_policy=true with {why}")


def served_dtype(config: RunConfig) -> Any:
    """The dtype the engines compute in: the embedded engine's `engine.hf.dtype`, SGLang's
    `engine.sglang.dtype` (auto: the trainer's, whose export the servers start from)."""
    import torch

    engine = config.engine
    if engine.kind == "hf":
        name = engine.hf.dtype
    else:
        name = engine.sglang.dtype if engine.sglang.dtype != "auto" else config.train.dtype
    return getattr(torch, name)


def check_quantization(config: RunConfig) -> None:
    """Refuse `engine.quantization` and `train.qat` settings that cannot run, before anything
    starts: QAT without a scheme or with a tensor-parallel split of the weights, a quantized
    engine under `rollout.true_on_policy` without QAT (the two sides would serve different
    weights), and a group size that does not divide one of the model's quantized weights (read
    from its shape, on the meta device).

    Raises:
        ValueError: One line naming the keys and, for a shape, the weight.
    """
    engine, train = config.engine, config.train
    spec = engine.quant_spec()
    if spec is None:
        if train.qat:
            raise ValueError(
                "train.qat=true with engine.quantization=null: QAT trains against the scheme the "
                "engine serves; set engine.quantization (fp8_block or int4_w4a16)"
            )
        return
    if config.rollout.true_on_policy and not train.qat:
        raise ValueError(
            f"engine.quantization={spec.scheme} with rollout.true_on_policy=true and "
            "train.qat=false: the trainer would compute with weights the engine does not serve; "
            "set train.qat=true (both sides then run the mode's kernels on the served weights)"
        )
    if train.qat and config.ray.gpus_per_rank > 0:
        from ember_megatron_backend.model import _have_te

        if _have_te():  # the ranks would build Transformer Engine's layers (`uses_te_spec`)
            raise ValueError(
                "train.qat=true with ray.gpus_per_rank > 0 where Transformer Engine is "
                "installed: the trainer's GPU layers are then Transformer Engine's, whose "
                "kernels take no fake-quantized weight (ember_megatron_backend.qat needs "
                "megatron-core's local layers); uninstall transformer-engine or set train.qat=false"
            )
    if train.qat:
        parallel = train.parallel
        for key in ("tensor_parallel", "expert_tensor_parallel"):
            value = getattr(parallel, key)
            if value not in (1, None):
                raise ValueError(
                    f"train.qat=true with train.parallel.{key}={value}: fake quantization needs "
                    f"each weight whole on its rank; set train.parallel.{key}=1"
                )
    from ember_core import quant
    from ember_megatron_backend.hf_layout import hf_shapes

    shapes = hf_shapes(train.model_config())
    targets = {n: s for n, s in shapes.items() if quant.is_target(n, spec.targets)}
    if not targets:
        raise ValueError(
            f"engine.quantization_targets={spec.targets}: the model has no "
            f"{'routed experts' if spec.targets == 'experts' else 'linear projections'} to "
            "quantize; set engine.quantization_targets=linear"
        )
    for name, shape in targets.items():
        try:
            quant.check_shape(name, shape, spec)
        except ValueError as exc:
            raise ValueError(f"engine.quantization={spec.scheme}: {exc}") from None
    if engine.kind == "sglang":
        check_sglang_quantization(config, spec, shapes)


def sglang_device(config: RunConfig) -> tuple[str, str]:
    """Where the SGLang servers compute (cuda or cpu) and why: `engine.sglang.device`, auto
    resolved as launched servers resolve it (`sglang_servers_on_gpu`, and cpu on a machine
    without CUDA when Ray starts here), attached ones taken to be on GPUs."""
    sglang = config.engine.sglang
    if sglang.device != "auto":
        return sglang.device, f"engine.sglang.device={sglang.device}"
    if sglang.urls:
        return "cuda", "attached servers, engine.sglang.device=auto"
    if not sglang_servers_on_gpu(config):
        return "cpu", "engine.sglang.device=auto with ray.gpus_per_engine=0"
    import torch

    if config.ray.address is None and not torch.cuda.is_available():
        return "cpu", "engine.sglang.device=auto on a machine without CUDA"
    return "cuda", "engine.sglang.device=auto with GPUs"


def check_sglang_quantization(config: RunConfig, spec: Any, shapes: Mapping[str, Any]) -> None:
    """Refuse an `engine.quantization` SGLang servers cannot serve and update, before anything
    starts: servers on CPU (neither scheme has a CPU kernel there), INT4 on dense layers
    (sglang cannot update them in place), a served dtype other than the export's, and any
    loader rule the export of this model would break on `engine.sglang.tp_size` ranks
    (`ember_rollout.sglang_loader_rules`, run on the export's layout).

    Raises:
        ValueError: One line naming the keys and the sglang rule (file:line).
    """
    from ember_megatron_backend.hf_layout import hf_config
    from ember_rollout import sglang_quant
    from ember_rollout.sglang_loader_rules import check_sglang_quantized

    sglang = config.engine.sglang
    sglang_quant.check_device(spec, *sglang_device(config))
    if spec.scheme == "int4_w4a16" and spec.targets == "linear":
        raise ValueError(
            "engine.quantization=int4_w4a16 with engine.quantization_targets=linear on SGLang: "
            "sglang 0.5.23 repacks dense compressed-tensors INT4 layers into Marlin parameters "
            "that lose their weight loaders and have no restore, so no weight update can reach "
            "them (srt/layers/quantization/compressed_tensors/schemes/compressed_tensors_wNa16."
            "py:234-249); set engine.quantization_targets=experts"
        )
    import torch

    dtype = served_dtype(config)
    if sglang.dtype == "auto" and dtype == torch.float32:
        raise ValueError(
            f"engine.quantization={spec.scheme} with engine.sglang.dtype=auto and train.dtype="
            "float32: the quantized export is written in float32, which SGLang serves in "
            "float16 (sglang 0.5.23 srt/configs/model_config.py:2300-2319), casting what Ember "
            "pushes; set engine.sglang.dtype=bfloat16"
        )
    hf = hf_config(config.train.model_config(), dtype=dtype).to_dict()
    hf["quantization_config"] = sglang_quant.quantization_config(spec, shapes)
    try:
        layout = sglang_quant.export_layout(shapes, spec, dtype)
        check_sglang_quantized(layout, hf, tp_size=sglang.tp_size, dtype=dtype)
    except ValueError as exc:
        raise ValueError(
            f"engine.quantization={spec.scheme} on SGLang (engine.sglang.tp_size="
            f"{sglang.tp_size}): {exc}"
        ) from None


def check_debug_halves(config: RunConfig, plugins: EmberPlugins | None = None) -> None:
    """`run.rollout_only` needs the weights its engines serve (`train.hf_load`);
    `run.train_from_rollouts` needs a dump of every rollout the run trains, each read whole
    here (`ember.dumps.read_dump`), with the provenance of this run (`dump_provenance`), and,
    where `plugins` check the run, rollouts their checks can pass (`check_dump_audit`).

    An audit (`EmberPlugins.audit_rollout`; the CI checker's) compares the engine's log-probs
    with the trainer's on the same weights, and the CI checker holds every rollout's weight
    versions within `rollout.max_staleness` of the trainer's. A dump's rollout i came from the
    weights trained on rollout i - 1 (or, overlapped, up to the bound before) when a training
    run with this config dumped it, which this run's trainer holds again; a rollout-only run's
    came from its initial weights, so under the checker only rollout 0 can be audited and
    rollout i trains only while i <= rollout.max_staleness.

    Raises:
        ValueError: One line naming the key, the file (and line or field) and what is wrong.
    """
    run = config.run
    if run.rollout_only and config.train.hf_load is None:
        raise ValueError(
            "run.rollout_only=true: the engines need weights to serve and no trainer makes "
            "them; set train.hf_load to an HF checkpoint (for example an earlier run's hf_init)"
        )
    if run.train_from_rollouts is None:
        return
    from ember.dumps import read_dump

    source = Path(run.train_from_rollouts)
    if not source.is_dir():
        raise ValueError(f"run.train_from_rollouts={str(source)!r}: no such directory")
    provenance = dump_provenance(config)
    checked = checked_run(config, plugins)
    for rollout_id in range(run.num_rollouts):
        path = dump_path(source, rollout_id)
        if not path.is_file():
            raise ValueError(
                f"run.train_from_rollouts={str(source)!r}: no {path.name} for rollout "
                f"{rollout_id} of run.num_rollouts={run.num_rollouts} (dumped by a run with "
                "run.dump_rollouts=true or run.rollout_only=true)"
            )
        try:
            samples = read_dump(path, provenance)
        except ValueError as exc:
            raise ValueError(f"run.train_from_rollouts: {exc}") from None
        if checked and plugins is not None:
            check_dump_audit(config, path, rollout_id, samples, plugins.audit_rollout(rollout_id))


def checked_run(config: RunConfig, plugins: EmberPlugins | None) -> bool:
    """Whether `plugins` audit any rollout of this run: then a plugin checks every rollout
    (the CI checker does, its recorded versions against `rollout.max_staleness` among them)."""
    return plugins is not None and any(map(plugins.audit_rollout, range(config.run.num_rollouts)))


def check_dump_audit(
    config: RunConfig, path: Path, rollout_id: int, samples: Sequence[Any], audited: bool
) -> None:
    """In a run whose plugins check it (`checked_run`), refuse dumped rollout `rollout_id`
    where the checks cannot pass: audited (`audited`) with samples from weights older than the
    trainer's then (version rollout_id - 1), or staler than `rollout.max_staleness` allows.

    Raises:
        ValueError: One line naming the dump, the rollout, the versions and what to do.
    """
    trainer, bound = rollout_id - 1, config.rollout.max_staleness
    versions = [v for v in map(_integer_version, samples) if v is not None]
    limit = 0 if audited else bound
    older = [v for v in versions if trainer - v > limit]
    if not older:
        return
    if audited:
        why = (
            f"rollout {rollout_id} is audited (a plugin asks for an audit iteration there, as "
            "the CI checker does every ci_kl_checker.audit_interval rollouts), and an audit "
            "compares the engine's log-probs with the trainer's on the same weights"
        )
    else:
        why = (
            f"that is more than rollout.max_staleness={bound} behind, and a plugin checks "
            "every rollout's versions against that bound (the CI checker, which audits this run)"
        )
    raise ValueError(
        f"run.train_from_rollouts: {path}: {len(older)} of the {len(samples)} samples of "
        f"rollout {rollout_id} come from weight version {min(older)}, older than the trainer's "
        f"{trainer}; {why}, which a dump from other weights cannot satisfy (a rollout-only "
        f"run's come from the initial ones); train fewer of its rollouts (run.num_rollouts="
        f"{rollout_id}), audit fewer (ci_kl_checker.audit_interval), or train on it without "
        "the checker"
    )


def _integer_version(sample: Any) -> int | None:
    """A sample's weight version as an integer; None where it is not one (the worker counts
    such a sample as current)."""
    try:
        return int(sample.weight_version)
    except (TypeError, ValueError):
        return None


def dump_path(directory: Path, rollout_id: int) -> Path:
    """The file of rollout `rollout_id` in a directory of dumped rollouts."""
    return directory / f"{rollout_id:06d}.jsonl"


def dump_provenance(config: RunConfig) -> dict[str, Any]:
    """The provenance a dumped rollout records of the run that generated it, which a run that
    trains on it (`run.train_from_rollouts`) must share field by field: what the engine's
    log-probs and the groups depend on (`rollout.temperature`, `top_p`, `top_k`,
    `n_samples_per_prompt`), the model the engines served, named as the config names it (the
    preset `train.model` with its `train.model_overrides`, `train.seed` where it draws the
    weights, or the `train.hf_load` directory), and the tokenizer (`run_tokenizer_path`, or
    `toy`). Directories count by their absolute path, not their contents."""
    train, rollout = config.train, config.rollout

    def resolved(path: str | None) -> str | None:
        return None if path is None else str(Path(path).resolve())

    return {
        "rollout.temperature": rollout.temperature,
        "rollout.top_p": rollout.top_p,
        "rollout.top_k": rollout.top_k,
        "rollout.n_samples_per_prompt": rollout.n_samples_per_prompt,
        "train.model": train.model,
        "train.model_overrides": dict(train.model_overrides),
        "train.hf_load": resolved(train.hf_load),
        "train.seed": train.seed if train.hf_load is None else None,
        "tokenizer": resolved(run_tokenizer_path(config)) or "toy",
    }


def weight_transport(config: RunConfig) -> str:
    """The transport (`WEIGHT_TRANSPORTS`) that carries weights to this run's engines:
    `weights.transport`, with auto resolved.

    Raises:
        ValueError: A transport the engines or the placement cannot use; names
            weights.transport, why, and what works instead.
    """
    from ember.layout import in_process
    from ember_rollout.engine import Engine, engine_registry

    kind, ray = config.engine.kind, config.ray
    on_gpus = ray.colocate and ray.gpus_per_rank > 0 and ray.gpus_per_engine > 0
    transport = config.weights.transport
    local, why = in_process(config)
    if transport == "direct" and not local:
        raise ValueError(
            f"weights.transport=direct copies tensors within one process, and this run's roles "
            f"are Ray actors ({why}); use broadcast (or auto)"
        )
    if transport == "auto" and local:
        return "direct"
    if transport == "auto":
        transport = "ipc" if kind == "sglang" and on_gpus else "broadcast"
    cls = engine_registry().get(kind)
    broadcasts = cls.update_weights_from_distributed is not Engine.update_weights_from_distributed
    if transport == "broadcast" and not broadcasts:
        if config.weights.transport == "auto":
            return "disk"
        raise ValueError(
            f"weights.transport=broadcast: engine.kind={kind!r} cannot join a weight group; "
            "use disk"
        )
    if transport == "broadcast" and kind == "sglang" and on_gpus:
        raise ValueError(
            "weights.transport=broadcast: with ray.colocate true on GPUs, training rank i and "
            "SGLang engine i share GPU i, and NCCL cannot hold two ranks of one group on one "
            "GPU; use ipc (or auto), or ray.colocate: false"
        )
    if transport == "ipc":
        if kind != "sglang":
            raise ValueError(
                f"weights.transport=ipc: CUDA IPC handles reach SGLang servers only; "
                f"engine.kind={kind!r} takes broadcast or disk"
            )
        if not on_gpus:
            raise ValueError(
                "weights.transport=ipc: the engines must sit on the training ranks' GPUs "
                f"(ray.colocate: true with gpus_per_rank > 0 and gpus_per_engine > 0; got "
                f"colocate={ray.colocate}, gpus_per_rank={ray.gpus_per_rank:g}, "
                f"gpus_per_engine={ray.gpus_per_engine:g}); use broadcast"
            )
        if ray.num_engines > ray.data_parallel:
            raise ValueError(
                f"weights.transport=ipc: training rank i feeds engine i, and ray.num_engines="
                f"{ray.num_engines} > ray.data_parallel={ray.data_parallel}; use broadcast"
            )
    return transport


def sglang_servers_on_gpu(config: RunConfig) -> bool:
    """Whether the SGLang engines' servers compute on GPUs: `engine.sglang.device`, with auto
    resolved as a launched server resolves it (cuda when its engine actor sees a GPU, which it
    does only when Ray granted one: `ray.gpus_per_engine` > 0), and attached servers (`urls`)
    taken to be on GPUs unless the device says cpu."""
    sglang = config.engine.sglang
    if sglang.device != "auto":
        return sglang.device == "cuda"
    return bool(sglang.urls) or config.ray.gpus_per_engine > 0


def weight_group_backend(config: RunConfig, *, trainer_on_gpu: bool) -> str:
    """The torch.distributed backend of the weight group the sending rank forms with the
    engines (`weights.transport: broadcast`): nccl only when both ends are on GPUs, else gloo.

    NCCL needs a GPU in every member: a CPU SGLang server's `/init_weights_update_group` with
    nccl fails in torch's ProcessGroupNCCL constructor ("ProcessGroupNCCL is only supported
    with GPUs, no GPUs found!", torch 2.14.1 torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp),
    which sglang 0.5.23 reports as a failed init (model_runner_components/weight_updater.py
    131-144); gloo runs on both devices (measured against the real server on CPU). The
    embedded engine always receives over gloo.
    """
    if config.engine.kind == "sglang" and trainer_on_gpu and sglang_servers_on_gpu(config):
        return "nccl"
    return "gloo"


def check_inputs(config: RunConfig, plugins: EmberPlugins | None = None) -> None:
    """Check the inputs a run reads before any process starts, so bad input fails in seconds.

    Checks that SGLang is installed where the run launches SGLang servers with this
    interpreter, reads the whole prompt file as the rollout actors will (every line parses and
    has the configured keys), resolves the reward function, checks that the tokenizer and
    checkpoint directories exist (`hf_load` ones holding a transformers checkpoint), and that
    `train.parallel.tensor_parallel` divides the model's head counts (`hf_load`'s shape too),
    that SGLang can serve a model with tied embeddings (`check_sglang_ties`), and that servers
    launched from this environment return tempered log-probs (`check_server_env`), and reads
    every dumped rollout a run trains on (`check_debug_halves`, which asks `plugins` which
    rollouts they audit). The config itself and the plugin sections are already validated by
    `load_config`.

    Raises:
        ValueError: One line naming the key or the file (and line) and what was expected.
    """
    from ember_rollout.data import load_eval_sets, load_prompts
    from ember_rollout.rewards import resolve_reward

    sglang = config.engine.sglang
    if config.engine.kind == "sglang" and not sglang.urls and sglang.python is None:
        from ember_rollout import sglang_cpu

        if not sglang_cpu.sglang_installed():
            raise ValueError(
                "engine.kind=sglang launches SGLang servers, but sglang is not installed in "
                f"this environment: {sglang_cpu.EXTRA_HINT}"
            )
    if config.engine.kind == "sglang":
        config.train.check_sglang_ties()
    if config.engine.kind == "sglang" and not sglang.urls:
        from ember_rollout.sglang_launch import check_server_env

        check_server_env(os.environ)  # the launched servers inherit this environment
    check_debug_halves(config, plugins)
    records = load_prompts(config.data)
    if config.run.eval_interval:
        load_eval_sets(config.run.eval_sets, config.data, prompts=config.run.eval_prompts)
    resolve_reward(config.reward.reward_fn)
    directories = {
        "data.tokenizer_path": config.data.tokenizer_path,
        "train.ref_load": config.train.ref_load,
        "train.hf_load": config.train.hf_load,
        "train.critic.hf_load": config.train.critic.hf_load,
    }
    for key, value in directories.items():
        if value is None:
            continue
        if not Path(value).is_dir():
            raise ValueError(f"{key}={value!r}: no such directory")
        if key.endswith("hf_load") and not is_hf_checkpoint(value):
            raise ValueError(
                f"{key}={value!r}: not a transformers checkpoint (expected config.json and "
                "model.safetensors or its index)"
            )
    check_quantized_sources(config)
    # A tensor-parallel size the heads do not divide would fail in every rank, after Ray started.
    config.train.check_parallel()
    check_prompt_lengths(config, records)


def check_quantized_sources(config: RunConfig) -> None:
    """Refuse quantized weights where they cannot serve, before anything starts: a quantized
    export (config.json `quantization_config`, as Ember writes for SGLang) as a checkpoint the
    trainer or the embedded engine loads, a rollout-only run's SGLang checkpoint of another
    scheme than `engine.quantization`, and attached SGLang servers that serve another
    quantization (asked over HTTP: `ember_rollout.sglang_quant.check_attached`).

    Raises:
        ValueError: One line naming the key or the server, and both quantizations.
    """
    from ember_rollout import sglang_quant

    engine, train = config.engine, config.train
    spec = engine.quant_spec()
    served_as_is = config.run.rollout_only and engine.kind == "sglang"
    for key, path in (
        ("train.hf_load", train.hf_load),
        ("train.critic.hf_load", train.critic.hf_load),
    ):
        qc = None if path is None else sglang_quant.checkpoint_quantization(path)
        if qc is None or (key == "train.hf_load" and served_as_is):
            continue
        reader = "the embedded engine" if config.run.rollout_only else "the trainer"
        raise ValueError(
            f"{key}={path!r}: a quantized checkpoint (quantization_config quant_method="
            f"{qc.get('quant_method')!r}, as Ember exports for SGLang), which {reader} cannot "
            "load; start from a full-precision checkpoint (a run's checkpoint through `ember "
            "convert`)"
        )
    if served_as_is and train.hf_load is not None:
        qc = sglang_quant.checkpoint_quantization(train.hf_load)
        ours = "null" if spec is None else spec.scheme
        theirs = None
        if qc is not None:
            try:
                theirs = sglang_quant.check_config(qc)
            except ValueError as exc:
                raise ValueError(f"train.hf_load={train.hf_load!r}: {exc}") from None
        if theirs != spec:
            raise ValueError(
                f"run.rollout_only=true serves train.hf_load={train.hf_load!r} as it is "
                f"({sglang_quant.describe(theirs)}), and engine.quantization={ours} asks for "
                f"{sglang_quant.describe(spec)}; set engine.quantization to what it holds, or "
                "point train.hf_load at a run's export of that scheme"
            )
    if engine.kind == "sglang" and engine.sglang.urls:
        sglang_quant.check_attached(engine.sglang.urls, spec)


def run_tokenizer_path(config: RunConfig) -> str | None:
    """The tokenizer a run uses: `data.tokenizer_path`, else `train.hf_load`'s own when that
    directory holds one, else None (the toy tokenizer). Training rank 0 saves it next to the
    initial export, which is where the engines and the rollout manager read it."""
    if config.data.tokenizer_path is not None:
        return config.data.tokenizer_path
    model = config.train.hf_load
    if model is not None and any(
        (Path(model) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")
    ):
        return model
    return None


def check_prompt_lengths(config: RunConfig, records: Sequence[Any] | None = None) -> None:
    """Refuse, before any process starts, a prompt longer than the model's context allows.

    Applies where the run starts from a transformers checkpoint (`train.hf_load`) whose
    config.json gives the context (`max_position_embeddings`) and whose tokenizer (or
    `data.tokenizer_path`) encodes the prompts, and `data.overlong_prompt` is "error": every
    prompt of `data.prompt_data` is encoded as the rollout will encode it (chat template
    included) and compared with `data.max_prompt_len`, or the context minus
    `rollout.max_response_len`. Otherwise the engine refuses at the first rollout. `records`:
    the prompts already read (`check_inputs` reads the file once); None reads them.

    Raises:
        ValueError: One line naming the prompt (file:line), its length and the limit.
    """
    import json

    data, model = config.data, config.train.hf_load
    if model is None or data.prompt_data is None or data.overlong_prompt != "error":
        return
    context = json.loads((Path(model) / "config.json").read_text()).get("max_position_embeddings")
    limit, why = data.max_prompt_len, "data.max_prompt_len"
    if limit is None:
        if not isinstance(context, int):
            return
        limit = context - config.rollout.max_response_len
        why = (
            f"the model's context {context} ({model}/config.json max_position_embeddings) minus "
            f"rollout.max_response_len={config.rollout.max_response_len}"
        )
        if limit < 1:
            raise ValueError(
                f"rollout.max_response_len={config.rollout.max_response_len} leaves no room for "
                f"a prompt in the model's context of {context} tokens"
            )
    from ember_rollout.data import PromptEncoder, load_prompts
    from ember_rollout.tokenizer import load_tokenizer

    tokenizer_dir = run_tokenizer_path(config)
    if tokenizer_dir is None:
        return  # the toy tokenizer: no real prompt file is written in its words
    encoder = PromptEncoder(
        load_tokenizer(tokenizer_dir),
        apply_chat_template=data.apply_chat_template,
    )
    for record in load_prompts(data) if records is None else records:
        ids = encoder.encode(record)
        if ids is not None and len(ids) > limit:
            raise ValueError(
                f"{record.source}: the prompt has {len(ids)} tokens, more than {limit} ({why}); "
                "shorten it, or set data.overlong_prompt to truncate or drop"
            )


def describe_loop(config: RunConfig) -> str:
    """One line saying which loop a run config runs and how it corrects for off-policy samples:
    the named `algorithm.off_policy_correction`, or else where the old log-probs come from and
    whether TIS is on.

    `ember train` without a config runs examples/default.yaml (overlapped, the engine's
    log-probs); a config file of one's own starts from the dataclass defaults (rollout, then
    training, the trainer's log-probs) plus what it sets. The CLI prints this line at start so
    the two are never confused.
    """
    algorithm, rollout = config.algorithm, config.rollout
    k = rollout.max_staleness
    if k == 1:
        loop = (
            "overlapped (rollout.max_staleness=1: rollout i+1 generates from weights one "
            "update old)"
        )
    elif k:
        loop = (
            f"{k} rollouts ahead (rollout.max_staleness={k}: rollout i+{k} generates from "
            f"weights {k} updates old)"
        )
    else:
        loop = "rollout, then training (rollout.max_staleness=0)"
    if rollout.partial_rollouts:
        loop += ", partial rollouts"
    name = algorithm.off_policy_correction
    if name is not None:
        band = f"[{algorithm.tis_clip_low:g}, {algorithm.tis_clip:g}]"
        correction = OFF_POLICY_CORRECTIONS.get(name).summary.format(band=band)
        return (
            f"loop: {loop}; off-policy correction: {name} "
            f"(algorithm.off_policy_correction): {correction}"
        )
    if algorithm.use_rollout_log_probs:
        old = "the engine's (algorithm.use_rollout_log_probs=true)"
    else:
        old = "the trainer's scoring forward (algorithm.use_rollout_log_probs=false)"
    tis = "on" if algorithm.use_tis else "off"
    return f"loop: {loop}; old log-probs: {old}; TIS {tis} (algorithm.use_tis)"


def default_run_dir(config: RunConfig) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{config.run.name}-{stamp}"


def write_resolved(config: RunConfig, run_dir: Path) -> Path:
    """Write the resolved config to `run_dir/config.yaml` (atomically) and return its path."""
    path = Path(run_dir) / "config.yaml"
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    tmp.replace(path)
    return path
