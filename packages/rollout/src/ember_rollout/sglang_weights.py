"""Weights into SGLang servers: from disk, by tensor handle, and broadcast from the trainer."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ember_rollout.engine import EngineError

if TYPE_CHECKING:
    from pathlib import Path

    from ember_rollout.config import SGLangEngineConfig

logger = logging.getLogger(__name__)

IPC_DEVICE_TYPES: tuple[str, ...] = ("cuda", "cpu")
"""Devices whose tensors can reach a separately launched SGLang server on this machine without
copying them into the request: CUDA tensors as IPC handles, CPU tensors as the name of a
shared-memory file (torch's `file_system` sharing strategy, used while pickling them). With
torch's default `file_descriptor` strategy a CPU tensor would pickle as an fd that the receiver
fetches from the sender's `multiprocessing.resource_sharer`, which answers only a process
holding the sender's authkey (multiprocessing/resource_sharer.py `get_connection`); sglang's
tp_worker.py 199 fails that check and the server goes down.
"""

UNVERSIONED = (
    "serves no weight version until a complete push (a session whose last bucket names its "
    "version) or a load from disk"
)

_STORAGE_DEVICE_ARG = 6
"""Index of `storage_device` in the arguments of torch's `rebuild_cuda_tensor`."""


def _reduce_tensor_by_device_uuid(tensor: torch.Tensor) -> tuple[Any, tuple]:
    """torch's tensor reducer, naming a CUDA tensor's device by UUID instead of index.

    The server's processes may number GPUs differently from the sender. sglang 0.5.23 senders
    (weight_sync/utils.py, utils/patch_torch.py) send the UUID, and its receiver maps a UUID (or
    an index) back to its own device before opening the IPC handle.
    """
    from torch.multiprocessing import reductions

    rebuild, args = reductions.reduce_tensor(tensor)
    if rebuild is reductions.rebuild_cuda_tensor and isinstance(args[_STORAGE_DEVICE_ARG], int):
        uuid = str(torch.cuda.get_device_properties(args[_STORAGE_DEVICE_ARG]).uuid)
        args = (*args[:_STORAGE_DEVICE_ARG], uuid, *args[_STORAGE_DEVICE_ARG + 1 :])
    return rebuild, args


def _serialize_for_ipc(obj: Any) -> str:
    """Pickle `obj` with its tensors as handles, base64-encoded to fit in JSON."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers tensor reducers with ForkingPickler)

    buffer = io.BytesIO()
    pickler = ForkingPickler(buffer)
    pickler.dispatch_table[torch.Tensor] = _reduce_tensor_by_device_uuid
    with _file_system_sharing():
        pickler.dump(obj)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


@contextlib.contextmanager
def _file_system_sharing() -> Iterator[None]:
    """torch's `file_system` sharing strategy for the block: CPU storages pickle as the name of
    a shared-memory file, which any process on this machine can open (see `IPC_DEVICE_TYPES`).
    The file lives as long as the sender's tensor does."""
    import torch.multiprocessing as mp

    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        mp.set_sharing_strategy(before)


def serialize_named_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Pickle (name, tensor) pairs as SGLang's /update_weights_from_tensor expects them.

    The pickle carries CUDA IPC handles or shared-memory file names rather than the data, so
    the server must run on the same machine; base64 makes it fit in JSON. Only torch and
    builtin globals appear in it, the ones sglang 0.5.23's `SafeUnpickler` (utils/common.py)
    accepts.
    """
    return _serialize_for_ipc([(name, tensor.detach()) for name, tensor in named_tensors])


def serialize_flattened_bucket(
    flat: torch.Tensor,
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
) -> str:
    """Pickle one flattened bucket for /update_weights_from_tensor with load_format
    "flattened_bucket": `{"flattened_tensor": flat, "metadata": [...]}`, as sglang 0.5.23's
    `_update_weights_from_flattened_bucket` (model_runner_components/weight_updater.py) reads
    it. Its metadata entries are read by attribute (name, shape, dtype, start_idx, end_idx,
    numel; byte offsets); `types.SimpleNamespace` carries them, a global sglang's
    `SafeUnpickler` (utils/common.py) accepts. So does sglang's own `FlattenedTensorMetadata`,
    but that would make the trainer import sglang.

    Args:
        flat: uint8 [bytes], tensor i's bytes after tensor i - 1's, on a CUDA device.
        names, dtypes, shapes: Each tensor's HF name, torch dtype name and shape.

    Raises:
        ValueError: `flat` is not on a device in `IPC_DEVICE_TYPES`, or the metadata does
            not add up to its size.
    """
    from types import SimpleNamespace

    if flat.device.type not in IPC_DEVICE_TYPES:
        raise ValueError(
            f"a flattened bucket on {flat.device} cannot reach a separately launched SGLang "
            f"server by handle (devices: {', '.join(IPC_DEVICE_TYPES)}); use weights.transport "
            "broadcast or disk"
        )
    metadata, offset = [], 0
    for name, dtype_name, shape in zip(names, dtypes, shapes, strict=True):
        dtype = getattr(torch, dtype_name)
        size = torch.Size(shape)
        nbytes = size.numel() * dtype.itemsize
        metadata.append(
            SimpleNamespace(
                name=name,
                shape=size,
                dtype=dtype,
                start_idx=offset,
                end_idx=offset + nbytes,
                numel=nbytes,
            )
        )
        offset += nbytes
    if offset != flat.numel():
        raise ValueError(f"the bucket's metadata covers {offset} bytes, the buffer {flat.numel()}")
    return _serialize_for_ipc({"flattened_tensor": flat.detach(), "metadata": metadata})


def ipc_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs as a list, if every tensor can be sent by handle.

    Raises:
        TypeError: A value is not a tensor; names it.
        ValueError: A tensor is not on a device in `IPC_DEVICE_TYPES`; names the first one.
    """
    tensors = list(named_tensors)
    for name, tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"update_weights_from_tensors: {name!r} is a {type(tensor).__name__}")
        if tensor.device.type not in IPC_DEVICE_TYPES:
            raise ValueError(
                f"update_weights_from_tensors: {name!r} is on {tensor.device}, but a separately "
                "launched SGLang server can only receive tensors by handle from "
                f"{', '.join(IPC_DEVICE_TYPES)}; save a checkpoint and call "
                "update_weights_from_disk(path)"
            )
    return tensors


