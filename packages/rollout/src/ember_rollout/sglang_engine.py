"""The `sglang` engine: launches or attaches to SGLang servers and talks to their HTTP API."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import aiohttp
import torch

from ember_rollout.config import SGLangEngineConfig, gpu_placement_flags
from ember_rollout.engine import (
    ENGINES,
    Engine,
    EngineError,
    GenerateOutput,
    GenerateRequest,
    ModelInfo,
    memory_tags,
)
from ember_rollout.families import EXPERT_COUNT_KEYS, config_moe_layers
from ember_rollout.routing import (
    ROUTED_EXPERTS_DTYPE_KEY,
    ROUTED_EXPERTS_KEY,
    decode_routed_experts,
)

if TYPE_CHECKING:
    from ember_core.plugins import EmberPlugins
    from ember_rollout.config import EngineConfig

logger = logging.getLogger(__name__)

_FINISH_TYPES = ("stop", "length", "abort")


class _RetryableError(Exception):
    """A failure worth retrying: the connection broke, timed out, or the server answered 5xx."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def model_info_from_dir(path: str | Path | None) -> ModelInfo | None:
    """Layers, top-k, vocabulary and context length from a local HF model's config.json.

    EOS ids come from config.json and generation_config.json together, as transformers
    merges them. Returns None when `path` holds no config.json (an attached server's model).

    Raises:
        ValueError: A field the engine needs is missing or not an integer; names the field and
            the file.
    """
    if path is None or not (Path(path) / "config.json").is_file():
        return None
    file = Path(path) / "config.json"
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file}: not valid JSON ({exc})") from None
    config = config.get("text_config", config)

    def required(*keys: str) -> int:
        for key in keys:
            value = config.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                return value
        found = {k: config[k] for k in keys if k in config}
        raise ValueError(
            f"{file}: {' or '.join(keys)} is {'missing' if not found else found}; the sglang "
            "engine needs it as a non-negative integer (it does not guess a default)"
        )

    num_layers = required("num_hidden_layers")
    topk = int(config.get("num_experts_per_tok") or 0)
    num_experts = required(*EXPERT_COUNT_KEYS) if topk else 0
    eos: set[int] = set()
    sources = [config]
    generation = Path(path) / "generation_config.json"
    if generation.is_file():
        sources.append(json.loads(generation.read_text()))
    for source in sources:
        value = source.get("eos_token_id")
        eos.update([value] if isinstance(value, int) else value or [])
    return ModelInfo(
        num_layers=num_layers,
        topk=topk,
        num_experts=num_experts,
        moe_layers=config_moe_layers(config),
        vocab_size=required("vocab_size"),
        context_len=required("max_position_embeddings"),
        eos_token_ids=tuple(sorted(eos)),
    )


IPC_DEVICE_TYPES: tuple[str, ...] = ("cuda",)
"""Devices whose tensors can reach a separately launched SGLang server by handle.

A CPU tensor pickles as a shared-memory fd that the receiver fetches from the sender's
`multiprocessing.resource_sharer`, which only answers a client holding the sender's process
authkey (multiprocessing/resource_sharer.py `get_connection`); a server launched on its own has
another one. SGLang documents GPU tensors only for /update_weights_from_tensor.
"""

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
    pickler.dump(obj)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def serialize_named_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Pickle (name, tensor) pairs as SGLang's /update_weights_from_tensor expects them.

    The pickle carries CUDA IPC handles rather than the data, so the server must run on the same
    machine; base64 makes it fit in JSON. Only torch and builtin globals appear in it, the ones
    sglang 0.5.23's `SafeUnpickler` (utils/common.py) accepts.
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
            "server by handle (CUDA tensors only); use weights.transport broadcast or disk"
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
                "launched SGLang server can only receive CUDA tensors (by IPC handle; a CPU "
                "tensor's shared-memory fd cannot be passed to it). Move the tensors to a GPU "
                "of the same machine, or save a checkpoint and call update_weights_from_disk(path)"
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


