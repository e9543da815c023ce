"""A fake SGLang server for the sglang engine's tests: sglang 0.5.23's wire formats and rules.

/generate and /health answer like SGLang. The weight endpoints enforce what the real server
enforces: request fields typed as in sglang's managers/io_struct.py (a missing or mistyped field
is a 422, as FastAPI answers), tensor updates only inside a begin/end_weight_update session
(scheduler_components/weight_updater.py; begin while open and end while closed are refused),
one serialization per TP rank, and tensor pickles limited to the globals of sglang's
`SafeUnpickler` (utils/common.py). Fields SGLang would silently ignore are collected in
`ignored_fields`, so a test can insist that every field sent means something.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import io
import pickle
from collections.abc import Awaitable, Callable

import torch
from aiohttp import web

from ember_rollout.config import SGLangEngineConfig
from ember_rollout.engine import GenerateRequest, ModelInfo, SamplingParams
from ember_rollout.routing import encode_routed_experts
from ember_rollout.sglang_engine import SGLangEngine

INFO = ModelInfo(
    num_layers=2, topk=2, num_experts=4, moe_layers=(0, 1), vocab_size=50, context_len=64
)

NONE = type(None)
SELECTORS = ("target", "draft", "all")
BASE_FIELDS = {"rid": (str, NONE), "http_worker_ipc": (str, NONE)}
DISK_FIELDS = {
    **BASE_FIELDS,
    "model_path": (str,),
    "load_format": (str, NONE),
    "abort_all_requests": (bool,),
    "weight_version": (str, NONE),
    "is_async": (bool,),
    "torch_empty_cache": (bool,),
    "keep_pause": (bool,),
    "recapture_cuda_graph": (bool,),
    "token_step": (int,),
    "flush_cache": (bool,),
    "manifest": (dict, NONE),
}
TENSOR_FIELDS = {
    **BASE_FIELDS,
    "serialized_named_tensors": (list,),
    "load_format": (str, NONE),
    "flush_cache": (bool,),
    "abort_all_requests": (bool,),
    "weight_version": (str, NONE),
    "selector": SELECTORS,
    "torch_empty_cache": (bool,),
}
BEGIN_FIELDS = {**BASE_FIELDS, "selector": SELECTORS}
END_FIELDS = dict(BASE_FIELDS)
REQUIRED = {
    "/update_weights_from_disk": {"model_path"},
    "/update_weights_from_tensor": {"serialized_named_tensors"},
}

ALREADY_OPEN = "a weight-update session is already open; call end_weight_update() first"
NOT_OPEN = "no weight-update session is open; call begin_weight_update() first"
OUTSIDE = (
    "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
)

SAFE_GLOBALS = {
    ("builtins", name) for name in ("bool", "bytes", "dict", "float", "int", "list", "str", "tuple")
} | {
    ("copyreg", "__newobj__"),
    ("multiprocessing.resource_sharer", "DupFd"),
    ("torch", "Size"),
    ("torch", "Tensor"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch.nn.parameter", "Parameter"),
    ("torch.storage", "TypedStorage"),
    ("torch.storage", "UntypedStorage"),
    *(
        ("torch.multiprocessing.reductions", name)
        for name in (
            "rebuild_tensor",
            "rebuild_cuda_tensor",
            "rebuild_typed_storage",
            "rebuild_storage_fd",
            "rebuild_storage_filename",
            "rebuild_storage_empty",
        )
    ),
}
"""The globals of sglang's SafeUnpickler that tensors and their containers need."""


class SafeUnpickler(pickle.Unpickler):
    """Refuses every global outside `SAFE_GLOBALS` (and the torch dtypes), as SGLang does."""

    def find_class(self, module, name):
        if (module, name) in SAFE_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise RuntimeError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")


