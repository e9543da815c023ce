"""The `Engine` interface of inference engines, its request and response types, and registry."""

from __future__ import annotations

import abc
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch

from ember_core.algorithms.registry import Registry
from ember_core.types import SampleStatus

if TYPE_CHECKING:
    from ember_core.plugins import EmberPlugins
    from ember_rollout.config import EngineConfig

FinishReason = Literal["stop", "length", "abort"]
"""SGLang's `meta_info.finish_reason.type` values."""

FINISH_STATUS: dict[str, SampleStatus] = {
    "stop": SampleStatus.COMPLETED,
    "length": SampleStatus.TRUNCATED,
    "abort": SampleStatus.ABORTED,
}
"""How an engine's finish reason maps to the status of a sample."""

ROUTED_EXPERTS_FIELD = "return_routed_experts"
"""Request field asking for routed experts (SGLang's name; the hf engine honours it too)."""

WEIGHT_VERSIONS_KEY = "weight_versions"
"""`meta_info` key of the response's spans by weight version, in sglang 0.5.23's layout
(`srt/utils/weight_versions.py`): [{"version": str, "start": int, "end": int}, ...], contiguous
from response token 0 to the response length, a new span wherever the engine's weights changed
while the request ran. SGLang reports it for every finished request and sets `weight_version` to
the last span's version (the weights in force when the request finished); the hf engine does
the same whenever its weights carry a version."""

MEMORY_TAGS: tuple[str, ...] = ("weights", "kv_cache", "cuda_graph")
"""Kinds of device memory an engine can release for colocated training: the model's weights,
its KV cache and its CUDA graphs (sglang 0.5.23 constants.py `GPU_MEMORY_ALL_TYPES`)."""


def memory_tags(tags: Sequence[str] | None) -> tuple[str, ...]:
    """`tags` checked against `MEMORY_TAGS`, in that order; None or empty means all of them.

    Raises:
        ValueError: A tag is not one of `MEMORY_TAGS`; names it.
    """
    if not tags:
        return MEMORY_TAGS
    if isinstance(tags, str):
        raise ValueError(f"memory tags {tags!r}: expected a list of tags, not one string")
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise ValueError(f"memory tags {unknown}: expected some of {list(MEMORY_TAGS)}")
    return tuple(t for t in MEMORY_TAGS if t in tags)


class EngineError(RuntimeError):
    """An engine failed, or answered with data that cannot be used."""


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """How one request is sampled; the field names follow SGLang's `sampling_params`."""

    max_new_tokens: int
    """Most tokens generated."""
    temperature: float = 1.0
    """Logits are divided by this before filtering and sampling."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches top_p."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 keeps all."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Tokens that end generation (the model's EOS tokens stop it too unless ignore_eos)."""
    ignore_eos: bool = False
    """Do not stop at the model's EOS tokens."""
    seed: int | None = None
    """Seed of this request's sampler (hf engine only); None lets the engine pick one."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r}: expected >= 1")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature={self.temperature!r}: expected a finite number > 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r}: expected 0 < top_p <= 1")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k={self.top_k!r}: expected -1 (off) or >= 1")

    def to_sglang(self) -> dict[str, Any]:
        """The `sampling_params` object of an SGLang /generate request."""
        params: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "ignore_eos": self.ignore_eos,
        }
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        return params


@dataclass(kw_only=True, slots=True)
class GenerateRequest:
    """One prompt to complete."""

    input_ids: list[int]
    """Prompt token ids."""
    sampling: SamplingParams
    """Sampling parameters."""
    fields: dict[str, Any] = field(default_factory=dict)
    """Extra top-level request fields, e.g. from plugins ({"return_routed_experts": True})."""
    name: str = "request"
    """How errors name this request, e.g. "rollout 3 sample 5 (group 1)"."""

    def __post_init__(self) -> None:
        if not self.input_ids:
            raise ValueError(f"{self.name}: input_ids is empty; a prompt needs at least one token")

    @property
    def wants_routed_experts(self) -> bool:
        return bool(self.fields.get(ROUTED_EXPERTS_FIELD, False))


@dataclass(kw_only=True, slots=True)
class GenerateOutput:
    """An engine's answer to one request."""

    output_ids: list[int]
    """Response token ids (a stop token that ended generation included)."""
    output_log_probs: list[float]
    """Log-prob of each response token, log softmax(logits / temperature) over the whole
    vocabulary: before any top-k/top-p filter, so not renormalised over the kept tokens."""
    finish_reason: FinishReason
    """stop (stop token), length (max_new_tokens) or abort."""
    meta_info: dict[str, Any]
    """The engine's raw metadata, in SGLang's `meta_info` layout."""
    text: str | None = None
    """Response text, when the engine detokenizes."""
    routed_experts: torch.Tensor | None = None
    """int32 [len(prompt) + len(output) - 1, num_layers, topk], when requested."""

    @property
    def status(self) -> SampleStatus:
        return FINISH_STATUS[self.finish_reason]

    def weight_spans(self, where: str) -> list[tuple[int, str]] | None:
        """The response's spans by weight version (`Sample.weight_versions`: [(index of a
        span's first response token, version), ...]), from `meta_info["weight_versions"]`
        (`WEIGHT_VERSIONS_KEY`); None when the engine reports none.

        Raises:
            EngineError: Spans that are not {"version": str, "start": int, "end": int}, do not
                run contiguously from 0 to the response length, or whose last version is not
                `meta_info["weight_version"]`; names `where` (the request) and the value.
        """
        raw = self.meta_info.get(WEIGHT_VERSIONS_KEY)
        if raw is None:
            return None
        n = len(self.output_ids)
        spans = _version_spans(raw, n)
        if spans is None:
            raise EngineError(
                f"{where}: meta_info['weight_versions']={raw!r}: expected spans "
                '{"version": str, "start": int, "end": int}, each starting where the one '
                f"before ends, from 0 to the response length {n}"
            )
        last = self.meta_info.get("weight_version")
        if last is not None and str(last) != spans[-1][1]:
            raise EngineError(
                f"{where}: meta_info['weight_version']={last!r} is not the last span's version "
                f"in meta_info['weight_versions']={raw!r}"
            )
        return spans

    def versions(self, where: str) -> tuple[list[tuple[int, str]] | None, str | None]:
        """(`weight_spans`, the oldest version): the first span's version, or
        `meta_info["weight_version"]` from an engine that reports no spans; None without
        either (`Sample.weight_versions` and `Sample.weight_version`).

        Raises:
            EngineError: Malformed spans (`weight_spans`).
        """
        spans = self.weight_spans(where)
        version = spans[0][1] if spans else self.meta_info.get("weight_version")
        return spans, None if version is None else str(version)


