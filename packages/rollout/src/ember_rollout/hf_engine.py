"""The embedded `hf` engine: batched, KV-cached generation with a transformers causal LM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from ember_core import exact
from ember_core.certify import Fault, planted
from ember_rollout.config import HFEngineConfig
from ember_rollout.engine import (
    ENGINES,
    ROUTED_EXPERTS_FIELD,
    WEIGHT_VERSIONS_KEY,
    Engine,
    EngineError,
    GenerateOutput,
    GenerateRequest,
    ModelInfo,
    SamplingParams,
)
from ember_rollout.models import (
    DTYPES,
    _resolve,
    build_tiny_model,
    cache_kwarg,
    check_update_names,
    find_routers,
    iter_checkpoint,
    load_hf_weights,
    load_model,
    model_info,
    naming_of,
)
from ember_rollout.packed_linear import pack_linears
from ember_rollout.routing import ExpertCapture, encode_routed_experts
from ember_rollout.token_sampling import filter_log_probs, sample_tokens, tempered_log_probs
from ember_rollout.weight_gate import WeightGate
from ember_rollout.weight_receive import (
    BUCKET_LOAD_FORMAT,
    WEIGHT_GROUP_BACKEND,
    bucket_layout,
    join_weight_group,
    receive_bucket,
)

if TYPE_CHECKING:
    from ember_core.plugins import EmberPlugins
    from ember_core.quant import QuantSpec
    from ember_rollout.config import EngineConfig
    from ember_rollout.layer_trace import LayerTrace

logger = logging.getLogger(__name__)

SUPPORTED_FIELDS = frozenset({ROUTED_EXPERTS_FIELD})
"""Request fields the hf engine acts on; others are ignored with a warning."""


# -- weights broadcast by the trainer ----------------------------------------------------------

SESSION_OPEN = "a weight-update session is already open; call end_weight_update() first"
SESSION_CLOSED = "no weight-update session is open; call begin_weight_update() first"
OUTSIDE_SESSION = (
    "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
)
UNVERSIONED = (
    "serves no weight version until a complete update arrives (a weight-update session that "
    "loads every parameter, or a load from disk)"
)


@dataclass(slots=True)
class _WeightUpdate:
    """An open weight-update session of the hf engine."""

    names: list[str] = field(default_factory=list)
    """Names loaded so far."""
    version: str | None = None
    """The version the last bucket named, served once the session closes complete."""


@dataclass(slots=True)
class _Row:
    """Decoding state of one request."""

    request: GenerateRequest
    generator: torch.Generator
    stop_ids: frozenset[int]
    max_new_tokens: int
    output_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    experts: list[torch.Tensor] = field(default_factory=list)
    """Routed experts, int32 [positions, layers, topk] per forward pass, positions in order."""
    versions: list[tuple[int, str | None]] = field(default_factory=list)
    """(index of the first response token sampled under a weight version, that version)."""
    finish: dict[str, Any] | None = None
    forced: Sequence[int] | None = None
    """Tokens to take instead of sampling (`HFEngine.trace`)."""
    traced: int = -1
    """The row's sequence number in a `LayerTrace`, -1 when not traced."""

    def take(self, token: int, log_prob: float, version: str | None) -> None:
        """Append a token sampled from weight version `version`, and stop if it ends the row."""
        if not self.versions or self.versions[-1][1] != version:
            self.versions.append((len(self.output_ids), version))
        self.output_ids.append(token)
        self.log_probs.append(log_prob)
        if token in self.stop_ids:
            self.finish = {"type": "stop", "matched": token}
        elif len(self.output_ids) >= self.max_new_tokens:
            self.finish = {"type": "length", "length": len(self.output_ids)}

    @property
    def recorded(self) -> int:
        """Positions whose routed experts are recorded."""
        return sum(e.shape[0] for e in self.experts)