def sglang_answer(body, *, finish="length", experts_rows=None):
    """What SGLang's /generate returns for `body`: tokens 10, 11, ... with log-probs -0.5, ..."""
    n = body["sampling_params"]["max_new_tokens"]
    tokens = [10 + i for i in range(n)]
    meta = {
        "id": "5f1c",
        "finish_reason": {"type": "length", "length": n}
        if finish == "length"
        else {"type": "stop", "matched": tokens[-1]},
        "prompt_tokens": len(body["input_ids"]),
        "weight_version": "default",
        "output_token_logprobs": [[-0.5 - 0.1 * i, t, None] for i, t in enumerate(tokens)],
        "completion_tokens": n,
        "cached_tokens": 0,
        "e2e_latency": 0.01,
    }
    if body.get("return_routed_experts"):
        rows = len(body["input_ids"]) + n - 1 if experts_rows is None else experts_rows
        experts = torch.arange(rows * 4, dtype=torch.int32).reshape(rows, 2, 2) % 4
        meta["routed_experts"] = encode_routed_experts(experts)
    return {
        "text": "".join(chr(97 + t % 26) for t in tokens),
        "output_ids": tokens,
        "meta_info": meta,
    }


def failure(message: str, status: int = 400, **extra) -> web.Response:
    """SGLang's answer to a refused or failed weight operation."""
    return web.json_response({"success": False, "message": message, **extra}, status=status)


class FakeSGLang:
    """aiohttp servers on 127.0.0.1 with scripted answers; records every request.

    One instance can serve several servers (`running()` once per server); each server keeps
    its own weight-update session. `hold(fake)` is awaited inside every /generate before its
    answer; `in_flight` and `peak` count the /generate requests being served at once.
    """

    def __init__(
        self,
        respond=None,
        *,
        healthy: bool = True,
        hold: Callable[[FakeSGLang], Awaitable[None]] | None = None,
        tp_size: int = 1,
        fail_tensor_updates_on: tuple[int, ...] = (),
    ):
        self.bodies: list[dict] = []
        self.respond = respond or (lambda body, hit: web.json_response(sglang_answer(body)))
        self.healthy = healthy
        self.hold = hold
        self.in_flight = 0
        self.peak = 0
        self.tp_size = tp_size
        self.fail_tensor_updates_on = fail_tensor_updates_on
        self.ports: list[int] = []
        self.open_sessions: set[int] = set()
        self.weight_calls: list[tuple[int, str, dict]] = []
        """(server index, path, body) of every weight request that passed validation."""
        self.ignored_fields: set[str] = set()

    async def _generate(self, request):
        body = await request.json()
        self.bodies.append(body)
        hit = len(self.bodies)
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            if self.hold is not None:
                await self.hold(self)
            return self.respond(body, hit)
        finally:
            self.in_flight -= 1

    async def _health(self, request):
        return web.Response(status=200 if self.healthy else 503)

    def _validate(self, path: str, body, fields: dict) -> web.Response | None:
        """FastAPI's 422 for a body that does not fit the request struct, else None."""
        if not isinstance(body, dict):
            return web.json_response(
                {"detail": [{"type": "dict_type", "loc": ["body"]}]}, status=422
            )
        errors = [
            {"type": "missing", "loc": ["body", key], "msg": "Field required"}
            for key in sorted(REQUIRED.get(path, set()) - set(body))
        ]
        for key, value in body.items():
            allowed = fields.get(key)
            if allowed is None:
                self.ignored_fields.add(f"{path}:{key}")
            elif all(isinstance(a, type) for a in allowed):
                if not isinstance(value, allowed) or (
                    bool not in allowed and isinstance(value, bool)
                ):
                    errors.append({"type": "type_error", "loc": ["body", key], "input": value})
            elif value not in allowed:
                errors.append({"type": "literal_error", "loc": ["body", key], "input": value})
        return web.json_response({"detail": errors}, status=422) if errors else None

    async def _weights(self, request):
        path = request.path
        server = self.ports.index(request.url.port)
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"detail": [{"type": "json_invalid"}]}, status=422)
        fields = {
            "/update_weights_from_disk": DISK_FIELDS,
            "/update_weights_from_tensor": TENSOR_FIELDS,
            "/begin_weight_update": BEGIN_FIELDS,
            "/end_weight_update": END_FIELDS,
        }[path]
        invalid = self._validate(path, body, fields)
        if invalid is not None:
            return invalid
        self.weight_calls.append((server, path, body))
        if path == "/begin_weight_update":
            if server in self.open_sessions:
                return failure(ALREADY_OPEN)
            self.open_sessions.add(server)
            return web.json_response({"success": True, "message": "Success"})
        if path == "/end_weight_update":
            if server not in self.open_sessions:
                return failure(NOT_OPEN)
            self.open_sessions.remove(server)
            return web.json_response({"success": True, "message": "Success"})
        if path == "/update_weights_from_disk":
            if body["model_path"] == "/missing":
                return failure(
                    "Failed to get weights iterator: no such checkpoint.",
                    400,
                    num_paused_requests=0,
                )
            message = "Succeeded to update model weights."
            return web.json_response(
                {"success": True, "message": message, "num_paused_requests": 0}
            )
        if server not in self.open_sessions:
            return failure(OUTSIDE)
        return self._tensor_update(server, body)

    def _tensor_update(self, server: int, body: dict) -> web.Response:
        entries = body["serialized_named_tensors"]
        if len(entries) < self.tp_size:
            return failure(
                f"list index out of range: {len(entries)} payloads, tp_size {self.tp_size}"
            )
        decoded = []
        for entry in entries:  # every TP rank opens its own payload
            try:
                raw = base64.b64decode(entry, validate=True)
                decoded.append(SafeUnpickler(io.BytesIO(raw)).load())
            except (TypeError, binascii.Error, RuntimeError, pickle.UnpicklingError) as exc:
                return failure(f"{type(exc).__name__}: {exc}")
        body["decoded"] = decoded
        if server in self.fail_tensor_updates_on:
            return failure("Failed to update weights: unknown parameter 'bogus.weight'")
        message = "Success"
        if body.get("weight_version") is not None:
            message += f" Weight version updated to {body['weight_version']}."
        return web.json_response({"success": True, "message": message})

    @contextlib.asynccontextmanager
    async def running(self):
        app = web.Application()
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/health", self._health)
        for path in (
            "/update_weights_from_disk",
            "/update_weights_from_tensor",
            "/begin_weight_update",
            "/end_weight_update",
        ):
            app.router.add_post(path, self._weights)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.ports.append(port)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            await runner.cleanup()


