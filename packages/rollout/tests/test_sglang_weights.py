"""Weight updates of the sglang engine against fake servers that enforce sglang 0.5.23's rules."""

from __future__ import annotations

import asyncio
import base64
import pickletools
import types

import pytest
import torch
from aiohttp import web
from sglang_fake import ALREADY_OPEN, NOT_OPEN, OUTSIDE, FakeSGLang, engine_for, request, run

from ember_rollout.engine import EngineError
from ember_rollout.sglang_weights import serialize_flattened_bucket, serialize_named_tensors

BEGIN, UPDATE, END = "/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update"


@pytest.fixture
def cpu_ipc():
    """CPU tensors travel by shared-memory file name, which the fakes in this process open as a
    launched server does (the real server on CPU: test_sglang_real.py)."""


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


def test_tensor_and_ipc_updates_that_stop_partway_leave_no_version(cpu_ipc):
    """The rule of broadcast buckets (test_sglang_partial_rollouts.py) for the other session
    updates: a failed tensor update, or IPC buckets whose last names no version, leave weights
    no version names; a tensor update naming a version ends that, one naming none cannot."""
    fake = FakeSGLang(fail_tensor_updates_on=(1,))
    tensors = weights()
    flat = torch.cat([t.detach().reshape(-1).view(torch.uint8) for _, t in tensors])
    layout = (
        [n for n, _ in tensors],
        [str(t.dtype).removeprefix("torch.") for _, t in tensors],
        [list(t.shape) for _, t in tensors],
    )
    unversioned = "serves no weight version until a complete push"

    async def body(engine):
        with pytest.raises(EngineError, match="bogus"):
            await engine.update_weights_from_tensors(tensors, weight_version="4")
        with pytest.raises(EngineError, match=f"generate: .*bogus.*{unversioned}"):
            await engine.generate([request()])
        fake.fail_tensor_updates_on = ()
        await engine.update_weights_from_tensors(tensors)
        with pytest.raises(EngineError, match=unversioned):
            await engine.generate([request()])
        await engine.update_weights_from_tensors(tensors, weight_version="5")
        (five,) = await engine.generate([request()])
        payloads = [serialize_flattened_bucket(flat, *layout) for _ in range(2)]
        await engine.begin_weight_update()
        await engine.update_weights_from_ipc(payloads)
        with pytest.raises(EngineError, match=f"last named no weight version.*{unversioned}"):
            await engine.end_weight_update()
        with pytest.raises(EngineError, match=unversioned):
            await engine.generate([request()])
        return five

    assert run(fake, body, n_servers=2).meta_info["weight_version"] == "5"


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
            async with engine._http.post(f"{url}{path}", json=payload) as response:
                answers.append((response.status, await response.json()))
        return answers

    answers = run(fake, body)
    assert answers[:4] == [
        (400, {"success": False, "message": NOT_OPEN}),
        (400, {"success": False, "message": OUTSIDE}),
        (200, {"success": True, "message": "Success"}),
        (400, {"success": False, "message": ALREADY_OPEN}),
    ]
    # FastAPI's validation errors, which sglang answers 400 with an ErrorResponse
    assert answers[4][0] == answers[5][0] == 400
    assert answers[4][1]["object"] == "error" and "'selector'" in answers[4][1]["message"]
    assert "'missing'" in answers[5][1]["message"]
    assert "'serialized_named_tensors'" in answers[5][1]["message"]


def test_tensors_no_handle_can_carry_are_refused_before_anything_is_sent():
    fake = FakeSGLang()

    async def body(engine):
        on_meta = [(name, tensor.to("meta")) for name, tensor in weights()]
        with pytest.raises(
            ValueError,
            match=r"'model.embed_tokens.weight' is on meta.*update_weights_from_disk\(path\)",
        ):
            await engine.update_weights_from_tensors(on_meta)
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


# -- weights broadcast by the trainer, and flattened buckets by IPC -------------------------------

INIT, DIST = "/init_weights_update_group", "/update_weights_from_distributed"
SHAPES = {"model.embed_tokens.weight": (2, 3), "lm_head.weight": (2, 2)}
JOIN = {
    "master_address": "10.0.0.5",
    "master_port": 29600,
    "rank_offset": 3,
    "world_size": 7,
    "group_name": "ember-weights-1",
    "backend": "nccl",
}


def bucket(names=("model.embed_tokens.weight", "lm_head.weight")):
    return (
        list(names),
        ["bfloat16"] * len(names),
        [list(SHAPES.get(n, (1,))) for n in names],
    )