def _version_spans(raw: Any, n: int) -> list[tuple[int, str]] | None:
    """[(start, version), ...] of SGLang's span list `raw` over a response of `n` tokens, or
    None when it is malformed (see `GenerateOutput.weight_spans`)."""
    if not isinstance(raw, list | tuple) or not raw:
        return None
    spans: list[tuple[int, str]] = []
    end = 0
    for span in raw:
        if not isinstance(span, dict):
            return None
        version, start, stop = span.get("version"), span.get("start"), span.get("end")
        if not (isinstance(version, str) and is_int(start) and is_int(stop)):
            return None
        if start != end or stop < start or (stop == start and n > 0):
            return None
        spans.append((start, version))
        end = stop
    return spans if end == n else None


def is_int(value: Any) -> bool:
    """An int that is not a bool (JSON answers and plugin values are checked with it)."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What a caller needs to know about the served model."""

    num_layers: int
    """Decoder layers (rows of the routed-experts layer axis)."""
    topk: int
    """Experts per token (0 for a dense model)."""
    num_experts: int
    """Routed experts per MoE layer (0 for a dense model)."""
    moe_layers: tuple[int, ...]
    """Indices of the layers with a router; other layers report zeros."""
    vocab_size: int
    """Output vocabulary size."""
    context_len: int
    """Most tokens (prompt + response) one sequence may hold."""
    eos_token_ids: tuple[int, ...] = ()
    """Tokens that end generation unless a request sets ignore_eos."""