class SGLangEngine(Engine):
    """Rollouts from SGLang servers over HTTP, with bounded retries and backoff.

    Requests go round-robin to the servers, at most `max_concurrency` in flight per server.
    Each /generate asks for `return_logprob`, so the response tokens and their log-probs both
    come from `meta_info.output_token_logprobs` ([logprob, token_id, text] per token).
    """

    kind: ClassVar[str] = "sglang"

    def __init__(
        self,
        config: SGLangEngineConfig | None = None,
        *,
        extra_server_args: Sequence[str] = (),
        model_info: ModelInfo | None = None,
    ) -> None:
        """Create the engine; `start()` launches or attaches.

        Args:
            config: Engine settings.
            extra_server_args: Added to launched servers' command lines (plugins' arguments).
            model_info: The served model's shape; by default read from model_path/config.json.
        """
        self.config = config or SGLangEngineConfig()
        self.extra_server_args = list(extra_server_args)
        self._info = model_info or model_info_from_dir(self.config.model_path)
        self.urls: list[str] = [u.rstrip("/") for u in self.config.urls]
        self._processes: list[tuple[subprocess.Popen, Path | None]] = []
        self._session: aiohttp.ClientSession | None = None
        self._semaphores: list[asyncio.Semaphore] = []
        self._next = 0

    @classmethod
    def from_config(
        cls, config: EngineConfig, *, plugins: EmberPlugins | None = None
    ) -> SGLangEngine:
        extra = plugins.rollout_server_args(cls.kind) if plugins is not None else []
        return cls(config.sglang, extra_server_args=extra)

    @property
    def model_info(self) -> ModelInfo | None:
        return self._info

    # -- lifecycle -----------------------------------------------------------------------------

    def server_command(self, port: int, index: int = 0) -> list[str]:
        """The command line of launched server `index` (0-based).

        Server i runs on GPUs `base_gpu_id + i * tp_size` and the `tp_size - 1` after it.

        Raises:
            ValueError: No model_path, or the plugins' arguments set the GPU placement.
        """
        cfg = self.config
        if cfg.model_path is None:
            raise ValueError("sglang.model_path is required to launch servers (or set sglang.urls)")
        misplaced = gpu_placement_flags(self.extra_server_args, cfg.num_servers)
        if misplaced:
            raise ValueError(
                f"plugins' rollout_server_args {self.extra_server_args} set "
                + "; ".join(misplaced)
                + ": Ember places launched servers on GPUs itself"
            )
        command = [
            cfg.python or sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            cfg.model_path,
            "--host",
            cfg.host,
            "--port",
            str(port),
            "--tp-size",
            str(cfg.tp_size),
            # sglang 0.5.23 entrypoints/engine.py: TP rank r runs on GPU base_gpu_id + r (step 1)
            "--base-gpu-id",
            str(cfg.base_gpu_id + index * cfg.tp_size),
        ]
        if cfg.mem_fraction_static is not None:
            command += ["--mem-fraction-static", str(cfg.mem_fraction_static)]
        return command + list(cfg.server_args) + self.extra_server_args

    async def start(self) -> None:
        if self._session is not None:
            return
        if not self.urls:
            self._launch()
        # aiohttp 3.14 connector.py: a TCPConnector holds at most 100 connections by default, and
        # client.py starts the `total` timer before waiting for one. Unlimited here, so a request
        # our per-server semaphore admits is sent at once and its timeout starts with it.
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_s)
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout)
        self._semaphores = [asyncio.Semaphore(self.config.max_concurrency) for _ in self.urls]
        try:
            await self.wait_healthy(self.config.launch_timeout_s)
        except BaseException:
            await self.shutdown()
            raise

    def _launch(self) -> None:
        cfg = self.config
        log_dir = Path(cfg.log_dir) if cfg.log_dir else None
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
        for i in range(cfg.num_servers):
            port = cfg.base_port + i if cfg.base_port else free_port(cfg.host)
            command = self.server_command(port, i)
            log_path = log_dir / f"sglang-{i}-{port}.log" if log_dir else None
            sink = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115
            logger.info("launching SGLang server %d: %s", i, " ".join(command))
            process = subprocess.Popen(
                command, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
            )
            if log_path:
                sink.close()
            self._processes.append((process, log_path))
            host = "127.0.0.1" if cfg.host in ("0.0.0.0", "::") else cfg.host
            self.urls.append(f"http://{host}:{port}")

    async def wait_healthy(self, timeout_s: float) -> None:
        """Poll GET /health of every server until all answer 200.

        Raises:
            EngineError: A launched server exited, or `timeout_s` passed; names the server.
        """
        deadline = time.monotonic() + timeout_s
        pending = list(range(len(self.urls)))
        while pending:
            for i in list(pending):
                if i < len(self._processes):
                    process, log_path = self._processes[i]
                    if process.poll() is not None:
                        where = f"; see {log_path}" if log_path else ""
                        raise EngineError(
                            f"SGLang server {self.urls[i]} exited with code {process.returncode} "
                            f"before becoming healthy{where}"
                        )
                if await self._healthy(self.urls[i]):
                    pending.remove(i)
            if not pending:
                return
            if time.monotonic() >= deadline:
                names = ", ".join(self.urls[i] for i in pending)
                raise EngineError(f"SGLang servers not healthy after {timeout_s:g}s: {names}")
            await asyncio.sleep(min(self.config.health_poll_s, max(deadline - time.monotonic(), 0)))

    async def _healthy(self, url: str) -> bool:
        assert self._session is not None
        try:
            timeout = aiohttp.ClientTimeout(total=max(self.config.health_poll_s, 1.0))
            async with self._session.get(f"{url}/health", timeout=timeout) as response:
                return response.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    async def health(self) -> bool:
        if self._session is None:
            return False
        results = await asyncio.gather(*(self._healthy(url) for url in self.urls))
        return all(results)

    async def shutdown(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        processes, self._processes = self._processes, []
        for process, _ in processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
        for process, _ in processes:
            try:
                await asyncio.to_thread(process.wait, 30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                await asyncio.to_thread(process.wait)
        if processes:
            self.urls = [u.rstrip("/") for u in self.config.urls]

    # -- HTTP ----------------------------------------------------------------------------------

    async def _post(self, url: str, payload: dict[str, Any], *, where: str) -> Any:
        """POST JSON and return the decoded answer, retrying transient failures with backoff.

        Raises:
            EngineError: Retries exhausted, a 4xx answer, or malformed JSON; names `where`.
        """
        if self._session is None:
            raise EngineError(f"{where}: the sglang engine is not started")
        cfg = self.config
        attempts = cfg.max_retries + 1
        last = ""
        for attempt in range(attempts):
            if attempt:
                delay = min(cfg.retry_backoff_s * 2 ** (attempt - 1), cfg.retry_backoff_max_s)
                logger.warning(
                    "%s: retry %d/%d in %.2fs after %s",
                    where,
                    attempt,
                    cfg.max_retries,
                    delay,
                    last,
                )
                await asyncio.sleep(delay)
            try:
                return await self._post_once(url, payload, where=where)
            except _RetryableError as exc:
                last = str(exc)
        raise EngineError(
            f"{where}: POST {url} failed after {attempts} attempts; last error: {last}"
        )

    async def _post_once(self, url: str, payload: dict[str, Any], *, where: str) -> Any:
        assert self._session is not None
        try:
            async with self._session.post(url, json=payload) as response:
                body = await response.text()
                status = response.status
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise _RetryableError(f"{type(exc).__name__}: {exc}") from None
        if status >= 500:
            raise _RetryableError(f"HTTP {status}: {body[:300]}")
        if status >= 400:
            raise EngineError(f"{where}: POST {url} answered HTTP {status}: {body[:500]}")
        try:
            return json.loads(body)
        except json.JSONDecodeError as exc:
            raise EngineError(
                f"{where}: POST {url} answered malformed JSON ({exc}): {body[:200]!r}"
            ) from None

    async def _post_each(
        self,
        path: str,
        payload: dict[str, Any] | Callable[[int], dict[str, Any]],
        *,
        what: str,
        urls: Sequence[str] | None = None,
        once: bool = False,
    ) -> list[EngineError | None]:
        """POST to every server of `urls` (default: all) at once and wait for every answer.

        A callable payload is built per server, from its index. Each must answer
        {"success": true, ...}. With `once`, each server is sent the request exactly once: for
        calls that change the server's state (a session, a rendezvous, a broadcast, a load),
        where a request that timed out may have happened and a second one would be refused,
        join twice, or wait for a broadcast that does not come again.

        Returns:
            Per server, in order: None, or the EngineError of its failure.
        """

        async def one(i: int, url: str) -> EngineError | None:
            where = f"{what} on {url}"
            body = payload(i) if callable(payload) else payload
            try:
                if once:
                    answer = await self._post_once(f"{url}{path}", body, where=where)
                else:
                    answer = await self._post(f"{url}{path}", body, where=where)
            except _RetryableError as exc:
                return EngineError(f"{where}: {exc}")
            except EngineError as exc:
                return exc
            if not isinstance(answer, dict) or not answer.get("success", False):
                message = answer.get("message") if isinstance(answer, dict) else answer
                return EngineError(f"{where} failed: {message}")
            return None

        chosen = [(i, url) for i, url in enumerate(self.urls) if urls is None or url in urls]
        return list(await asyncio.gather(*(one(i, url) for i, url in chosen)))

    async def _post_all(
        self,
        path: str,
        payload: dict[str, Any] | Callable[[int], dict[str, Any]],
        *,
        what: str,
        once: bool = False,
    ) -> None:
        """`_post_each` on every server, raising the first failure once all have answered."""
        await self.start()
        for error in await self._post_each(path, payload, what=what, once=once):
            if error is not None:
                raise error

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

    # -- generation ----------------------------------------------------------------------------

    def payload(self, request: GenerateRequest) -> dict[str, Any]:
        """The /generate JSON body of one request."""
        body: dict[str, Any] = {
            "input_ids": list(request.input_ids),
            "sampling_params": request.sampling.to_sglang(),
            "return_logprob": True,
        }
        for key, value in request.fields.items():
            if key in body:
                raise ValueError(f"{request.name}: request field {key!r} would overwrite {key}")
            body[key] = value
        return body

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateOutput]:
        await self.start()
        return list(await asyncio.gather(*(self._generate_one(r) for r in requests)))

    async def _generate_one(self, request: GenerateRequest) -> GenerateOutput:
        server = self._next % len(self.urls)
        self._next += 1
        async with self._semaphores[server]:
            answer = await self._post(
                f"{self.urls[server]}/generate", self.payload(request), where=request.name
            )
        return self.parse(request, answer)

    def parse(self, request: GenerateRequest, answer: Any) -> GenerateOutput:
        """Turn one /generate answer into a `GenerateOutput`, validating every field used.

        Raises:
            EngineError: A missing or malformed field; the message names the request.
        """
        where = request.name
        if isinstance(answer, list) and len(answer) == 1:
            answer = answer[0]
        if not isinstance(answer, dict) or not isinstance(answer.get("meta_info"), dict):
            raise EngineError(
                f"{where}: /generate answer has no meta_info object: {str(answer)[:200]}"
            )
        meta = answer["meta_info"]
        finish = meta.get("finish_reason")
        if not isinstance(finish, dict) or finish.get("type") not in _FINISH_TYPES:
            raise EngineError(
                f"{where}: meta_info.finish_reason={finish!r}; expected {{'type': one of "
                f"{', '.join(_FINISH_TYPES)}, ...}}"
            )
        entries = meta.get("output_token_logprobs")
        if entries is None and finish["type"] == "abort":
            entries = []
        if not isinstance(entries, list):
            raise EngineError(
                f"{where}: meta_info.output_token_logprobs missing or not a list (got "
                f"{type(entries).__name__}); was return_logprob sent?"
            )
        tokens, log_probs = [], []
        for i, entry in enumerate(entries):
            ok = isinstance(entry, list | tuple) and len(entry) >= 2
            lp, token = (entry[0], entry[1]) if ok else (None, None)
            ok = (
                ok
                and isinstance(lp, int | float)
                and not isinstance(lp, bool)
                and math.isfinite(lp)
            )
            ok = ok and isinstance(token, int) and not isinstance(token, bool) and token >= 0
            if not ok:
                raise EngineError(
                    f"{where}: meta_info.output_token_logprobs[{i}]={entry!r}; expected "
                    "[logprob, token_id, text]"
                )
            tokens.append(token)
            log_probs.append(float(lp))
        output_ids = answer.get("output_ids")
        if output_ids is not None and list(output_ids) != tokens:
            raise EngineError(
                f"{where}: output_ids ({len(output_ids)} tokens) disagree with "
                f"output_token_logprobs ({len(tokens)} tokens)"
            )
        if finish["type"] != "abort" and not tokens:
            raise EngineError(f"{where}: the server finished ({finish['type']}) without a token")
        experts = None
        if request.wants_routed_experts and tokens:
            experts = self._routed_experts(request, meta, len(request.input_ids) + len(tokens))
        return GenerateOutput(
            output_ids=tokens,
            output_log_probs=log_probs,
            finish_reason=finish["type"],
            meta_info=meta,
            text=answer.get("text"),
            routed_experts=experts,
        )

    def _routed_experts(
        self, request: GenerateRequest, meta: dict, num_tokens: int
    ) -> torch.Tensor:
        where = request.name
        if ROUTED_EXPERTS_KEY not in meta or meta[ROUTED_EXPERTS_KEY] is None:
            raise EngineError(
                f"{where}: routed experts were requested but meta_info has none; launch the "
                "server with --enable-return-routed-experts"
            )
        info = self._info
        if info is None or not info.topk:
            raise EngineError(
                f"{where}: cannot decode routed experts: the model's layer count and top-k are "
                "unknown (set sglang.model_path to the local model directory)"
            )
        try:
            return decode_routed_experts(
                meta[ROUTED_EXPERTS_KEY],
                num_tokens=num_tokens,
                num_layers=info.num_layers,
                topk=info.topk,
                where=where,
                wire_dtype=meta.get(ROUTED_EXPERTS_DTYPE_KEY),
            )
        except ValueError as exc:
            raise EngineError(str(exc)) from None

    # -- memory (colocated hand-off) -----------------------------------------------------------

    _released: frozenset[str] = frozenset()
    """Memory tags released on every server and not resumed yet."""

    async def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Every server frees the GPU memory of `tags` (POST /release_memory_occupation).

        sglang 0.5.23 (managers/scheduler_components/weight_updater.py) frees memory only on
        servers launched with --enable-memory-saver (others keep it, silently), and has no answer
        for a release while it is busy (an assertion), a release of released memory
        (torch_memory_saver exits) or a resume of memory it did not release (`offload_tags`
        has no such tag): its scheduler process dies. So the engine refuses those calls before
        sending them. The weights' contents are gone after a release: resume, then load weights.

        Raises:
            ValueError: A tag is not one of `MEMORY_TAGS`.
            EngineError: A tag is already released, or a server refused; names them.
        """
        wanted = memory_tags(tags)
        again = [t for t in wanted if t in self._released]
        if again:
            raise EngineError(
                f"release_memory({list(wanted)}): {again} already released; call "
                "resume_memory first"
            )
        await self._memory_call("/release_memory_occupation", wanted)
        self._released = self._released | set(wanted)

    async def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Every server takes back the GPU memory of `tags` (POST /resume_memory_occupation).

        Raises:
            ValueError: A tag is not one of `MEMORY_TAGS`.
            EngineError: A tag is not released, or a server refused; names them.
        """
        wanted = memory_tags(tags)
        held = [t for t in wanted if t not in self._released]
        if held:
            raise EngineError(
                f"resume_memory({list(wanted)}): {held} not released (released: "
                f"{sorted(self._released)})"
            )
        await self._memory_call("/resume_memory_occupation", wanted)
        self._released = self._released - set(wanted)

    async def _memory_call(self, path: str, tags: tuple[str, ...]) -> None:
        """POST `{"tags": [...]}` to `path` on every server at once, each exactly once.

        sglang 0.5.23 http_server.py answers 200 with a JSON null on success and 400
        {"error": {"message": ...}} on failure. No retry: a release that timed out may have
        happened, and a second one would fail the server.
        """
        await self.start()
        what = path.lstrip("/")

        async def one(url: str) -> str | None:
            try:
                await self._post_once(f"{url}{path}", {"tags": list(tags)}, where=what)
            except _RetryableError as exc:
                return f"{url}: {exc}"
            except EngineError as exc:
                return str(exc)
            return None

        errors = [e for e in await asyncio.gather(*(one(url) for url in self.urls)) if e]
        if errors:
            raise EngineError(f"{what} {list(tags)} failed: " + "; ".join(errors))

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
            "flush_cache": True,  # drop KV cache computed with the old weights
            "abort_all_requests": False,
            "weight_version": weight_version,
        }
        await self._post_all("/update_weights_from_disk", payload, what="update_weights_from_disk")

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
                "flush_cache": True,
                "weight_version": weight_version,
            }

        async with self._weight_update_session():
            await self._post_all(
                "/update_weights_from_tensor", payload, what="update_weights_from_tensor", once=True
            )

    # -- weights from the trainer: sessions, weight groups, buckets ------------------------------

    _session_urls: tuple[str, ...] = ()
    """The servers on which this engine's open weight-update session began."""

    @property
    def weight_group_size(self) -> int:
        """One rank per GPU: `tp_size` per server (launched ones: `num_servers` of them)."""
        servers = len(self.urls) or self.config.num_servers
        return servers * self.config.tp_size

    async def begin_weight_update(self) -> None:
        """Open a weight-update session on every server (POST /begin_weight_update).

        sglang 0.5.23 (scheduler_components/weight_updater.py) takes tensor and distributed
        updates only inside one, and refuses a begin while one is open. If a server refuses,
        the sessions opened on the others are closed again.

        Raises:
            EngineError: This engine has a session open already, or a server refused.
        """
        await self.start()
        if self._session_urls:
            raise EngineError(
                "begin_weight_update: this engine's weight-update session is open already; "
                "call end_weight_update() first"
            )
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
        """Close the session `begin_weight_update` opened, on every server it opened on.

        Raises:
            EngineError: No session is open, or a server refused (after all were asked).
        """
        opened, self._session_urls = self._session_urls, ()
        if not opened:
            raise EngineError(
                "end_weight_update: no weight-update session is open; call "
                "begin_weight_update() first"
            )
        ended = await self._post_each(
            "/end_weight_update", {}, what="end_weight_update", urls=opened, once=True
        )
        for error in ended:
            if error is not None:
                raise error

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
            "flush_cache": flush_cache,
            "abort_all_requests": False,
            "weight_version": weight_version,
        }
        await self._post_all(
            "/update_weights_from_distributed",
            payload,
            what="update_weights_from_distributed",
            once=True,
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
                "flush_cache": flush_cache,
                "weight_version": weight_version,
            }

        await self._post_all(
            "/update_weights_from_tensor", payload, what="update_weights_from_tensor", once=True
        )


ENGINES.add("sglang", SGLangEngine)
