"""Weight updates of the sglang engine against fake servers that enforce sglang 0.5.23's rules."""

from __future__ import annotations

import base64
import pickletools
import types

import pytest
import torch
from sglang_fake import ALREADY_OPEN, NOT_OPEN, OUTSIDE, FakeSGLang, run

from ember_rollout import sglang_engine
from ember_rollout.engine import EngineError
from ember_rollout.sglang_engine import serialize_named_tensors

BEGIN, UPDATE, END = "/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update"


@pytest.fixture
def cpu_ipc(monkeypatch):
    """Let CPU tensors through: the fake servers run in this process, which can open their
    shared-memory fds (a separately launched server cannot)."""
    monkeypatch.setattr(sglang_engine, "IPC_DEVICE_TYPES", ("cuda", "cpu"), raising=False)


def weights():
    return [
        ("model.embed_tokens.weight", torch.arange(6.0).reshape(2, 3)),
        ("lm_head.weight", torch.nn.Parameter(torch.ones(2, 2, dtype=torch.bfloat16))),
    ]


def calls_of(fake, server):
    return [(path, body) for s, path, body in fake.weight_calls if s == server]


def test_tensor_update_runs_inside_a_session_on_every_server(cpu_ipc):
    fake = FakeSGLang(tp_size=2)

    async def body(engine):
        await engine.update_weights_from_tensors(weights(), weight_version="4")

    run(fake, body, n_servers=2, tp_size=2)
    for server in (0, 1):
        calls = calls_of(fake, server)
        assert [path for path, _ in calls] == [BEGIN, UPDATE, END]
        assert calls[0][1] == {"selector": "all"} and calls[2][1] == {}
        update = calls[1][1]
        assert update["weight_version"] == "4"
        assert update["flush_cache"] is True and update["load_format"] is None
        assert len(update["decoded"]) == 2, "one serialization per TP rank"
        for rank_tensors in update["decoded"]:
            names = [name for name, _ in rank_tensors]
            assert names == ["model.embed_tokens.weight", "lm_head.weight"]
            assert torch.equal(rank_tensors[0][1], torch.arange(6.0).reshape(2, 3))
            assert rank_tensors[1][1].dtype == torch.bfloat16
    assert fake.open_sessions == set()
    assert fake.ignored_fields == set(), "SGLang ignores these fields: they say nothing"


def test_failed_tensor_update_still_ends_the_session_on_every_server(cpu_ipc):
    fake = FakeSGLang(fail_tensor_updates_on=(1,))

    async def body(engine):
        with pytest.raises(
            EngineError,
            match=rf"update_weights_from_tensor on {engine.urls[1]}: .*HTTP 400.*bogus\.weight",
        ):
            await engine.update_weights_from_tensors(weights())
        fake.fail_tensor_updates_on = ()
        await engine.update_weights_from_tensors(weights())  # no session was left open

    run(fake, body, n_servers=2)
    for server in (0, 1):
        assert [path for path, _ in calls_of(fake, server)] == [BEGIN, UPDATE, END] * 2
    assert fake.open_sessions == set()


def test_refused_begin_updates_nothing_and_ends_the_sessions_it_opened(cpu_ipc):
    fake = FakeSGLang()

    async def body(engine):
        # someone else's session is open on server 1
        await engine._post(f"{engine.urls[1]}{BEGIN}", {"selector": "all"}, where="setup")
        with pytest.raises(
            EngineError, match=rf"begin_weight_update on {engine.urls[1]}: .*already open"
        ):
            await engine.update_weights_from_tensors(weights())

    run(fake, body, n_servers=2)
    assert [path for path, _ in calls_of(fake, 0)] == [BEGIN, END]
    assert [path for path, _ in calls_of(fake, 1)] == [BEGIN, BEGIN]  # the setup's, ours refused
    assert fake.open_sessions == {1}, "a session this engine did not open is left alone"


def test_the_fake_refuses_what_sglang_refuses(cpu_ipc):
    fake = FakeSGLang()

    async def body(engine):
        url = engine.urls[0]
        answers = []
        for path, payload in [
            (END, {}),
            (UPDATE, {"serialized_named_tensors": [serialize_named_tensors(weights())]}),
            (BEGIN, {"selector": "all"}),
            (BEGIN, {"selector": "all"}),
            (BEGIN, {"selector": "everything"}),
            (UPDATE, {"load_format": None}),
        ]:
            async with engine._session.post(f"{url}{path}", json=payload) as response:
                answers.append((response.status, await response.json()))
        return answers

    answers = run(fake, body)
    assert answers[:4] == [
        (400, {"success": False, "message": NOT_OPEN}),
        (400, {"success": False, "message": OUTSIDE}),
        (200, {"success": True, "message": "Success"}),
        (400, {"success": False, "message": ALREADY_OPEN}),
    ]
    assert answers[4][0] == answers[5][0] == 422
    assert answers[5][1]["detail"][0]["loc"] == ["body", "serialized_named_tensors"]


def test_tensors_off_the_gpu_are_refused_before_anything_is_sent():
    fake = FakeSGLang()

    async def body(engine):
        with pytest.raises(
            ValueError,
            match=r"'model.embed_tokens.weight' is on cpu.*update_weights_from_disk\(path\)",
        ):
            await engine.update_weights_from_tensors(weights())
        with pytest.raises(TypeError, match=r"'w' is a list"):
            await engine.update_weights_from_tensors([("w", [1.0])])

    run(fake, body)
    assert fake.weight_calls == []


def test_the_pickle_names_cuda_devices_by_uuid(monkeypatch):
    """The serializer swaps the device index torch's reducer gives for the device's UUID."""
    from torch.multiprocessing import reductions

    def reduce_tensor(tensor):
        # the shape of torch's CUDA answer: storage_device (index 6) is the device index
        args = (torch.Tensor, (2,), (1,), 0, torch.UntypedStorage, torch.float32, 3, b"h", 8)
        return reductions.rebuild_cuda_tensor, args

    monkeypatch.setattr(reductions, "reduce_tensor", reduce_tensor)
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda index: types.SimpleNamespace(uuid=f"GPU-uuid-of-{index}"),
    )
    blob = base64.b64decode(serialize_named_tensors([("w", torch.zeros(2))]))
    strings = [arg for _, arg, _ in pickletools.genops(blob) if isinstance(arg, str)]
    assert "GPU-uuid-of-3" in strings and "rebuild_cuda_tensor" in strings


def test_disk_update_sends_every_field_sglang_reads_and_needs_no_session():
    fake = FakeSGLang()

    async def body(engine):
        await engine.update_weights_from_disk("/ckpt/iter_3", weight_version="3")
        with pytest.raises(
            EngineError,
            match=rf"update_weights_from_disk on {engine.urls[0]}: .*HTTP 400.*no such checkpoint",
        ):
            await engine.update_weights_from_disk("/missing")

    run(fake, body, n_servers=2)
    disk = [(s, b) for s, p, b in fake.weight_calls if p == "/update_weights_from_disk"]
    assert sorted(s for s, _ in disk) == [0, 0, 1, 1]
    assert disk[0][1] == {
        "model_path": "/ckpt/iter_3",
        "load_format": None,
        "flush_cache": True,
        "abort_all_requests": False,
        "weight_version": "3",
    }
    assert all(p == "/update_weights_from_disk" for _, p, _ in fake.weight_calls)
    assert fake.ignored_fields == set()
