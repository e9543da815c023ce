"""The sglang engine against local fake servers speaking SGLang's /generate and /health formats."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import pickle
import sys
import textwrap

import pytest
import torch
from aiohttp import web

from ember_core import hookimpl
from ember_core.plugins import EmberPlugins
from ember_core.types import SampleStatus
from ember_rollout.config import EngineConfig, SGLangEngineConfig
from ember_rollout.engine import (
    EngineError,
    GenerateRequest,
    ModelInfo,
    SamplingParams,
    build_engine,
)
from ember_rollout.routing import encode_routed_experts
from ember_rollout.sglang_engine import SGLangEngine, free_port

INFO = ModelInfo(
    num_layers=2, topk=2, num_experts=4, moe_layers=(0, 1), vocab_size=50, context_len=64
)


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


class FakeSGLang:
    """An aiohttp server on 127.0.0.1 with scripted answers; records every request body."""

    def __init__(self, respond=None, *, healthy=True):
        self.bodies: list[dict] = []
        self.respond = respond or (lambda body, hit: web.json_response(sglang_answer(body)))
        self.healthy = healthy
        self.weight_updates: list[tuple[str, dict]] = []

    async def _generate(self, request):
        body = await request.json()
        self.bodies.append(body)
        return self.respond(body, len(self.bodies))

    async def _health(self, request):
        return web.Response(status=200 if self.healthy else 503)

    async def _update(self, request):
        body = await request.json()
        self.weight_updates.append((request.path, body))
        if request.path == "/update_weights_from_tensor":
            blob = base64.b64decode(body["serialized_named_tensors"][0])
            body["decoded"] = pickle.loads(blob)
        ok = body.get("model_path") != "/missing"
        message = "Succeeded to update model weights." if ok else "no such checkpoint"
        return web.json_response(
            {"success": ok, "message": message, "num_paused_requests": 0}, status=200 if ok else 400
        )

    @contextlib.asynccontextmanager
    async def running(self):
        app = web.Application()
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_post("/update_weights_from_disk", self._update)
        app.router.add_post("/update_weights_from_tensor", self._update)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
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
        request_timeout_s=5.0,
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
    """Start `n_servers` copies of `fake`, attach an engine, and run `body(engine)`."""

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


def test_payload_fields_and_parsing():
    fake = FakeSGLang()

    async def body(engine):
        return await engine.generate([request(0, n=3, routed=True)])

    (out,) = run(fake, body)
    sent = fake.bodies[0]
    assert sent == {
        "input_ids": [1, 2, 3],
        "sampling_params": {
            "max_new_tokens": 3,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 20,
            "ignore_eos": False,
        },
        "return_logprob": True,
        "return_routed_experts": True,
    }
    assert out.output_ids == [10, 11, 12]
    assert out.output_log_probs == pytest.approx([-0.5, -0.6, -0.7])
    assert out.finish_reason == "length" and out.status == SampleStatus.TRUNCATED
    assert out.text == "klm" and out.meta_info["weight_version"] == "default"
    expected = torch.arange(5 * 4, dtype=torch.int32).reshape(5, 2, 2) % 4
    assert torch.equal(out.routed_experts, expected)


def test_stop_reason_and_round_robin_over_servers():
    fake = FakeSGLang(lambda b, hit: web.json_response(sglang_answer(b, finish="stop")))

    async def body(engine):
        return engine.urls, await engine.generate([request(i) for i in range(4)])

    urls, outs = run(fake, body, n_servers=2)
    assert len(set(urls)) == 2 and len(fake.bodies) == 4
    assert all(o.finish_reason == "stop" and o.status == SampleStatus.COMPLETED for o in outs)


def test_http_500_is_retried_with_backoff_then_succeeds():
    def respond(body, hit):
        if hit <= 2:
            return web.Response(status=500, text="internal error")
        return web.json_response(sglang_answer(body))

    fake = FakeSGLang(respond)
    (out,) = run(fake, lambda e: e.generate([request(1)]), max_retries=2)
    assert len(fake.bodies) == 3 and out.output_ids == [10, 11, 12]


def test_retries_are_bounded_and_the_error_names_the_sample():
    fake = FakeSGLang(lambda body, hit: web.Response(status=503, text="overloaded"))
    with pytest.raises(
        EngineError, match=r"sample 7 \(group 0\): POST .* failed after 3 attempts.*503"
    ):
        run(fake, lambda e: e.generate([request(7)]), max_retries=2)
    assert len(fake.bodies) == 3


def test_client_error_is_not_retried():
    fake = FakeSGLang(lambda b, hit: web.json_response({"error": {"message": "bad"}}, status=400))
    with pytest.raises(EngineError, match=r"sample 2 \(group 0\): .*HTTP 400.*bad"):
        run(fake, lambda e: e.generate([request(2)]))
    assert len(fake.bodies) == 1


def test_malformed_json_names_the_sample():
    fake = FakeSGLang(
        lambda b, hit: web.Response(text='{"meta_info": {', content_type="application/json")
    )
    with pytest.raises(EngineError, match=r"sample 3 \(group 0\): .*malformed JSON"):
        run(fake, lambda e: e.generate([request(3)]))


@pytest.mark.parametrize(
    ("meta_patch", "message"),
    [
        ({"finish_reason": "length"}, "finish_reason='length'"),
        ({"output_token_logprobs": None}, "output_token_logprobs missing"),
        ({"output_token_logprobs": [[-0.1, "x", None]]}, r"output_token_logprobs\[0\]"),
        ({"output_token_logprobs": [[float("nan"), 3, None]]}, r"output_token_logprobs\[0\]"),
    ],
)
def test_malformed_fields_name_the_sample(meta_patch, message):
    def respond(body, hit):
        answer = sglang_answer(body)
        answer["meta_info"].update(meta_patch)
        answer.pop("output_ids")
        return web.Response(text=json.dumps(answer), content_type="application/json")

    with pytest.raises(EngineError, match=rf"sample 4 \(group 0\): .*{message}"):
        run(FakeSGLang(respond), lambda e: e.generate([request(4)]))


def test_output_ids_disagreeing_with_logprobs_is_an_error():
    def respond(body, hit):
        answer = sglang_answer(body)
        answer["output_ids"] = [1, 2]
        return web.json_response(answer)

    with pytest.raises(EngineError, match="output_ids .* disagree"):
        run(FakeSGLang(respond), lambda e: e.generate([request(0)]))


def test_routed_experts_of_the_wrong_size_name_the_sample():
    fake = FakeSGLang(lambda b, hit: web.json_response(sglang_answer(b, experts_rows=3)))
    with pytest.raises(EngineError, match=r"sample 5 \(group 0\): routed experts hold 12 ids"):
        run(fake, lambda e: e.generate([request(5, routed=True)]))


def test_missing_routed_experts_points_at_the_server_flag():
    def respond(body, hit):
        body = dict(body, return_routed_experts=False)
        return web.json_response(sglang_answer(body))

    with pytest.raises(EngineError, match="--enable-return-routed-experts"):
        run(FakeSGLang(respond), lambda e: e.generate([request(6, routed=True)]))


def test_abort_without_tokens_is_reported_as_abort():
    def respond(body, hit):
        meta = {
            "id": "x",
            "finish_reason": {
                "type": "abort",
                "message": "aborted",
                "status_code": 503,
                "err_type": None,
            },
        }
        return web.json_response({"text": "", "output_ids": [], "meta_info": meta})

    (out,) = run(FakeSGLang(respond), lambda e: e.generate([request(0)]))
    assert (
        out.finish_reason == "abort" and out.output_ids == [] and out.status == SampleStatus.ABORTED
    )


def test_server_down_fails_health_wait_with_timeout():
    port = free_port()
    engine = engine_for([f"http://127.0.0.1:{port}"], launch_timeout_s=0.3)
    with pytest.raises(EngineError, match=rf"not healthy after 0.3s: http://127.0.0.1:{port}"):
        asyncio.run(engine.start())


def test_server_going_down_mid_run_exhausts_bounded_retries():
    fake = FakeSGLang()

    async def main():
        async with fake.running() as url:
            engine = engine_for([url], max_retries=1)
            await engine.start()
        try:  # the server is gone now
            assert not await engine.health()
            with pytest.raises(
                EngineError, match=r"sample 8 \(group 0\): .*after 2 attempts.*Connect"
            ):
                await engine.generate([request(8)])
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_weight_updates_reach_every_server():
    fake = FakeSGLang()

    async def body(engine):
        await engine.update_weights_from_disk("/ckpt/iter_3", weight_version="3")
        tensors = [("model.embed_tokens.weight", torch.arange(6.0).reshape(2, 3))]
        await engine.update_weights_from_tensors(tensors, weight_version="4")
        with pytest.raises(
            EngineError, match="update_weights_from_disk on .*HTTP 400.*no such checkpoint"
        ):
            await engine.update_weights_from_disk("/missing")

    run(fake, body, n_servers=2)
    disk = [b for p, b in fake.weight_updates if p == "/update_weights_from_disk"]
    assert disk[:2] == [{"model_path": "/ckpt/iter_3", "weight_version": "3"}] * 2
    tensor = [b for p, b in fake.weight_updates if p == "/update_weights_from_tensor"]
    assert len(tensor) == 2 and tensor[0]["weight_version"] == "4"
    assert tensor[0]["flush_cache"] is True and tensor[0]["load_format"] is None
    ((name, value),) = tensor[0]["decoded"]
    assert name == "model.embed_tokens.weight"
    assert torch.equal(value, torch.arange(6.0).reshape(2, 3))


# --------------------------------------------------------------------------------------------
# Launching servers: a fake `sglang.launch_server` module on PYTHONPATH
# --------------------------------------------------------------------------------------------

FAKE_LAUNCH_SERVER = textwrap.dedent(
    """
    import argparse, http.server, json, os, sys
    if os.environ.get("FAKE_SGLANG_EXIT"):
        sys.exit(int(os.environ["FAKE_SGLANG_EXIT"]))
    parser = argparse.ArgumentParser()
    parser.add_argument("--host"); parser.add_argument("--port", type=int)
    args, _ = parser.parse_known_args()
    with open(os.environ["FAKE_SGLANG_ARGV"], "a") as f:
        f.write(json.dumps(sys.argv[1:]) + "\\n")

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            ids = [7] * body["sampling_params"]["max_new_tokens"]
            meta = {"finish_reason": {"type": "length", "length": len(ids)},
                    "output_token_logprobs": [[-1.0, t, None] for t in ids]}
            data = json.dumps({"text": "", "output_ids": ids, "meta_info": meta}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    http.server.HTTPServer((args.host, args.port), Handler).serve_forever()
    """
)


class _ServerArgsPlugin:
    @hookimpl
    def ember_rollout_server_args(self, engine):
        return ["--enable-return-routed-experts"] if engine == "sglang" else []


@pytest.fixture
def fake_sglang_package(tmp_path, monkeypatch):
    package = tmp_path / "site" / "sglang"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "launch_server.py").write_text(FAKE_LAUNCH_SERVER)
    argv_file = tmp_path / "argv.jsonl"
    path = os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path)
    monkeypatch.setenv("FAKE_SGLANG_ARGV", str(argv_file))
    return argv_file


def launch_config(tmp_path, **kw):
    return EngineConfig(
        kind="sglang",
        sglang=SGLangEngineConfig(
            model_path=str(tmp_path),
            num_servers=2,
            server_args=["--log-level", "warning"],
            launch_timeout_s=30.0,
            health_poll_s=0.05,
            python=sys.executable,
            log_dir=str(tmp_path / "logs"),
            **kw,
        ),
    )


def test_launches_servers_on_free_loopback_ports_with_plugin_args(tmp_path, fake_sglang_package):
    plugins = EmberPlugins()
    plugins.register(_ServerArgsPlugin(), "server_args")
    engine = build_engine(launch_config(tmp_path), plugins=plugins)

    async def main():
        async with engine:
            outs = await engine.generate([request(0, n=2), request(1, n=2)])
            processes = [p for p, _ in engine._processes]
            return engine.urls, outs, processes

    urls, outs, processes = asyncio.run(main())
    assert [o.output_ids for o in outs] == [[7, 7], [7, 7]]
    assert all(p.poll() is not None for p in processes), "shutdown stops launched servers"
    assert len(set(urls)) == 2 and all(u.startswith("http://127.0.0.1:") for u in urls)
    argvs = [json.loads(line) for line in fake_sglang_package.read_text().splitlines()]
    for argv, url in zip(
        sorted(argvs, key=lambda a: a[a.index("--port") + 1]),
        sorted(urls, key=lambda u: u.rsplit(":", 1)[1]),
        strict=True,
    ):
        assert argv[argv.index("--model-path") + 1] == str(tmp_path)
        assert argv[argv.index("--host") + 1] == "127.0.0.1"
        assert url.endswith(":" + argv[argv.index("--port") + 1])
        assert argv[-3:] == ["--log-level", "warning", "--enable-return-routed-experts"]


def test_server_exiting_during_startup_is_reported(tmp_path, fake_sglang_package, monkeypatch):
    monkeypatch.setenv("FAKE_SGLANG_EXIT", "3")
    engine = build_engine(launch_config(tmp_path))
    with pytest.raises(
        EngineError, match=r"exited with code 3 before becoming healthy; see .*logs"
    ):
        asyncio.run(engine.start())
    assert engine._processes == []


def test_model_info_read_from_the_model_directory(tmp_path):
    config = {
        "num_hidden_layers": 4,
        "num_experts_per_tok": 2,
        "num_experts": 8,
        "mlp_only_layers": [1],
        "vocab_size": 17,
        "max_position_embeddings": 512,
        "eos_token_id": 0,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    engine = SGLangEngine(SGLangEngineConfig(model_path=str(tmp_path)))
    assert engine.model_info == ModelInfo(
        num_layers=4,
        topk=2,
        num_experts=8,
        moe_layers=(0, 2, 3),
        vocab_size=17,
        context_len=512,
        eos_token_ids=(0,),
    )