def test_servers_join_a_weight_group_as_consecutive_ranks_per_gpu():
    fake = FakeSGLang(tp_size=2)

    async def body(engine):
        assert engine.weight_group_size == 4
        await engine.init_weights_update_group(**JOIN)
        with pytest.raises(EngineError, match=rf"init_weights_update_group on {engine.urls[0]}.*"):
            await engine.init_weights_update_group(**JOIN)
        await engine.destroy_weights_update_group("ember-weights-1")
        with pytest.raises(EngineError, match="The group to be destroyed does not exist"):
            await engine.destroy_weights_update_group("ember-weights-1")

    run(fake, body, n_servers=2, tp_size=2)
    joins = [(s, b) for s, p, b in fake.weight_calls if p == INIT]
    assert sorted((s, b["rank_offset"]) for s, b in joins[:2]) == [(0, 3), (1, 5)]
    assert joins[0][1]["world_size"] == 7 and joins[0][1]["backend"] == "nccl"
    assert joins[0][1]["master_address"] == "10.0.0.5"
    assert fake.ignored_fields == set()


def test_distributed_buckets_load_inside_one_session_with_the_version_on_the_last():
    fake = FakeSGLang(model_shapes=SHAPES)

    async def body(engine):
        await engine.init_weights_update_group(**{**JOIN, "rank_offset": 1, "world_size": 3})
        await engine.begin_weight_update()
        await engine.update_weights_from_distributed(
            *bucket(["model.embed_tokens.weight"]), group_name="ember-weights-1", flush_cache=False
        )
        await engine.update_weights_from_distributed(
            *bucket(["lm_head.weight"]), group_name="ember-weights-1", weight_version="5"
        )
        await engine.end_weight_update()

    run(fake, body, n_servers=2)
    for server in (0, 1):
        calls = calls_of(fake, server)
        assert [path for path, _ in calls] == [INIT, BEGIN, DIST, DIST, END]
        first, last = calls[2][1], calls[3][1]
        assert first["load_format"] == last["load_format"] == "flattened_bucket"
        assert first["names"] == ["model.embed_tokens.weight"] and first["shapes"] == [[2, 3]]
        assert (first["flush_cache"], first["weight_version"]) == (False, None)
        assert (last["flush_cache"], last["weight_version"]) == (True, "5")
        assert last["group_name"] == "ember-weights-1" and last["dtypes"] == ["bfloat16"]
    assert fake.open_sessions == set()
    assert fake.ignored_fields == set() and fake.ignored_names == set()


def test_distributed_updates_refuse_what_sglang_refuses():
    fake = FakeSGLang(model_shapes=SHAPES)

    async def body(engine):
        url = engine.urls[0]
        with pytest.raises(EngineError, match="must run between begin_weight_update"):
            await engine.update_weights_from_distributed(*bucket(), group_name="g")
        assert fake.weight_calls == [], "refused before the sender starts a broadcast"
        answers = []
        names, dtypes, shapes = bucket()

        def dist(names=names, dtypes=dtypes, shapes=shapes, **extra):
            return DIST, {"names": names, "dtypes": dtypes, "shapes": shapes, **extra}

        for path, payload in [
            dist(),  # no session
            (BEGIN, {"selector": "all"}),
            dist(group_name="g"),
            (INIT, {**JOIN, "rank_offset": 1, "world_size": 2, "group_name": "g"}),
            dist(dtypes=dtypes[:1], group_name="g"),
            dist(shapes=[[3, 2], [2, 2]], group_name="g"),
            dist(["bogus.weight"], ["float32"], [[1]], group_name="g"),
            dist([1], ["float32"], [[1]], group_name="g"),
            (INIT, {**JOIN, "rank_offset": 0, "world_size": 2, "group_name": "h"}),
            (END, {}),
        ]:
            async with engine._http.post(f"{url}{path}", json=payload) as response:
                answers.append((response.status, await response.json()))
        await engine.begin_weight_update()
        with pytest.raises(
            EngineError,
            match=rf"update_weights_from_distributed on {url}.*Attempted to load weight",
        ):
            await engine.update_weights_from_distributed(
                names, dtypes, [[3, 2], [2, 2]], group_name="g"
            )
        # sglang: "The full weights of the ModelRunner are partially updated."
        with pytest.raises(EngineError, match="an update of the session failed: .*no weight"):
            await engine.end_weight_update()
        return answers

    answers = run(fake, body)
    messages = [a[1].get("message", "") for a in answers]
    assert answers[0][0] == 400 and "must run between begin_weight_update" in messages[0]
    assert answers[2][0] == 400 and "Group g not in []" in messages[2]
    assert answers[3][0] == 200
    assert answers[4][0] == 400 and "Failed to receive weights: zip()" in messages[4]
    assert answers[5][0] == 400 and "Attempted to load weight" in messages[5]
    assert answers[6][0] == 200 and fake.ignored_names == {"bogus.weight"}
    assert answers[7][0] == 400 and "'names', 0" in answers[7][1]["message"]
    assert answers[8][0] == 400 and "Failed to initialize custom process group" in messages[8]


