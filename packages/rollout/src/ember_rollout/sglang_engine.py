"""The `sglang` engine: rollouts from SGLang servers it launches or attaches to, over HTTP.

Launching, health and stopping live in `sglang_launch`, weight updates in `sglang_weights`; this
module holds the engine itself: HTTP with retries, generation and its parsing, memory release.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import aiohttp
import torch

from ember_rollout.config import SGLangEngineConfig
from ember_rollout.engine import (
    ENGINES,
    Engine,
    EngineError,
    GenerateOutput,
    GenerateRequest,
    ModelInfo,
    memory_tags,
)
from ember_rollout.routing import (
    ROUTED_EXPERTS_DTYPE_KEY,
    ROUTED_EXPERTS_KEY,
    decode_routed_experts,
)
from ember_rollout.sglang_launch import LaunchedServer, ServerLauncher, model_info_from_dir
from ember_rollout.sglang_weights import WeightUpdates

if TYPE_CHECKING:
    from ember_core.plugins import EmberPlugins
    from ember_core.quant import QuantSpec
    from ember_rollout.config import EngineConfig

logger = logging.getLogger(__name__)

_FINISH_TYPES = ("stop", "length", "abort")


class _RetryableError(Exception):
    """A failure worth retrying: the connection broke, timed out, or the server answered 5xx."""


class SGLangEngine(ServerLauncher, WeightUpdates, Engine):
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
        quantization: QuantSpec | None = None,
    ) -> None:
        """Create the engine; `start()` launches or attaches.

        Args:
            config: Engine settings.
            extra_server_args: Added to launched servers' command lines (plugins' arguments).
            model_info: The served model's shape; by default read from model_path/config.json.
            quantization: The scheme the servers serve (`engine.quantization`): launched ones
                start from a checkpoint of it (`ServerLauncher.server_command`).
        """
        self.config = config or SGLangEngineConfig()
        self.extra_server_args = list(extra_server_args)
        self.quantization = quantization
        self._info = model_info or model_info_from_dir(self.config.model_path)
        self.urls: list[str] = [u.rstrip("/") for u in self.config.urls]
        self._servers: list[LaunchedServer] = []
        self._http: aiohttp.ClientSession | None = None
        self._semaphores: list[asyncio.Semaphore] = []
        self._next = 0

    @classmethod
    def from_config(
        cls, config: EngineConfig, *, plugins: EmberPlugins | None = None
    ) -> SGLangEngine:
        extra = plugins.rollout_server_args(cls.kind) if plugins is not None else []
        return cls(config.sglang, extra_server_args=extra, quantization=config.quant_spec())

    @property
    def model_info(self) -> ModelInfo | None:
        return self._info

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        if self._http is not None:
            return
        if not self.urls:
            self._launch()
        # aiohttp 3.14 connector.py: a TCPConnector holds at most 100 connections by default, and
        # client.py starts the `total` timer before waiting for one. Unlimited here, so a request
        # our per-server semaphore admits is sent at once and its timeout starts with it.
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_s)
        self._http = aiohttp.ClientSession(connector=connector, timeout=timeout)
        self._semaphores = [asyncio.Semaphore(self.config.max_concurrency) for _ in self.urls]
        try:
            await self.wait_healthy(self.config.launch_timeout_s)
            await self.check_no_radix_cache()
        except BaseException:
            await self.shutdown()
            raise

    async def shutdown(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None
        await self._stop_servers()

    # -- HTTP ----------------------------------------------------------------------------------

    async def _post(
        self, url: str, payload: dict[str, Any], *, where: str, abort_url: str | None = None
    ) -> Any:
        """POST JSON and return the decoded answer, retrying transient failures with backoff.

        With `abort_url` (a /generate), each attempt carries a request id of its own, and an
        attempt that broke or timed out is aborted on the server by that id: the server goes on
        generating for a client that left otherwise, and sglang 0.5.23 then refuses weight
        updates that flush the cache ("requests are still running or queued",
        scheduler_components/weight_updater.py 124-132).

        Raises:
            EngineError: Retries exhausted, a 4xx answer, or malformed JSON; names `where`.
        """
        if self._http is None:
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
            if abort_url is not None:
                payload = {**payload, "rid": uuid.uuid4().hex}
            try:
                return await self._post_once(url, payload, where=where)
            except _RetryableError as exc:
                last = str(exc)
                if abort_url is not None:
                    await self._abort(abort_url, payload["rid"], where=where)
        raise EngineError(
            f"{where}: POST {url} failed after {attempts} attempts; last error: {last}"
        )

    async def _abort(self, url: str, rid: str, *, where: str) -> None:
        """Ask the server at `url` to drop request `rid` (POST /abort_request, which sglang
        0.5.23 answers 200 with an empty body); a failure is logged, as the request it was for
        has failed already."""
        assert self._http is not None
        try:
            async with self._http.post(f"{url}/abort_request", json={"rid": rid}) as response:
                if response.status == 200:
                    return
                problem = f"HTTP {response.status}: {(await response.text())[:200]}"
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
        logger.warning("%s: could not abort request %s on %s: %s", where, rid, url, problem)

    async def _post_once(self, url: str, payload: dict[str, Any], *, where: str) -> Any:
        assert self._http is not None
        try:
            async with self._http.post(url, json=payload) as response:
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
        if not self.partial_rollouts:  # under partial rollouts the servers stay paused instead
            self._refuse_unversioned("generate")
        return list(await asyncio.gather(*(self._generate_one(r) for r in requests)))

    async def _generate_one(self, request: GenerateRequest) -> GenerateOutput:
        server = self._next % len(self.urls)
        self._next += 1
        async with self._semaphores[server]:
            url = self.urls[server]
            answer = await self._post(
                f"{url}/generate", self.payload(request), where=request.name, abort_url=url
            )
        return self.parse(request, answer)

    async def prompt_log_probs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Per server (in `urls` order), per sequence, the input log-probs of one /generate
        that returns them from position 0 (`logprob_start_len` 0; sglang 0.5.23 takes them from
        the prefill's logits, before any temperature), flattened: a function of the weights
        each server serves.

        Raises:
            EngineError: An answer without `meta_info.input_token_logprobs` of the right length.
        """
        await self.start()
        out = []
        for url in self.urls:
            figures: list[float] = []
            for i, tokens in enumerate(sequences):
                where = f"prompt log-probs of sequence {i}"
                payload = {
                    "input_ids": list(tokens),
                    "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                    "return_logprob": True,
                    "logprob_start_len": 0,
                }
                answer = await self._post(f"{url}/generate", payload, where=where, abort_url=url)
                if isinstance(answer, list) and len(answer) == 1:
                    answer = answer[0]
                entries = (answer.get("meta_info") or {}).get("input_token_logprobs")
                if not isinstance(entries, list) or len(entries) != len(tokens):
                    raise EngineError(
                        f"{where}: meta_info.input_token_logprobs is not one entry per input "
                        f"token ({len(tokens)}): {str(entries)[:200]}"
                    )
                figures += [float(e[0]) for e in entries[1:]]  # the first token has none
            out.append(figures)
        return out

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


ENGINES.add("sglang", SGLangEngine)
