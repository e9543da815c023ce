"""The sglang engine against local fake servers speaking SGLang's /generate and /health formats."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import sys
import textwrap

import pytest
import torch
from aiohttp import web
from sglang_fake import FakeSGLang, engine_for, request, run, sglang_answer

from ember_core import hookimpl
from ember_core.plugins import EmberPlugins
from ember_core.types import SampleStatus
from ember_rollout.config import EngineConfig, SGLangEngineConfig
from ember_rollout.engine import EngineError, ModelInfo, build_engine
from ember_rollout.sglang_engine import SGLangEngine
from ember_rollout.sglang_launch import free_port


def test_payload_fields_and_parsing():
    fake = FakeSGLang()

    async def body(engine):
        return await engine.generate([request(0, n=3, routed=True)])

    (out,) = run(fake, body)
    sent = dict(fake.bodies[0])
    assert len(sent.pop("rid")) == 32, "a request id of its own, to abort it by"
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
    # Each failed attempt is aborted on the server by its own id; the retry gets a new one.
    rids = [body["rid"] for body in fake.bodies]
    assert fake.aborted == rids[:2] and len(set(rids)) == 3


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
    with pytest.raises(
        EngineError,
        match=rf"not healthy after 0.3s \(engine.sglang.launch_timeout_s\): http://127.0.0.1:{port}",
    ):
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


# --------------------------------------------------------------------------------------------
# Concurrency and timeouts
# --------------------------------------------------------------------------------------------


def test_every_admitted_request_reaches_the_servers_at_once():
    """2 servers x max_concurrency 80: all 160 requests are in flight together (aiohttp's
    default connector would hold them to 100)."""
    total = 160
    everyone_arrived = asyncio.Event()

    async def hold(fake):
        if fake.in_flight == total:
            everyone_arrived.set()
        # released by the last arrival; the timeout only ends a failing run
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(everyone_arrived.wait(), 3.0)

    fake = FakeSGLang(hold=hold)

    async def body(engine):
        return await engine.generate([request(i, n=1) for i in range(total)])

    outs = run(fake, body, n_servers=2, max_concurrency=80, request_timeout_s=30.0)
    assert fake.peak == total
    assert len(outs) == total and all(o.output_ids == [10] for o in outs)


def test_time_queued_behind_max_concurrency_does_not_count_toward_the_timeout():
    """6 requests of 0.3 s each through one slot: the last waits 1.5 s, sent, it takes 0.3 s."""

    async def hold(fake):
        await asyncio.sleep(0.3)

    fake = FakeSGLang(hold=hold)

    async def body(engine):
        return await engine.generate([request(i, n=1) for i in range(6)])

    outs = run(fake, body, max_concurrency=1, request_timeout_s=1.0, max_retries=0)
    assert len(outs) == 6 and fake.peak == 1 and len(fake.bodies) == 6


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
    """Two servers of the fake package above, placed as on GPUs unless `device` says otherwise."""
    kw.setdefault("device", "cuda")
    kw.setdefault("num_servers", 2)
    return EngineConfig(
        kind="sglang",
        sglang=SGLangEngineConfig(
            model_path=str(tmp_path),
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
    engine = build_engine(launch_config(tmp_path, tp_size=2, base_gpu_id=1), plugins=plugins)

    async def main():
        async with engine:
            outs = await engine.generate([request(0, n=2), request(1, n=2)])
            processes = [s.process for s in engine._servers]
            return engine.urls, outs, processes

    urls, outs, processes = asyncio.run(main())
    assert [o.output_ids for o in outs] == [[7, 7], [7, 7]]
    assert all(p.poll() is not None for p in processes), "shutdown stops launched servers"
    assert len(set(urls)) == 2 and all(u.startswith("http://127.0.0.1:") for u in urls)
    argvs = [json.loads(line) for line in fake_sglang_package.read_text().splitlines()]
    by_port = {argv[argv.index("--port") + 1]: argv for argv in argvs}
    assert len(by_port) == 2
    gpus = []
    for url in urls:  # in server order
        argv = by_port[url.rsplit(":", 1)[1]]
        assert argv[argv.index("--model-path") + 1] == str(tmp_path)
        assert argv[argv.index("--host") + 1] == "127.0.0.1"
        assert argv[-3:] == ["--log-level", "warning", "--enable-return-routed-experts"]
        # SGLang puts TP rank r on GPU --base-gpu-id + r: server i owns GPUs 1 + 2i, 2 + 2i
        assert argv.count("--base-gpu-id") == 1 and "--gpu-id-step" not in argv
        base = int(argv[argv.index("--base-gpu-id") + 1])
        tp = int(argv[argv.index("--tp-size") + 1])
        gpus.append(list(range(base, base + tp)))
    assert gpus == [[1, 2], [3, 4]]


@pytest.mark.parametrize(
    ("server_args", "num_servers", "message"),
    [
        (["--base-gpu-id", "2"], 1, "no --base-gpu-id .set sglang.base_gpu_id"),
        (["--base-gpu-id=2"], 2, "no --base-gpu-id"),
        (["--gpu-id-step", "2"], 2, "no --gpu-id-step with num_servers > 1"),
    ],
)
def test_gpu_placement_flags_in_server_args_are_refused(server_args, num_servers, message):
    with pytest.raises(ValueError, match=rf"server_args=.*expected {message}"):
        SGLangEngineConfig(
            model_path="/m", device="cuda", num_servers=num_servers, server_args=server_args
        )


def test_gpu_placement_flags_from_plugins_are_refused_and_one_server_may_step():
    config = SGLangEngineConfig(model_path="/m", device="cuda", server_args=["--gpu-id-step", "2"])
    command = SGLangEngine(config).server_command(30000)
    assert command[command.index("--base-gpu-id") + 1] == "0"
    engine = SGLangEngine(
        SGLangEngineConfig(model_path="/m", device="cuda", num_servers=2, tp_size=4, base_gpu_id=0),
        extra_server_args=["--base-gpu-id", "4"],
    )
    with pytest.raises(ValueError, match=r"rollout_server_args .* set --base-gpu-id"):
        engine.server_command(30000, 1)
    engine.extra_server_args = []
    command = engine.server_command(30000, 1)
    assert command[command.index("--base-gpu-id") + 1] == "4"


def test_base_gpu_id_is_validated():
    with pytest.raises(ValueError, match=r"base_gpu_id=-1: expected >= 0"):
        SGLangEngineConfig(base_gpu_id=-1)


def test_server_exiting_during_startup_is_reported(tmp_path, fake_sglang_package, monkeypatch):
    monkeypatch.setenv("FAKE_SGLANG_EXIT", "3")
    engine = build_engine(launch_config(tmp_path))
    with pytest.raises(
        EngineError, match=r"exited with code 3 before becoming healthy: .* \(log: .*logs"
    ):
        asyncio.run(engine.start())
    assert engine._servers == []


def test_a_server_whose_port_was_taken_before_it_bound_is_launched_again_elsewhere(
    tmp_path, fake_sglang_package, monkeypatch
):
    """sglang binds its port only after loading the model: another process can take it in
    between. Here the port is held from the start and the free-port probe is made to miss
    that, as a race would; the server fails to bind, and Ember launches it on another port."""
    import ember_rollout.sglang_launch as launch

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    monkeypatch.setattr(launch, "port_is_free", lambda host, port: True)
    engine = build_engine(launch_config(tmp_path, num_servers=1, base_port=taken))

    async def main():
        async with engine:
            outs = await engine.generate([request(0, n=1)])
            return list(engine.urls), outs

    try:
        (url,), outs = asyncio.run(main())
    finally:
        held.close()
    assert [o.output_ids for o in outs] == [[7]]  # the relaunched server answers
    port = url.rsplit(":", 1)[1]
    assert port != str(taken)
    argvs = [json.loads(line) for line in fake_sglang_package.read_text().splitlines()]
    assert [argv[argv.index("--port") + 1] for argv in argvs] == [str(taken), port]
    log = (tmp_path / "logs" / f"sglang-0-{taken}.log").read_text()
    assert "address already in use" in log.lower()


@pytest.mark.parametrize("value", ["1", "True"])
def test_untempered_log_probs_switch_is_refused_before_any_server_starts(
    tmp_path, fake_sglang_package, monkeypatch, value
):
    """sglang 0.5.23 returns log-probs taken before the temperature under this variable; the
    trainer divides by it, so the launcher refuses to start a server that would."""
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", value)
    engine = build_engine(launch_config(tmp_path))
    with pytest.raises(ValueError) as info:
        asyncio.run(engine.start())
    message = str(info.value)
    assert message.startswith(f"SGLANG_RETURN_ORIGINAL_LOGPROB={value}: ")
    assert message.endswith("unset SGLANG_RETURN_ORIGINAL_LOGPROB") and "\n" not in message
    assert engine._servers == [] and not fake_sglang_package.exists(), "no server launched"
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "0")
    engine = build_engine(launch_config(tmp_path))

    async def main():
        async with engine:
            return await engine.generate([request(0, n=1)])

    assert [o.output_ids for o in asyncio.run(main())] == [[7]]


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


@pytest.mark.parametrize(
    "server_args",
    [["--dp-size", "2"], ["--dp-size=4"], ["--data-parallel-size", "2"], ["--dp-size"]],
)
def test_data_parallel_replicas_in_server_args_are_refused(server_args):
    # sglang 0.5.23 tokenizer_control_mixin.py asserts dp_size == 1 for weight updates.
    with pytest.raises(ValueError, match=r"server_args=.*expected no --d.* \(weight updates need"):
        SGLangEngineConfig(model_path="/m", server_args=server_args)
    with pytest.raises(ValueError, match=r"rollout_server_args .* set --d"):
        SGLangEngine(
            SGLangEngineConfig(model_path="/m"), extra_server_args=server_args
        ).server_command(30000)
    assert SGLangEngineConfig(model_path="/m", server_args=["--dp-size", "1"]).server_args