def test_flattened_buckets_by_ipc_one_payload_per_rank(cpu_ipc, monkeypatch):
    fake = FakeSGLang(tp_size=2)
    tensors = weights()
    flat = torch.cat([t.detach().reshape(-1).view(torch.uint8) for _, t in tensors])
    names = [n for n, _ in tensors]
    dtypes = [str(t.dtype).removeprefix("torch.") for _, t in tensors]
    shapes = [list(t.shape) for _, t in tensors]

    async def body(engine):
        payloads = [
            serialize_flattened_bucket(flat, names, dtypes, shapes)
            for _ in range(engine.weight_group_size)
        ]
        with pytest.raises(ValueError, match="3 IPC payloads .* expected 4"):
            await engine.update_weights_from_ipc(payloads[:3])
        with pytest.raises(EngineError, match="must run between begin_weight_update"):
            await engine.update_weights_from_ipc(payloads)
        await engine.begin_weight_update()
        await engine.update_weights_from_ipc(payloads, weight_version="2")
        await engine.end_weight_update()
        return payloads

    payloads = run(fake, body, n_servers=2, tp_size=2)
    for server in (0, 1):
        calls = calls_of(fake, server)
        assert [path for path, _ in calls] == [BEGIN, UPDATE, END]
        update = calls[1][1]
        assert update["serialized_named_tensors"] == payloads[2 * server : 2 * server + 2]
        assert update["load_format"] == "flattened_bucket" and update["weight_version"] == "2"
        for rank_tensors in update["tensors"]:
            assert [n for n, _ in rank_tensors] == names
            for (_, got), (_, want) in zip(rank_tensors, tensors, strict=True):
                assert got.dtype == want.dtype and torch.equal(got, want)
    assert fake.ignored_fields == set()
    with pytest.raises(ValueError, match="cannot reach a separately launched SGLang server"):
        serialize_flattened_bucket(flat.to("meta"), names, dtypes, shapes)


def test_mistyped_versions_names_and_dtypes_are_refused_before_anything_is_sent(cpu_ipc):
    """SGLang refuses them with HTTP 400 before the update runs: for a broadcast, after the
    sender has started it, which then waits for receivers that never come."""
    fake = FakeSGLang()

    async def body(engine):
        await engine.begin_weight_update()
        names, dtypes, shapes = bucket()
        for call, match in [
            (
                engine.update_weights_from_distributed(
                    names, dtypes, shapes, group_name="g", weight_version=3
                ),
                r"update_weights_from_distributed: weight_version=3 is a int",
            ),
            (
                engine.update_weights_from_distributed([0, 1], dtypes, shapes, group_name="g"),
                r"update_weights_from_distributed: names holds 0; expected strings",
            ),
            (
                engine.update_weights_from_distributed(
                    names, [torch.bfloat16] * 2, shapes, group_name="g"
                ),
                r"dtypes holds torch.bfloat16; expected strings",
            ),
            (engine.update_weights_from_ipc(["p"], weight_version=1.5), "1.5 is a float"),
            (engine.update_weights_from_disk("/ckpt", weight_version=2), "weight_version=2"),
            (engine.update_weights_from_tensors(weights(), weight_version=2), "is a int"),
        ]:
            with pytest.raises(TypeError, match=match):
                await call
        await engine.end_weight_update()

    run(fake, body)
    assert [path for _, path, _ in fake.weight_calls] == [BEGIN, END]


def test_calls_that_change_a_servers_state_are_sent_once_whatever_max_retries_says():
    """A begin (or a tensor or distributed update, a join) that timed out or failed may have
    happened; a second one would be refused or wait for a broadcast that does not come again.
    A disk load can be repeated, and is retried."""
    hits: list[str] = []

    async def health(request):
        return web.Response()

    async def overloaded(request):
        hits.append(request.path)
        return web.Response(status=503, text="overloaded")

    async def main():
        app = web.Application()
        app.router.add_get("/health", health)
        for path in (BEGIN, "/update_weights_from_disk", INIT):
            app.router.add_post(path, overloaded)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        engine = engine_for([f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"])
        try:
            await engine.start()
            with pytest.raises(EngineError, match=r"begin_weight_update on .*HTTP 503"):
                await engine.begin_weight_update()
            with pytest.raises(EngineError, match=r"init_weights_update_group on .*HTTP 503"):
                await engine.init_weights_update_group(**JOIN)
            with pytest.raises(EngineError, match=r"failed after 3 attempts.*HTTP 503"):
                await engine.update_weights_from_disk("/ckpt")
        finally:
            await engine.shutdown()
            await runner.cleanup()

    asyncio.run(main())
    assert hits == [BEGIN, INIT] + ["/update_weights_from_disk"] * 3  # max_retries=2
