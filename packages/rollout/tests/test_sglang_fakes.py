"""The two fake SGLang servers hold to sglang 0.5.23's protocol: what a request may say, and the
weight version a server reports (its --weight-version until an update names another).

`FakeSGLang` runs in this process; `fake_sglang_server.py` (the ember package's tests launch it
as an SGLang server) runs here as a subprocess launched by the sglang engine itself.
"""

from __future__ import annotations

import asyncio
import json
import stat
import sys
from pathlib import Path

import pytest
from sglang_fake import FakeSGLang, request, run

from ember_rollout.config import SGLangEngineConfig, TinyModelConfig
from ember_rollout.engine import GenerateRequest, SamplingParams
from ember_rollout.models import write_tiny_checkpoint
from ember_rollout.sglang_engine import SGLangEngine

SERVER_SCRIPT = Path(__file__).parents[2] / "ember" / "tests" / "fake_sglang_server.py"


async def post(engine, path: str, payload, server: int = 0) -> tuple[int, object]:
    async with engine._http.post(f"{engine.urls[server]}{path}", json=payload) as answer:
        return answer.status, await answer.json()


def test_a_server_reports_its_launch_version_until_an_update_names_another(tmp_path):
    fake = FakeSGLang(weight_version="-1")

    async def body(engine):
        versions = []

        async def served():
            (out,) = await engine.generate([request()])
            versions.append(out.meta_info["weight_version"])

        await served()
        await engine.update_weights_from_disk(tmp_path, weight_version="0")
        await served()
        await engine.update_weights_from_disk(tmp_path)  # no version: the old one stays
        await served()
        versioned = {"model_path": "/m", "weight_version": "1"}
        answer = await post(engine, "/update_weights_from_disk", versioned)
        await served()
        return versions, answer

    versions, (status, answer) = run(fake, body)
    assert versions == ["-1", "0", "0", "1"]
    assert status == 200
    assert answer["message"] == "Succeeded to update model weights. Weight version updated to 1."


def test_generate_bodies_are_checked_like_sglangs_json_contract():
    fake = FakeSGLang()

    async def body(engine):
        good = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
        return [
            await post(engine, "/generate", good),
            await post(engine, "/generate", {**good, "sampling_params": {"seed": 3}}),
            await post(engine, "/generate", {**good, "sampling_params": {"top_k": "20"}}),
            await post(engine, "/generate", {**good, "sampling_params": {"top_p": 0}}),
            await post(engine, "/generate", {"sampling_params": {"max_new_tokens": 1}}),
            await post(engine, "/generate", {**good, "input_ids": ["a"]}),
            await post(engine, "/generate", {**good, "lora_id": None, "plugin_extra": 1}),
        ]

    answers = run(fake, body)
    assert answers[0][0] == 200
    assert answers[1][0] == 400 and answers[1][1]["error"].startswith("unknown field `seed`")
    assert answers[2][0] == 400 and "for `top_k`, expected i64" in answers[2][1]["error"]
    assert answers[3] == (400, {"error": {"message": "top_p must be in (0, 1], got 0."}})
    assert answers[4][0] == 400 and "input_ids" in answers[4][1]["error"]["message"]
    assert answers[5][0] == 400 and answers[5][1]["object"] == "error"
    assert answers[6][0] == 200 and fake.ignored_fields == {"/generate:plugin_extra"}


def test_bodies_that_do_not_fit_a_request_struct_are_refused_like_fastapi_refuses_them():
    fake = FakeSGLang()

    async def body(engine):
        requests = [
            ("/update_weights_from_disk", {"model_path": "/m", "weight_version": 3}),
            ("/init_weights_update_group", {"master_port": "x", "rank_offset": 1}),
            ("/update_weights_from_tensor", {"serialized_named_tensors": ["%"]}),
            ("/release_memory_occupation", {"tags": [1]}),
            ("/begin_weight_update", {"selector": "all", "extra": 1}),
        ]
        return [await post(engine, path, payload) for path, payload in requests]

    answers = run(fake, body)
    assert [status for status, _ in answers] == [400, 400, 400, 400, 200]
    assert all(a["object"] == "error" and a["code"] == 400 for _, a in answers[:4])
    assert "['body', 'weight_version']" in answers[0][1]["message"]
    for key in ("master_address", "master_port", "world_size"):
        assert f"['body', '{key}']" in answers[1][1]["message"]
    assert "['body', 'serialized_named_tensors', 0]" in answers[2][1]["message"]
    assert "['body', 'tags', 0]" in answers[3][1]["message"]
    assert fake.weight_calls == [(0, "/begin_weight_update", {"selector": "all", "extra": 1})]
    assert fake.ignored_fields == {"/begin_weight_update:extra"}, "ignored, as sglang does"


# -- the subprocess fake, launched as an SGLang server ------------------------------------------


def launcher(tmp_path: Path) -> Path:
    """An executable that `sglang.python` can name: runs the fake server."""
    script = tmp_path / "fake-python"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{SERVER_SCRIPT}" "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


@pytest.mark.slow
def test_the_launched_fake_reports_its_weight_version_flag_and_refuses_bad_bodies(tmp_path):
    model = write_tiny_checkpoint(tmp_path / "model", TinyModelConfig(vocab_size=17))
    record = tmp_path / "record.jsonl"
    config = SGLangEngineConfig(
        model_path=str(model),
        python=str(launcher(tmp_path)),
        server_args=["--record", str(record), "--weight-version", "-1"],
        launch_timeout_s=60.0,
        health_poll_s=0.05,
        max_retries=0,
        log_dir=str(tmp_path / "logs"),
    )
    prompt = GenerateRequest(input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=2))

    async def main():
        async with SGLangEngine(config) as engine:
            versions = [(await engine.generate([prompt]))[0].meta_info["weight_version"]]
            await engine.update_weights_from_disk(model, weight_version="0")
            versions.append((await engine.generate([prompt]))[0].meta_info["weight_version"])
            refused = [
                await post(engine, "/update_weights_from_disk", {"load_format": None}),
                await post(engine, "/generate", {"input_ids": [1], "sampling_params": {"x": 1}}),
                await post(
                    engine,
                    "/update_weights_from_distributed",
                    {"names": ["w"], "dtypes": ["float32"], "shapes": [[1]]},
                ),
                await post(engine, "/end_weight_update", {}),
            ]
            return versions, refused

    versions, refused = asyncio.run(main())
    assert versions == ["-1", "0"]
    assert refused[0][0] == 400 and "'model_path'" in refused[0][1]["message"]
    assert refused[1][0] == 400 and refused[1][1]["error"].startswith("unknown field `x`")
    assert refused[2] == (
        400,
        {
            "success": False,
            "message": "update_weights_from_distributed must run between "
            "begin_weight_update() and end_weight_update()",
        },
    )
    assert refused[3][0] == 400 and "no weight-update session is open" in refused[3][1]["message"]
    log = [json.loads(line) for line in record.read_text().splitlines()]
    assert log[0]["route"] == "launch" and log[0]["weight_version"] == "-1"
    generated = [entry for entry in log if entry["route"] == "/generate"]
    assert [entry.get("weight_version", entry.get("refused")) for entry in generated] == [
        "-1",
        "0",
        "invalid body",
    ]