class Engine(abc.ABC):
    """An inference engine that completes batches of prompts for RL rollouts.

    Implementations are async; an embedded engine runs its model off the event loop. Use
    `async with engine:` or call `start()` and `shutdown()`.
    """

    kind: ClassVar[str]
    """The registered name, also the `engine` argument of the rollout hooks."""

    @property
    @abc.abstractmethod
    def model_info(self) -> ModelInfo | None:
        """The served model's shape, or None when the engine cannot tell."""

    async def start(self) -> None:  # noqa: B027  (optional hook; engines may need no setup)
        """Make the engine ready (load, launch or attach, then wait for health)."""

    @abc.abstractmethod
    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateOutput]:
        """Complete every request; outputs are in request order.

        Raises:
            EngineError: The engine failed or returned unusable data; the message names the
                request.
        """

    @abc.abstractmethod
    async def update_weights_from_tensors(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        weight_version: str | None = None,
    ) -> None:
        """Load weights given with their HF checkpoint names; an engine may refuse names it does
        not know, or a set that leaves weights out (the embedded engine does, naming them)."""

    @abc.abstractmethod
    async def update_weights_from_disk(
        self, path: str | Path, *, weight_version: str | None = None
    ) -> None:
        """Load all weights from an HF checkpoint directory (safetensors)."""

    # -- weights broadcast by the trainer (DESIGN section 9) -----------------------------------
    #
    # The protocol of sglang 0.5.23's HTTP API: join a process group whose rank 0 is the sending
    # training rank (`init_weights_update_group`), open a session (`begin_weight_update`), take
    # each flattened bucket the sender broadcasts (`update_weights_from_distributed`, told its
    # names, dtypes and shapes first), close the session (`end_weight_update`). An engine
    # without it refuses, and the run must use `weights.transport: disk`.

    @property
    def weight_group_size(self) -> int:
        """Ranks this engine adds to a weight group (one per GPU its servers run on)."""
        return 1

    def _no_broadcast(self, what: str) -> NotImplementedError:
        return NotImplementedError(
            f"the {self.kind} engine cannot {what}; set weights.transport: disk for it"
        )

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        """Join weight group `group_name` as ranks `rank_offset` .. `rank_offset +
        weight_group_size - 1` of `world_size`, meeting at `master_address:master_port` (the
        sender's node). Blocks until every member has joined.

        Raises:
            ValueError: A backend this engine cannot receive on.
            EngineError: The group exists already, or joining failed.
        """
        raise self._no_broadcast("join a weight group")

    async def destroy_weights_update_group(self, group_name: str) -> None:
        """Leave weight group `group_name`.

        Raises:
            EngineError: No such group.
        """
        raise self._no_broadcast("leave a weight group")

    async def begin_weight_update(self) -> None:
        """Open a weight-update session, inside which `update_weights_from_distributed` runs.

        Raises:
            EngineError: A session is already open.
        """
        raise self._no_broadcast("open a weight-update session")

    async def end_weight_update(self) -> None:
        """Close the session `begin_weight_update` opened.

        Raises:
            EngineError: No session is open (or the engine found the update incomplete).
        """
        raise self._no_broadcast("close a weight-update session")

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> None:
        """Receive one flattened bucket that rank 0 of `group_name` broadcasts, and load it.

        The bucket holds tensor i's bytes after tensor i - 1's, tensor i being of dtype
        `dtypes[i]` (torch's name, "bfloat16") and shape `shapes[i]`, loaded as `names[i]`.
        Returns once the bucket is loaded, so the caller starts the broadcast without waiting.

        Args:
            weight_version: The version the engine serves once this bucket is loaded (the
                sender gives it with the last bucket of an update).
            flush_cache: Drop cached KV computed with the old weights (once, with the last).

        Raises:
            EngineError: No open session, an unknown group, or a bucket that does not fit
                the model; names what.
        """
        raise self._no_broadcast("receive broadcast weights")

    # -- colocated memory hand-off (DESIGN section 9) ------------------------------------------

    async def release_memory(self, tags: Sequence[str] | None = None) -> None:  # noqa: B027
        """Free the device memory of `tags` (None: all of `MEMORY_TAGS`) so colocated training
        can use it. Call it only while the engine is idle; it generates again, and takes weight
        updates, only after `resume_memory` of the same tags. Released weights are not kept:
        resume them, then load weights.

        The base implementation only checks the tags, and the embedded `hf` engine keeps it: its
        KV cache lives only during `generate`, and its weights stay where they are (one copy in
        the engine actor's process, in the engine's dtype). `sglang` servers release for real.

        Raises:
            ValueError: A tag is not one of `MEMORY_TAGS`.
        """
        memory_tags(tags)

    async def resume_memory(self, tags: Sequence[str] | None = None) -> None:  # noqa: B027
        """Take back the device memory `release_memory` freed for `tags` (None: all of them).

        A no-op in the base implementation, which the embedded `hf` engine keeps (see
        `release_memory`).

        Raises:
            ValueError: A tag is not one of `MEMORY_TAGS`.
        """
        memory_tags(tags)

    @abc.abstractmethod
    async def health(self) -> bool:
        """Whether the engine can serve requests now."""

    async def prompt_log_probs(
        self, sequences: Sequence[Sequence[int]]
    ) -> list[list[float]] | None:
        """Per server, per sequence, the log-prob of each token after the first given the ones
        before it, at temperature 1, from a forward of the whole sequence: a function of the
        weights a server serves, for engines whose weights cannot be read (`ember certify`
        compares it across two ways of loading the same weights). None: not supported."""
        return None

    def probe(self, timeout_s: float) -> str | None:
        """Why the engine cannot serve now, or None: a synchronous check that any thread may
        run while another generates (the health probe of `fault_tolerance`). An engine in
        this process is healthy whenever the process answers, so the base class says None."""
        return None

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Release the model or stop launched servers; safe to call twice."""

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()


ENGINES: Registry[type[Engine]] = Registry("rollout engine")
"""Engine classes by kind; each is built as `cls.from_config(config, plugins=...)`."""


def engine_registry() -> Registry[type[Engine]]:
    """`ENGINES` with the built-in engines registered (they register on import)."""
    import ember_rollout.hf_engine  # noqa: F401
    import ember_rollout.sglang_engine  # noqa: F401

    return ENGINES


def build_engine(config: EngineConfig, *, plugins: EmberPlugins | None = None) -> Engine:
    """Build (but do not start) the engine `config.kind` names.

    Args:
        config: The engine section.
        plugins: Enabled plugins; the sglang engine adds their server arguments.
    """
    cls = engine_registry().get(config.kind)
    return cls.from_config(config, plugins=plugins)  # type: ignore[attr-defined]