def engine_for(urls, **kw):
    config = SGLangEngineConfig(
        urls=list(urls),
        launch_timeout_s=kw.pop("launch_timeout_s", 5.0),
        health_poll_s=0.05,
        max_retries=kw.pop("max_retries", 2),
        retry_backoff_s=0.01,
        retry_backoff_max_s=0.02,
        request_timeout_s=kw.pop("request_timeout_s", 5.0),
        **kw,
    )
    return SGLangEngine(config, model_info=INFO)


def request(i=0, n=3, routed=False):
    return GenerateRequest(
        input_ids=[1, 2, 3],
        sampling=SamplingParams(max_new_tokens=n, temperature=0.7, top_p=0.9, top_k=20),
        fields={"return_routed_experts": True} if routed else {},
        name=f"sample {i} (group 0)",
    )


def run(fake, body, *, n_servers=1, **kw):
    """Start `n_servers` servers of `fake`, attach an engine, and run `body(engine)`."""

    async def main():
        async with contextlib.AsyncExitStack() as stack:
            urls = [await stack.enter_async_context(fake.running()) for _ in range(n_servers)]
            engine = engine_for(urls, **kw)
            try:
                await engine.start()
                return await body(engine)
            finally:
                await engine.shutdown()

    return asyncio.run(main())