def check_version(what: str, weight_version: object) -> None:
    """sglang 0.5.23 (managers/io_struct.py) takes `weight_version` as a string or null and
    answers anything else with HTTP 400 before the update runs; for a broadcast that would leave
    the sender waiting for receivers, so it is refused here first.

    Raises:
        TypeError: `weight_version` is neither None nor a string; names the call.
    """
    if weight_version is not None and not isinstance(weight_version, str):
        raise TypeError(
            f"{what}: weight_version={weight_version!r} is a {type(weight_version).__name__}; "
            "expected a string or None"
        )


class WeightUpdates:
    """The part of `SGLangEngine` that loads new weights into its servers.

    Disk loads need no session; tensor and distributed updates run inside a weight-update
    session (`begin_weight_update` .. `end_weight_update`), as sglang 0.5.23 requires.

    With `partial_rollouts`, weights arrive while requests run. Each update then pauses
    generation in place first (POST /pause_generation {"mode": "in_place"}) and continues it
    after (POST /continue_generation). sglang 0.5.23 (managers/scheduler.py
    `pause_generation`) keeps a request paused in place where it was: its KV cache, its
    log-probs and its routed experts (read at the end from the rows of its KV slots,
    managers/scheduler_components/batch_result_processor.py) all stay those of the forward
    that produced each token, and the tokens after the update come from the new weights. The
    server records the version spans itself (utils/weight_versions.py). Retracting instead
    (mode "retract") would free the KV cache and prefill the tokens again under the new
    weights, so the routed experts of the old tokens would come from other weights than their
    log-probs (`Req.reset_for_retract` drops the recorded experts): under R3 the trainer
    would replay routes that did not produce the tokens.

    Two things follow. The cache cannot be flushed after such an update (sglang refuses a flush
    while requests are running), so updates are sent with `flush_cache` false; and no later
    request may reuse a prefix cached under older weights, so the servers must run without the
    radix cache (`--disable-radix-cache`, added to launched servers; attached ones are checked
    at start).

    A server loads each bucket as it arrives, and the sender names the version with the last
    one, so a push that stops partway (an engine of the push or its sender died, a bucket
    failed) leaves the servers holding weights of two versions under the old label. The rule
    is the embedded engine's (`hf_engine.HFEngine`): the engine then serves no version and
    generates nothing until a complete update arrives, a session whose last bucket names its
    version or a load from disk (what the driver sends next when it mends a failed push).
    `end_weight_update` raises on such a session; under `partial_rollouts` generation stays
    paused in place (requests in flight continue on the complete weights, and new ones wait on
    the servers, up to `request_timeout_s`), and without, `generate` refuses, naming why.
    """

    config: SGLangEngineConfig
    urls: list[str]
    start: Callable[[], Any]
    _post: Callable[..., Any]
    _post_all: Callable[..., Any]
    _post_each: Callable[..., Any]

    partial_rollouts: bool = False
    """Take new weights while requests run (`rollout.partial_rollouts`), pausing generation in
    place around each update; set it before `start`."""

    _unversioned: str | None = None
    """What left the servers holding weights that no version names (see the class docstring),
    or None."""

    def _refuse_unversioned(self, what: str) -> None:
        """Refuse `what` (a generation) while the servers hold weights that no version names.

        Raises:
            EngineError: Naming what left them.
        """
        if self._unversioned is not None:
            raise EngineError(
                f"{what}: the servers hold weights that no version names ({self._unversioned}); "
                f"the engine {UNVERSIONED}"
            )

    async def _generation_control(self, path: str, body: dict[str, Any]) -> None:
        """POST /pause_generation or /continue_generation to every server at once.

        sglang 0.5.23 http_server.py answers both 200 {"message": ..., "status": "ok"}. Either
        may be retried: a second pause or continue only sets the same flag again.

        Raises:
            EngineError: A server failed or answered otherwise; names every such server.
        """
        what = path.lstrip("/")

        async def one(url: str) -> str | None:
            where = f"{what} on {url}"
            try:
                answer = await self._post(f"{url}{path}", body, where=where)
            except EngineError as exc:
                return str(exc)
            if not isinstance(answer, dict) or answer.get("status") != "ok":
                return f"{where} answered {str(answer)[:200]}; expected status ok"
            return None

        errors = [e for e in await asyncio.gather(*(one(url) for url in self.urls)) if e]
        if errors:
            raise EngineError("; ".join(errors))

    async def _pause_generation(self) -> None:
        """Pause generation in place on every server (partial rollouts only; servers that hold
        weights no version names are paused already). If a server refuses, every server is
        continued again (continuing one that is not paused changes nothing) before the refusal
        is raised: none is left paused."""
        if not self.partial_rollouts or self._unversioned is not None:
            return
        try:
            await self._generation_control("/pause_generation", {"mode": "in_place"})
        except BaseException:
            try:
                await self._generation_control("/continue_generation", {})
            except EngineError as exc:
                logger.error("while continuing generation after a failed pause: %s", exc)
            raise

    async def _continue_generation(self) -> None:
        """Continue generation on every server after `_pause_generation`, unless they hold
        weights that no version names."""
        if self.partial_rollouts and self._unversioned is None:
            await self._generation_control("/continue_generation", {})

    @contextlib.asynccontextmanager
    async def _paused(self) -> AsyncIterator[None]:
        """Generation paused in place for the block (partial rollouts; else nothing), and
        continued after it (unless the servers hold weights that no version names)."""
        await self._pause_generation()
        try:
            yield
        finally:
            await self._continue_generation()

    def _flush(self, flush_cache: bool) -> bool:
        """`flush_cache` as sent: never under partial rollouts, where requests stay paused
        across the update and sglang refuses to flush while any runs."""
        return flush_cache and not self.partial_rollouts

    @contextlib.asynccontextmanager
    async def _weight_update_session(self) -> AsyncIterator[None]:
        """Open a weight-update session on every server for the block, and always close it.

        The first failure is raised (a begin's, else the block's, else an end's); an end's
        failure after another one is logged.
        """
        await self.begin_weight_update()
        try:
            yield
        except BaseException:
            try:
                await self.end_weight_update()
            except EngineError as exc:
                logger.error("while closing the weight-update session after a failure: %s", exc)
            raise
        await self.end_weight_update()

    # -- weights -------------------------------------------------------------------------------

    async def update_weights_from_disk(
        self, path: str | Path, *, weight_version: str | None = None
    ) -> None:
        """Every server loads the HF checkpoint at `path` (a path on the servers' machine).

        sglang 0.5.23 loads from disk without a begin/end session (weight_updater.py restores
        and post-processes the weights itself) and waits for running requests to finish first.
        A load that failed or timed out is retried: loading a checkpoint again changes nothing.

        Raises:
            TypeError: `weight_version` is not a string.
            EngineError: A server refused or failed; names it.
        """
        check_version("update_weights_from_disk", weight_version)
        await self.start()
        payload: dict[str, Any] = {
            "model_path": str(path),
            "load_format": None,  # the server's --load-format
            "flush_cache": self._flush(True),  # drop KV cache computed with the old weights
            "abort_all_requests": False,
            "weight_version": weight_version,
        }
        # Paused, sglang 0.5.23 (tokenizer_manager.py) loads at once instead of waiting for the
        # running requests. A load that fails is rolled back to the weights held before
        # (model_runner_components/weight_updater.py), so only a success changes what they are.
        async with self._paused():
            await self._post_all(
                "/update_weights_from_disk", payload, what="update_weights_from_disk"
            )
            self._unversioned = None

    async def update_weights_from_tensors(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        weight_version: str | None = None,
    ) -> None:
        """Send CUDA tensors by IPC handle (same machine only) inside a weight-update session.

        Each server gets one serialization per TP rank: sglang 0.5.23 (managers/tp_worker.py)
        lets every rank open only its own copy.

        Raises:
            TypeError: `weight_version` is not a string, or a value is not a tensor.
            ValueError: A tensor is not on a CUDA device; use `update_weights_from_disk`.
            EngineError: A server refused the session or the update; the session is closed on
                every server that opened it either way.
        """
        check_version("update_weights_from_tensors", weight_version)
        tensors = ipc_tensors(named_tensors)
        await self.start()

        def payload(_: int) -> dict[str, Any]:
            return {
                "serialized_named_tensors": [
                    serialize_named_tensors(tensors) for _ in range(self.config.tp_size)
                ],
                "load_format": None,
                "flush_cache": self._flush(True),
                "weight_version": weight_version,
            }

        async with self._weight_update_session():
            await self._session_update(
                self._post_all(
                    "/update_weights_from_tensor",
                    payload,
                    what="update_weights_from_tensor",
                    once=True,
                ),
                weight_version,
                whole=True,
            )

    # -- weights from the trainer: sessions, weight groups, buckets ------------------------------

    _session_urls: tuple[str, ...] = ()
    """The servers on which this engine's open weight-update session began."""
    _session_buckets: int = 0
    """Buckets the open session has sent (a whole update in one request that names no version
    is not counted: it leaves what the servers hold as it was)."""
    _session_version: str | None = None
    """The version the session's last bucket named, once it loaded on every server."""
    _session_failure: str | None = None
    """The first failure of an update in the open session."""

    async def _session_update(
        self, send: Awaitable[Any], weight_version: str | None, *, whole: bool = False
    ) -> None:
        """Await `send`, one update of the open session, and record how the session stands
        (`end_weight_update` judges it). With `whole`, the request holds a whole update."""
        counted = not (whole and weight_version is None)
        if counted:
            self._session_buckets += 1
            self._session_version = None
        try:
            await send
        except BaseException as exc:  # a server may have loaded part of it
            self._session_failure = self._session_failure or str(exc)
            raise
        if counted:
            self._session_version = weight_version

    def _session_stopped_partway(self) -> str | None:
        """Why the open session left weights that no version names, or None: it completed, or
        it loaded nothing."""
        if self._session_failure is not None:
            return f"an update of the session failed: {self._session_failure}"
        if self._session_buckets and self._session_version is None:
            return (
                f"the session loaded {self._session_buckets} bucket(s), and the last named no "
                "weight version (the sender names it with the last bucket of a push)"
            )
        return None

    @property
    def weight_group_size(self) -> int:
        """One rank per GPU: `tp_size` per server (launched ones: `num_servers` of them)."""
        servers = len(self.urls) or self.config.num_servers
        return servers * self.config.tp_size

    async def begin_weight_update(self) -> None:
        """Open a weight-update session on every server (POST /begin_weight_update).

        sglang 0.5.23 (scheduler_components/weight_updater.py) takes tensor and distributed
        updates only inside one, and refuses a begin while one is open. If a server refuses,
        the sessions opened on the others are closed again. Under `partial_rollouts` generation
        is paused in place first and stays paused until `end_weight_update`.

        Raises:
            EngineError: This engine has a session open already, or a server refused.
        """
        await self.start()
        if self._session_urls:
            raise EngineError(
                "begin_weight_update: this engine's weight-update session is open already; "
                "call end_weight_update() first"
            )
        await self._pause_generation()
        try:
            await self._begin_sessions()
        except BaseException:
            await self._continue_generation()
            raise
        self._session_buckets, self._session_version, self._session_failure = 0, None, None

    async def _begin_sessions(self) -> None:
        began = await self._post_each(
            "/begin_weight_update", {"selector": "all"}, what="begin_weight_update", once=True
        )
        opened = tuple(url for url, error in zip(self.urls, began, strict=True) if error is None)
        errors = [error for error in began if error is not None]
        if errors:
            ended = await self._post_each(
                "/end_weight_update", {}, what="end_weight_update", urls=opened, once=True
            )
            for error in ended:
                if error is not None:
                    logger.error("while closing the sessions a failed begin opened: %s", error)
            raise errors[0]
        self._session_urls = opened

    async def end_weight_update(self) -> None:
        """Close the session `begin_weight_update` opened, on every server it opened on, and
        continue generation under `partial_rollouts`.

        A session that loaded buckets is complete when every one loaded and the last named a
        version; one that stopped partway is closed all the same, and then the engine serves no
        version until a complete update, generation staying paused (see the class docstring).
        A complete one ends that state; one that loaded nothing changes nothing.

        Raises:
            EngineError: No session is open, the session stopped partway (named), or a server
                refused (after all were asked).
        """
        opened, self._session_urls = self._session_urls, ()
        if not opened:
            raise EngineError(
                "end_weight_update: no weight-update session is open; call "
                "begin_weight_update() first"
            )
        partway = self._session_stopped_partway()
        if partway is not None:
            self._unversioned = partway
        elif self._session_buckets:
            self._unversioned = None
        self._session_buckets, self._session_version, self._session_failure = 0, None, None
        try:
            ended = await self._post_each(
                "/end_weight_update", {}, what="end_weight_update", urls=opened, once=True
            )
        finally:
            await self._continue_generation()
        errors = [error for error in ended if error is not None]
        if partway is not None:
            for error in errors:
                logger.error(
                    "while closing a weight-update session that stopped partway: %s", error
                )
            raise EngineError(
                f"end_weight_update: {partway}; the servers keep what it loaded, so the engine "
                f"{UNVERSIONED}"
            )
        if errors:
            raise errors[0]

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
        """Every server joins weight group `group_name` (POST /init_weights_update_group).

        Server i takes ranks `rank_offset + i * tp_size` onwards: sglang 0.5.23
        (model_runner_components/weight_updater.py) joins TP rank r as `rank_offset + r`,
        through a rendezvous the sender (rank 0) hosts, so the sender joins while the servers
        are asked. A server fails a group name it has already.

        Raises:
            EngineError: A server failed to join; names it.
        """
        tp = self.config.tp_size

        def payload(i: int) -> dict[str, Any]:
            return {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset + i * tp,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            }

        await self._post_all(
            "/init_weights_update_group", payload, what="init_weights_update_group", once=True
        )

    async def destroy_weights_update_group(self, group_name: str) -> None:
        """Every server leaves weight group `group_name` (POST /destroy_weights_update_group)."""
        await self._post_all(
            "/destroy_weights_update_group",
            {"group_name": group_name},
            what="destroy_weights_update_group",
            once=True,
        )

    def _check_session(self, what: str) -> None:
        if not self._session_urls:
            # sglang 0.5.23 refuses it too, but only after the sender has started a broadcast
            # that then waits for receivers that never come.
            raise EngineError(
                f"{what} must run between begin_weight_update() and end_weight_update()"
            )

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
        """Every server receives one flattened bucket from rank 0 of `group_name` and loads it
        (POST /update_weights_from_distributed, load_format "flattened_bucket": sglang 0.5.23
        allocates the buffer from the names, dtypes and shapes, receives it with one
        `broadcast(src=0)` and loads the tensors cut from it).

        Raises:
            TypeError: A name, dtype or the version is not a string; names it.
            EngineError: No open session, or a server refused or failed; names it.
        """
        what = "update_weights_from_distributed"
        check_version(what, weight_version)
        for key, values in (("names", names), ("dtypes", dtypes)):
            bad = [value for value in values if not isinstance(value, str)]
            if bad:
                raise TypeError(f"{what}: {key} holds {bad[0]!r}; expected strings")
        self._check_session(what)
        payload = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [[int(d) for d in shape] for shape in shapes],
            "group_name": group_name,
            "load_format": "flattened_bucket",
            "flush_cache": self._flush(flush_cache),
            "abort_all_requests": False,
            "weight_version": weight_version,
        }
        await self._session_update(
            self._post_all(
                "/update_weights_from_distributed",
                payload,
                what="update_weights_from_distributed",
                once=True,
            ),
            weight_version,
        )

    async def update_weights_from_ipc(
        self,
        payloads: Sequence[str],
        *,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> None:
        """Every server loads one flattened bucket handed over by CUDA IPC handle
        (POST /update_weights_from_tensor, load_format "flattened_bucket"), in an open session.

        Args:
            payloads: `weight_group_size` serializations of the bucket
                (`serialize_flattened_bucket`), made on this machine: server i's TP rank r
                opens `payloads[i * tp_size + r]` only (sglang 0.5.23 tp_worker.py
                `deserialize_own_rank`), so no handle is opened twice.

        Raises:
            ValueError: Not `weight_group_size` payloads.
            TypeError: The version is not a string.
            EngineError: No open session, or a server refused or failed; names it.
        """
        check_version("update_weights_from_ipc", weight_version)
        tp = self.config.tp_size
        if len(payloads) != self.weight_group_size:
            raise ValueError(
                f"{len(payloads)} IPC payloads for {len(self.urls)} server(s) of tp_size {tp}: "
                f"expected {self.weight_group_size}, one per rank"
            )
        self._check_session("update_weights_from_tensor")

        def payload(i: int) -> dict[str, Any]:
            return {
                "serialized_named_tensors": list(payloads[i * tp : (i + 1) * tp]),
                "load_format": "flattened_bucket",
                "flush_cache": self._flush(flush_cache),
                "weight_version": weight_version,
            }

        await self._session_update(
            self._post_all(
                "/update_weights_from_tensor", payload, what="update_weights_from_tensor", once=True
            ),
            weight_version,
        )