class HFEngine(Engine):
    """Generates with a transformers causal LM in this process.

    Requests are decoded together: the prompts are left-padded into one batch (attention mask
    and explicit position ids), prefilled once, then extended one token per step from a KV
    cache. Each row samples from its own seeded generator, so a request's tokens do not depend
    on the batch it ran in. A token is drawn from the top-k/top-p filtered distribution and
    reported with its log-prob under the full one, log softmax(fp32 logits / temperature), as
    SGLang reports it and the trainer computes it (`token_sampling.tempered_log_probs`).

    With `partial_rollouts`, weights may be loaded while `generate` runs (from another thread
    or event loop: the weight path then takes no asyncio lock). Every forward pass of the
    decoder runs inside a `WeightGate` step: `begin_weight_update` closes the gate (waiting for
    the pass in progress), buckets load behind it, and `end_weight_update` opens it again, so no
    pass sees a half-loaded model. The decoder then forwards every unfinished row again, prompt
    and tokens so far, into a new KV cache (the old one holds keys and values of the old
    weights, so SGLang aborts and continues such requests), and samples on from the new
    weights. Each row records the version of every span of its response (`meta_info`
    `weight_versions`, in SGLang's layout: `engine.WEIGHT_VERSIONS_KEY`); each token's
    log-prob is that of the version in force at its step. Routed experts of a position come from
    the pass that forwarded it, which is the pass whose logits drew the next token: positions
    recorded before an update keep the old version's experts, and the new prefill records only
    the position not yet forwarded (the last sampled token), with the new version's experts, as
    the new version predicts from there.
    Without `partial_rollouts`, a weight load waits for the running `generate` to finish.

    Each bucket is copied into the model as it arrives: staging a whole update until its session
    closes would hold a second copy of the model. An update that stops partway (a session that
    closes before every parameter arrived, as when an engine of the push or its sender dies, or
    a copy that fails midway) therefore leaves weights of two versions. The engine then serves
    no version (`weight_version` None) and generates nothing until a complete update arrives (a
    session that loads every parameter, or a disk load), which is what the driver sends next
    when it mends a failed push. With `partial_rollouts` the gate stays closed meanwhile: a
    `generate` in progress waits at its next step and continues on the complete weights, its
    earlier tokens keeping their version. Without, `generate` refuses, naming why. The SGLang
    engine follows the same rule (`sglang_weights.WeightUpdates`).
    """

    kind: ClassVar[str] = "hf"

    def __init__(
        self,
        config: HFEngineConfig | None = None,
        *,
        model: nn.Module | None = None,
        seed: int = 0,
        partial_rollouts: bool = False,
        true_on_policy: bool = False,
        quantization: QuantSpec | None = None,
    ) -> None:
        """Create the engine; the model is loaded by `start()` unless given.

        Args:
            config: Engine settings.
            model: An already built causal LM to serve (its dtype, device and layers are kept:
                `config.pack_linears` applies only to a model the engine loads itself).
            seed: Seeds the per-request generators of requests that carry no seed.
            partial_rollouts: Take weight updates while `generate` runs, between decode steps
                (`rollout.partial_rollouts`; see the class docstring). Set it before the first
                `generate`.
            true_on_policy: Compute with the batch-invariant kernels the trainer also runs
                (`rollout.true_on_policy`, `ember_rollout.true_on_policy`), whose linear
                layers pack their weights themselves (`config.pack_linears` is not read).
                Set it before the model loads.
            quantization: Serve the model quantized under this scheme
                (`engine.quantization`; `ember_rollout.quantized`): its target projections are
                quantized when it is adopted, and weight updates must send them quantized.
        """
        self.config = config or HFEngineConfig()
        self.model = model
        self._seeds = random.Random(seed)
        self.partial_rollouts = partial_rollouts
        self.true_on_policy = true_on_policy
        self.quantization = quantization
        self._lock = asyncio.Lock()
        self._gate = WeightGate()
        self._warned_fields: set[str] = set()
        self._trace: LayerTrace | None = None
        """Set while `trace` decodes: told after each forward which rows it advanced."""
        self.weight_version: str | None = None
        self._info: ModelInfo | None = None
        self._weight_groups: dict[str, Any] = {}
        self._weight_update: _WeightUpdate | None = None
        self._unversioned: str | None = None
        """What left the model holding weights that no version names (see the class
        docstring), or None."""
        if model is not None:
            self._adopt(model)

    @classmethod
    def from_config(cls, config: EngineConfig, *, plugins: EmberPlugins | None = None) -> HFEngine:
        return cls(config.hf, quantization=config.quant_spec())

    # -- lifecycle -----------------------------------------------------------------------------

    def load(self) -> None:
        """Build or load the model now (blocking); `start()` runs this off the event loop."""
        if self.model is not None:
            return
        cfg = self.config
        if cfg.num_threads is not None:
            torch.set_num_threads(cfg.num_threads)
        dtype = DTYPES[cfg.dtype]
        if cfg.model_path is None:
            from ember_rollout.tokenizer import toy_tokenizer

            tokenizer = toy_tokenizer()
            model = build_tiny_model(
                cfg.tiny,
                vocab_size=len(tokenizer),
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
                dtype=dtype,
                attn_implementation=cfg.attn_implementation,
            )
        else:
            model = load_model(
                cfg.model_path, dtype=dtype, attn_implementation=cfg.attn_implementation
            )
        device = cfg.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        model = model.to(device)
        if self.quantization is not None:
            from ember_rollout.quantized import quantize_model

            quantize_model(model, self.quantization)
        if cfg.pack_linears and not self.true_on_policy:
            pack_linears(model, batch_hint=cfg.max_batch_size)
        self._adopt(model)

    def _adopt(self, model: nn.Module) -> None:
        if self.quantization is not None:
            from ember_rollout.quantized import QuantExperts, QuantLinear, quantize_model

            if not any(isinstance(m, QuantLinear | QuantExperts) for m in model.modules()):
                quantize_model(model, self.quantization)
        self._position_cache = False
        """Decode with keys at their positions (`true_on_policy.PositionCache`)."""
        if self.true_on_policy:
            from ember_rollout.true_on_policy import ATTENTION, exact_model, linear_shapes

            exact_model(model)
            if planted(Fault.ORDINARY_KERNEL):  # `ember certify --plant`: its rows must fail
                model.set_attn_implementation("sdpa")
            parameter = next(model.parameters())
            exact.check_linear(linear_shapes(model), parameter.dtype, parameter.device)
            # The mode's attention reads keys at their positions; a planted ordinary kernel
            # reads transformers' left-padded cache.
            self._position_cache = model.config._attn_implementation == ATTENTION
        self.model = model.eval()
        self._info = model_info(model)
        self._moe_sites = find_routers(model)
        self._cache_kw = cache_kwarg(model)
        self._device = next(model.parameters()).device

    def _capture(self) -> ExpertCapture:
        """Hooks recording the experts every MoE layer dispatches each token to."""
        info = self._info
        assert info is not None
        return ExpertCapture(
            [(site.layer, site.experts) for site in self._moe_sites], info.num_layers, info.topk
        )

    async def start(self) -> None:
        if self.model is None:
            await asyncio.to_thread(self.load)

    @property
    def model_info(self) -> ModelInfo | None:
        return self._info

    async def health(self) -> bool:
        return self.model is not None

    async def shutdown(self) -> None:
        async with self._lock:
            self.model = None
            self._info = None

    # -- weights -------------------------------------------------------------------------------

    async def update_weights_from_tensors(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        weight_version: str | None = None,
        partial: bool = False,
    ) -> None:
        """Load weights given with their HF checkpoint names (see `load_hf_weights`).

        The names and shapes are checked before anything is copied: a name the model does not
        have, or a shape that does not fit, is an error, and so, unless `partial`, is a
        parameter of the model that the update leaves out (a name mismatch between trainer and
        engine would otherwise keep stale weights).

        Inside a weight-update session the tensors count towards the session, like broadcast
        buckets (`weight_version`, if given, is served once it closes complete); outside one the
        update is a session of its own, served at once. Outside one, a complete update (not
        `partial`) also ends the state of weights that no version names (see the class
        docstring); a `partial` one cannot, and leaves it as it is.

        Raises:
            ValueError: Naming the unknown or the missing names (the first few, and how many),
                or a shape that does not fit.
        """
        await self.start()
        named = list(named_tensors)
        update = self._weight_update
        async with self._loading():
            self._check(named, partial=partial)
            await asyncio.to_thread(self._load, named)
            if update is None:
                if not partial:
                    self._unversioned = None
                if self._unversioned is None:
                    self.weight_version = weight_version
        if update is not None:
            update.names.extend(name for name, _ in named)
            if weight_version is not None:
                update.version = weight_version

    @contextlib.asynccontextmanager
    async def _loading(self) -> AsyncIterator[None]:
        """Hold back generation while weights are copied in: whole `generate` calls (the
        asyncio lock), or with partial rollouts the decoder's next step (the gate, which an
        open session has closed already, and so has a load that stopped partway). The gate
        opens after a load outside a session unless the weights are then ones no version
        names."""
        if not self.partial_rollouts:
            async with self._lock:
                yield
        elif self._weight_update is not None:
            assert self._gate.closed, "begin_weight_update closes the gate"
            yield
        else:
            if self._unversioned is None:
                await asyncio.to_thread(self._gate.close)
            assert self._gate.closed, "weights no version names keep the gate closed"
            try:
                yield
            finally:
                if self._unversioned is None:
                    self._gate.open()

    def _check(self, named: list[tuple[str, torch.Tensor]], *, partial: bool) -> None:
        """Check every name and shape of `named` against the model before anything is copied.

        Raises:
            ValueError: Naming the unknown or missing names, or the shape that does not fit.
        """
        spec = self.quantization
        if spec is not None:
            from ember_core.quant import is_target

            for name, tensor in named:
                if (
                    is_target(name, spec.targets)
                    and tensor.dtype.is_floating_point
                    and (tensor.dtype != torch.float8_e4m3fn)
                ):
                    raise ValueError(
                        f"weight {name!r} arrives unquantized ({tensor.dtype}): the engine serves "
                        f"engine.quantization={spec.scheme}, so updates carry the quantized "
                        "tensors (ember_core.quant.quantize_named)"
                    )
        check_update_names(self.model, [name for name, _ in named], partial=partial)
        state, naming = self.model.state_dict(keep_vars=True), naming_of(self.model)
        for name, tensor in named:
            _resolve(state, name, tensor, naming)

    def _load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Copy `named` into the model (checked already); behind the gate with partial
        rollouts, which then learns that the weights changed. A copy that fails midway leaves
        weights that no version names."""
        if self.partial_rollouts:
            self._gate.changed()
        try:
            load_hf_weights(self.model, named)
        except BaseException as exc:
            self._lose_version(f"a weight load failed after copying part of it: {exc}")
            raise

    def _lose_version(self, why: str) -> None:
        """Record that the model holds weights that no version names, and `why`."""
        self._unversioned = why
        self.weight_version = None

    def _refuse_unversioned(self) -> None:
        """Refuse to generate from weights that no version names.

        Raises:
            EngineError: Naming what left them.
        """
        if self._unversioned is not None:
            raise EngineError(
                f"generate: the model holds weights that no version names "
                f"({self._unversioned}); the engine {UNVERSIONED}"
            )

    async def update_weights_from_disk(
        self, path: str | Path, *, weight_version: str | None = None
    ) -> None:
        """Load every weight of the model from an HF checkpoint directory (all must be there)."""
        await self.update_weights_from_tensors(iter_checkpoint(path), weight_version=weight_version)

    # A broadcast update follows sglang 0.5.23's protocol (see `Engine`), over gloo into CPU
    # buffers, with one difference: the version a bucket names is served only once the session
    # closes with every parameter of the model loaded, so an incomplete update is refused at
    # `end_weight_update`; the buckets it copied stay, and the engine serves no version until a
    # complete update (see the class docstring).

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
        if backend != WEIGHT_GROUP_BACKEND:
            raise ValueError(
                f"backend={backend!r}: the hf engine receives weights over "
                f"{WEIGHT_GROUP_BACKEND!r} only (into CPU buffers)"
            )
        if group_name in self._weight_groups:
            raise EngineError(f"weight group {group_name!r} exists already")
        if not 0 < rank_offset < world_size:
            raise EngineError(
                f"rank_offset={rank_offset}: expected 0 < rank_offset < world_size={world_size} "
                "(rank 0 is the sender)"
            )
        self._weight_groups[group_name] = await asyncio.to_thread(
            join_weight_group,
            master_address=master_address,
            master_port=master_port,
            rank=rank_offset,
            world_size=world_size,
            group_name=group_name,
        )

    async def destroy_weights_update_group(self, group_name: str) -> None:
        group = self._weight_groups.pop(group_name, None)
        if group is None:
            raise EngineError(f"no weight group {group_name!r} to destroy")
        group.abort()  # closes its connections now, not when garbage collection gets to it

    async def begin_weight_update(self) -> None:
        """Open a session; with partial rollouts, also close the decoder's gate, waiting for
        the decode step in progress to end (see the class docstring; weights that no version
        names have kept it closed already)."""
        if self._weight_update is not None:
            raise EngineError(SESSION_OPEN)
        if self.partial_rollouts and self._unversioned is None:
            await asyncio.to_thread(self._gate.close)
        self._weight_update = _WeightUpdate()

    async def end_weight_update(self) -> None:
        """Close the session; if it loaded anything, every parameter of the model must have
        been among it, and then the engine serves the version the last bucket named (or, if
        none named one, the version it served).

        A session that loaded some parameters but not all is refused, and the buckets it
        copied stay: the engine serves no version (`weight_version` None) until a complete
        update arrives, and generates nothing meanwhile (see the class docstring). A session
        that loaded nothing changes nothing.

        With partial rollouts the decoder's gate opens again unless the weights are then ones
        no version names; a decoder whose weights changed behind it continues from the new
        ones.

        Raises:
            EngineError: No session is open, or the update left parameters out (named).
        """
        update, self._weight_update = self._weight_update, None
        if update is None:
            raise EngineError(SESSION_CLOSED)
        try:
            if not update.names:
                return
            try:
                check_update_names(self.model, update.names)
            except ValueError as exc:
                self._lose_version("a weight-update session closed without every parameter")
                raise EngineError(
                    f"{exc}; the tensors it loaded stay, so the engine {UNVERSIONED}"
                ) from None
            self._unversioned = None
            if update.version is not None:
                self.weight_version = update.version
        finally:
            if self.partial_rollouts and self._unversioned is None:
                self._gate.open()

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str,
        weight_version: str | None = None,
        flush_cache: bool = True,
        load_format: str | None = BUCKET_LOAD_FORMAT,
    ) -> None:
        """Receive one flattened bucket and load it (see `Engine`).

        Refused before receiving (as sglang refuses): no open session, an unknown group, a
        load format other than flattened buckets, or names, dtypes and shapes that do not
        describe a bucket. Refused after receiving and before copying anything: a name the
        model lacks, or a shape that does not fit. `flush_cache` changes nothing here: the
        engine keeps no KV cache between requests.

        Raises:
            EngineError: Naming the refusal.
        """
        await self.start()
        update = self._weight_update
        if update is None:
            raise EngineError(OUTSIDE_SESSION)
        group = self._weight_groups.get(group_name)
        if group is None:
            raise EngineError(
                f"weight group {group_name!r} not in {sorted(self._weight_groups)}; call "
                "init_weights_update_group first"
            )
        if load_format != BUCKET_LOAD_FORMAT:
            raise EngineError(
                f"load_format={load_format!r}: the hf engine receives {BUCKET_LOAD_FORMAT!r} "
                "buckets only"
            )
        try:
            layout = bucket_layout(names, dtypes, shapes)
        except ValueError as exc:
            raise EngineError(f"weight bucket refused before receiving it: {exc}") from None
        flat = torch.empty(layout[-1][-1], dtype=torch.uint8)
        await asyncio.to_thread(receive_bucket, group, flat)
        named = [
            (name, flat[start:end].view(dtype).reshape(shape))
            for name, dtype, shape, start, end in layout
        ]
        await self._load_bucket(named, f"weight bucket of group {group_name!r}", weight_version)

    async def update_weights_in_session(
        self, named: Sequence[tuple[str, torch.Tensor]], *, weight_version: str | None = None
    ) -> None:
        """Load one bucket of tensors handed over in this process (a trainer in the same
        process: nothing received, nothing serialised), as a bucket of the open session, with
        the same checks and the same version rule as a broadcast bucket.

        Raises:
            EngineError: No session is open, or a name or shape the model does not have.
        """
        await self.start()
        if self._weight_update is None:
            raise EngineError(OUTSIDE_SESSION)
        await self._load_bucket(list(named), "weight bucket", weight_version)

    async def _load_bucket(
        self, named: list[tuple[str, torch.Tensor]], what: str, weight_version: str | None
    ) -> None:
        """Check `named` against the model (every name and shape before anything is copied),
        load it, and count it towards the open session."""
        update = self._weight_update
        assert update is not None
        names = [name for name, _ in named]
        async with self._loading():
            try:
                self._check(named, partial=True)
            except ValueError as exc:
                raise EngineError(f"{what}: {exc}") from None
            await asyncio.to_thread(self._load, named)
        update.names.extend(names)
        if weight_version is not None:
            update.version = weight_version

    # -- generation ----------------------------------------------------------------------------

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateOutput]:
        await self.start()
        async with self._lock:
            return await asyncio.to_thread(self.generate_sync, requests)

    def generate_sync(self, requests: Sequence[GenerateRequest]) -> list[GenerateOutput]:
        """Blocking `generate`: decodes chunks of `max_batch_size` requests, in order.

        Raises:
            EngineError: Also, without partial rollouts, while the weights are ones no version
                names (with them, the decoder waits at the closed gate instead).
        """
        if not self.partial_rollouts:
            self._refuse_unversioned()
        if self.model is None:
            self.load()
        outputs: list[GenerateOutput] = []
        size = self.config.max_batch_size
        for start in range(0, len(requests), size):
            outputs.extend(self._generate_chunk(list(requests[start : start + size])))
        return outputs

    def _new_row(self, request: GenerateRequest) -> _Row:
        info = self._info
        assert info is not None
        unknown = set(request.fields) - SUPPORTED_FIELDS - self._warned_fields
        if unknown:
            logger.warning("hf engine ignores request fields %s", sorted(unknown))
            self._warned_fields |= unknown
        sampling = request.sampling
        room = info.context_len - len(request.input_ids)
        if room < 1:
            raise EngineError(
                f"{request.name}: prompt has {len(request.input_ids)} tokens, the model's "
                f"context length is {info.context_len}; no room to generate"
            )
        bad = [t for t in request.input_ids if not 0 <= t < info.vocab_size]
        if bad:
            raise EngineError(
                f"{request.name}: prompt token ids {bad[:5]} are outside the vocabulary "
                f"[0, {info.vocab_size})"
            )
        seed = sampling.seed if sampling.seed is not None else self._seeds.getrandbits(63)
        stop = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop |= set(info.eos_token_ids)
        return _Row(
            request=request,
            generator=torch.Generator().manual_seed(seed),
            stop_ids=frozenset(stop),
            max_new_tokens=min(sampling.max_new_tokens, room),
        )

    def trace(
        self,
        sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
        temperature: float = 1.0,
        *,
        keep: int | None = None,
    ) -> tuple[list[dict[tuple[int, str], torch.Tensor]], list[list[float]]]:
        """Decode each (prompt, response) pair as a rollout decodes, `max_batch_size` at a
        time, taking the response's tokens instead of sampling them, and record what every
        layer computes (`layer_trace.LayerTrace`) for the first `keep` pairs (default: all).
        Every pair is decoded, so the batches are those a rollout of all of them decodes.

        Returns:
            For each kept pair, (layer, op) -> [positions, ...] over the len(prompt) +
            len(response) - 1 positions forwarded, and for every pair the log-prob of each
            response token at `temperature`, as a rollout reports it.
        """
        from ember_rollout.layer_trace import LayerTrace

        if self.model is None:
            self.load()
        assert self.model is not None and self._info is not None
        vocab, context = self._info.vocab_size, self._info.context_len
        for i, (prompt, answer) in enumerate(sequences):
            if not answer:
                raise EngineError(f"traced sequence {i}: an empty response cannot be traced")
            bad = [t for t in answer if not 0 <= t < vocab]
            if bad:
                raise EngineError(
                    f"traced sequence {i}: response token ids {bad[:5]} are outside the "
                    f"vocabulary [0, {vocab})"
                )
            if len(prompt) + len(answer) > context:
                raise EngineError(
                    f"traced sequence {i}: {len(prompt)} prompt and {len(answer)} response "
                    f"tokens exceed the model's context length {context}"
                )
        kept = len(sequences) if keep is None else max(0, min(keep, len(sequences)))
        log_probs: list[list[float]] = []
        size = self.config.max_batch_size
        trace = LayerTrace(self.model, kept)
        self._trace = trace
        try:
            for start in range(0, len(sequences), size):
                chunk = sequences[start : start + size]
                requests = [
                    GenerateRequest(
                        input_ids=list(prompt),
                        # Seeded: the tokens are forced, and the engine's own seed stream is
                        # left as it was for the rollouts that follow.
                        sampling=SamplingParams(
                            temperature=temperature, max_new_tokens=len(answer), seed=0
                        ),
                        name=f"traced sequence {start + i}",
                    )
                    for i, (prompt, answer) in enumerate(chunk)
                ]
                numbers = [i if i < kept else -1 for i in range(start, start + len(chunk))]
                forced = [answer for _, answer in chunk]
                outputs = self._generate_chunk(requests, forced=forced, traced=numbers)
                log_probs += [out.output_log_probs for out in outputs]
        finally:
            self._trace = None
            trace.close()
        return trace.result(), log_probs

    @torch.inference_mode()
    def _generate_chunk(
        self,
        requests: list[GenerateRequest],
        forced: Sequence[Sequence[int]] | None = None,
        traced: Sequence[int] | None = None,
    ) -> list[GenerateOutput]:
        started = time.perf_counter()
        assert self.model is not None and self._info is not None
        rows = [self._new_row(r) for r in requests]
        for row, answer, number in zip(rows, forced or (), traced or (), strict=False):
            row.forced, row.traced = list(answer), number
            row.stop_ids, row.max_new_tokens = frozenset(), len(answer)
        capture = None
        if any(r.wants_routed_experts for r in requests) and self._moe_sites:
            capture = self._capture()
        try:
            self._decode(rows, capture)
        finally:
            if capture is not None:
                capture.close()
        elapsed = time.perf_counter() - started
        return [self._output(row, elapsed) for row in rows]

    def _prefill(
        self, rows: list[_Row], capture: ExpertCapture | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        """Forward each row's prompt and tokens so far into a new KV cache.

        The sequences are left-padded; position ids count real tokens only. Rows whose tokens
        are identical (a GRPO group's samples of one prompt, at the first prefill) are forwarded
        once and their cache, logits and experts copied to each of them, as a prefix cache would
        share them. Routed experts are recorded for the positions a row has none for yet: all of
        them at the first prefill, only the last sampled token when a weight update forces a new
        one (earlier positions keep the experts of the weights that forwarded them).

        Returns:
            Logits of each row's last position [B, V], the attention mask [B, W], each row's
            last position id [B] and the cache.
        """
        from transformers import DynamicCache

        model, device = self.model, self._device
        assert model is not None
        distinct: dict[tuple[int, ...], int] = {}
        source = [
            distinct.setdefault((*row.request.input_ids, *row.output_ids), len(distinct))
            for row in rows
        ]  # row -> its sequence's index in `distinct`
        sequences = list(distinct)
        lengths = [len(s) for s in sequences]
        width = max(lengths)
        input_ids = torch.zeros((len(sequences), width), dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for b, sequence in enumerate(sequences):
            input_ids[b, width - lengths[b] :] = torch.tensor(sequence)
            mask[b, width - lengths[b] :] = 1
        input_ids, mask = input_ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        if self._position_cache:
            from ember_rollout.true_on_policy import PositionCache

            cache = PositionCache(self._info.num_layers)
            placed = cache.at(torch.where(mask.bool(), positions, -1))
        else:
            cache, placed = DynamicCache(config=model.config), {}
        out = model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kw: cache},
            **placed,
        )
        if cache.get_seq_length() != width:
            raise EngineError(
                f"{type(model).__name__} did not fill the KV cache passed as "
                f"{self._cache_kw!r}; this transformers version is not supported"
            )
        if self._trace is not None:
            self._trace.take(
                [
                    (r.traced, b, width - lengths[b] + self._trace.positions(r.traced))
                    for r, b in zip(rows, source, strict=True)
                    if r.traced >= 0
                ],
                len(sequences),
                width,
            )
        if capture is not None:
            experts = capture.pop(len(sequences), width)  # [S, W, layers, topk]
            for row, b in zip(rows, source, strict=True):
                row.experts.append(experts[b, width - lengths[b] + row.recorded :])
        logits, last_positions = out.logits[:, -1], positions[:, -1]
        if len(sequences) < len(rows):
            index = torch.tensor(source, device=device)
            cache.batch_select_indices(index)
            logits, mask, last_positions = logits[index], mask[index], last_positions[index]
        return logits, mask, last_positions, cache

    def _sampling(self, rows: list[_Row], live: list[int]) -> tuple[torch.Tensor, ...]:
        """Temperature, top-k and top-p of the rows in the batch, one entry per slot."""
        device = self._device
        settings = [rows[i].request.sampling for i in live]
        return (
            torch.tensor([s.temperature for s in settings], device=device),
            torch.tensor([s.top_k for s in settings], device=device),
            torch.tensor([s.top_p for s in settings], device=device),
        )

    def _decode(self, rows: list[_Row], capture: ExpertCapture | None) -> None:
        """Prefill, then sample, stop, and extend the cache one token per step until every row
        finished. Each forward pass runs inside a weight-gate step, and the tokens its logits
        draw carry the weight version in force during that pass."""
        model, device, gate = self.model, self._device, self._gate
        live = list(range(len(rows)))  # batch slot -> row index
        forcing = any(row.forced is not None for row in rows)  # `trace` only
        with gate.step() as epoch:
            logits_BV, mask, last_positions, cache = self._prefill(rows, capture)
            version = self.weight_version
        temps, top_k, top_p = self._sampling(rows, live)
        step = 0
        while True:
            # Sampled from the filtered distribution; reported under the full tempered one.
            log_probs = tempered_log_probs(logits_BV, temps)
            active = [s for s, i in enumerate(live) if rows[i].finish is None]
            sampled_from = filter_log_probs(log_probs[active], top_k[active], top_p[active])
            tokens = sample_tokens(sampled_from, [rows[live[s]].generator for s in active])
            for j, s in enumerate(active if forcing else ()):
                row = rows[live[s]]
                if row.forced is not None:
                    tokens[j] = row.forced[len(row.output_ids)]
            chosen = log_probs[active].gather(1, tokens.to(device).unsqueeze(1)).squeeze(1)
            next_tokens = torch.zeros(len(live), dtype=torch.long)
            for s, token, lp in zip(active, tokens.tolist(), chosen.tolist(), strict=True):
                rows[live[s]].take(token, lp, version)
                next_tokens[s] = token
            running = [s for s, i in enumerate(live) if rows[i].finish is None]
            if not running:
                return
            step += 1
            every = self.config.compact_every
            if every and step % every == 0 and len(running) < len(live):
                keep = torch.tensor(running, device=device)
                cache.batch_select_indices(keep)
                mask, last_positions = mask[keep], last_positions[keep]
                temps, top_k, top_p = temps[keep], top_k[keep], top_p[keep]
                next_tokens = next_tokens[keep.cpu()]
                live = [live[s] for s in running]
                running = list(range(len(live)))
            with gate.step() as now:
                if now != epoch:
                    # The weights changed behind the gate: the cache holds keys and values of
                    # the old ones. Forward the unfinished rows again with the new weights.
                    live = [live[s] for s in running]
                    logits_BV, mask, last_positions, cache = self._prefill(
                        [rows[i] for i in live], capture
                    )
                    temps, top_k, top_p = self._sampling(rows, live)
                    epoch = now
                else:
                    mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=1)
                    last_positions = last_positions + 1
                    placed = cache.at(last_positions[:, None]) if self._position_cache else {}
                    out = model(
                        input_ids=next_tokens.to(device).unsqueeze(1),
                        attention_mask=mask,
                        position_ids=last_positions.unsqueeze(1),
                        use_cache=True,
                        **{self._cache_kw: cache},
                        **placed,
                    )
                    logits_BV = out.logits[:, -1]
                    if self._trace is not None:
                        advanced = [(rows[live[s]].traced, s, 0) for s in running]
                        self._trace.take(advanced, len(live), 1)
                    if capture is not None:
                        experts = capture.pop(len(live), 1)
                        for s in running:
                            rows[live[s]].experts.append(experts[s])
                version = self.weight_version

    def _output(self, row: _Row, elapsed: float) -> GenerateOutput:
        request = row.request
        assert row.finish is not None
        meta: dict[str, Any] = {
            "id": request.name,
            "finish_reason": row.finish,
            "prompt_tokens": len(request.input_ids),
            "completion_tokens": len(row.output_ids),
            "cached_tokens": 0,
            "output_token_logprobs": [
                [lp, token, None] for lp, token in zip(row.log_probs, row.output_ids, strict=True)
            ],
            "weight_version": row.versions[-1][1] if row.versions else self.weight_version,
            "e2e_latency": elapsed,
        }
        if row.versions and all(version is not None for _, version in row.versions):
            ends = [start for start, _ in row.versions[1:]] + [len(row.output_ids)]
            meta[WEIGHT_VERSIONS_KEY] = [
                {"version": version, "start": start, "end": end}
                for (start, version), end in zip(row.versions, ends, strict=True)
            ]
        experts = None
        if request.wants_routed_experts:
            info = self._info
            assert info is not None
            if row.experts:
                experts = torch.cat(row.experts, dim=0)
            else:  # a dense model: every layer reports zeros
                experts = torch.zeros(
                    len(request.input_ids) + len(row.output_ids) - 1,
                    info.num_layers,
                    max(info.topk, 1),
                    dtype=torch.int32,
                )
            expected = len(request.input_ids) + len(row.output_ids) - 1
            assert experts.shape[0] == expected, (experts.shape, expected)
            meta["routed_experts"] = encode_routed_experts(experts)
        return GenerateOutput(
            output_ids=list(row.output_ids),
            output_log_probs=list(row.log_probs),
            finish_reason=row.finish["type"],
            meta_info=meta,
            routed_experts=experts,
        )

    # -- reference path ------------------------------------------------------------------------

    @torch.inference_mode()
    def generate_uncached(self, requests: Sequence[GenerateRequest]) -> list[GenerateOutput]:
        """Generate one request at a time, re-running the full sequence every step (no cache).

        The slow reference the batched path is checked against: same sampler, same
        seeds, but no padding, no batching and no KV cache. It runs outside the weight gate, so
        it refuses weights that no version names whatever `partial_rollouts` says.
        """
        self._refuse_unversioned()
        if self.model is None:
            self.load()
        model, device = self.model, self._device
        outputs = []
        for request in requests:
            started = time.perf_counter()
            row = self._new_row(request)
            sampling = request.sampling
            tokens = list(request.input_ids)
            while row.finish is None:
                ids = torch.tensor([tokens], device=device)
                logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[:, -1]
                log_probs = tempered_log_probs(logits, sampling.temperature)
                sampled_from = filter_log_probs(log_probs, sampling.top_k, sampling.top_p)
                token = int(sample_tokens(sampled_from, [row.generator])[0])
                row.take(token, float(log_probs[0, token]), self.weight_version)
                tokens.append(token)
            if request.wants_routed_experts and self._moe_sites:
                capture = self._capture()
                try:
                    model(input_ids=torch.tensor([tokens[:-1]], device=device), use_cache=False)
                    row.experts.append(capture.pop(1, len(tokens) - 1)[0])
                finally:
                    capture.close()
            outputs.append(self._output(row, time.perf_counter() - started))
        return outputs


ENGINES.add("hf", HFEngine)
