"""The colocated memory hand-off of the engines: the sglang engine against the fake server's
/release_memory_occupation and /resume_memory_occupation, and the embedded engine's no-op."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from sglang_fake import FakeSGLang, request, run

from ember_rollout.engine import MEMORY_TAGS, EngineError, memory_tags

RELEASE, RESUME = "/release_memory_occupation", "/resume_memory_occupation"


def memory_calls(fake: FakeSGLang) -> list[tuple[int, str]]:
    return [(server, path) for server, path in fake.calls if path != "/health"]


def test_release_and_resume_reach_every_server_and_gate_generation():
    fake = FakeSGLang()

    async def body(engine):
        await engine.generate([request(0)])
        await engine.release_memory()
        assert fake.released == {0: set(MEMORY_TAGS), 1: set(MEMORY_TAGS)}
        with pytest.raises(EngineError, match="memory is released"):
            await engine.generate([request(1)])
        await engine.resume_memory()
        return await engine.generate([request(2), request(3)])

    outputs = run(fake, body, n_servers=2)
    assert [o.output_ids for o in outputs] == [[10, 11, 12]] * 2
    assert fake.released == {0: set(), 1: set()}
    calls = memory_calls(fake)
    # sent once per server (no retry), then the refused generate, then one generate per server
    assert sorted(calls[1:3]) == [(0, RELEASE), (1, RELEASE)]
    assert calls[3][1] == "/generate"
    assert sorted(calls[4:6]) == [(0, RESUME), (1, RESUME)]
    assert sorted(calls[6:]) == [(0, "/generate"), (1, "/generate")]
    assert not fake.ignored_fields


def test_the_bodies_name_the_tags_explicitly():
    seen: list[dict] = []
    fake = FakeSGLang()
    original = fake._memory

    async def spy(req):
        seen.append(await req.json())
        return await original(req)

    fake._memory = spy

    async def body(engine):
        await engine.release_memory(["kv_cache", "weights"])
        await engine.resume_memory(["weights"])
        await engine.resume_memory(["kv_cache"])

    run(fake, body)
    # in MEMORY_TAGS order, whatever order the caller gave
    assert seen == [
        {"tags": ["weights", "kv_cache"]},
        {"tags": ["weights"]},
        {"tags": ["kv_cache"]},
    ]


def test_weights_load_only_after_the_weights_are_resumed(tmp_path):
    fake = FakeSGLang()

    async def body(engine):
        await engine.release_memory()
        with pytest.raises(EngineError, match="weights' memory is released"):
            await engine.update_weights_from_disk(tmp_path, weight_version="1")
        await engine.resume_memory(["weights"])
        await engine.update_weights_from_disk(tmp_path, weight_version="1")
        with pytest.raises(EngineError, match="memory is released"):  # the KV cache is not back
            await engine.generate([request(0)])
        await engine.resume_memory(["kv_cache", "cuda_graph"])
        return await engine.generate([request(1)])

    (out,) = run(fake, body)
    assert out.output_ids == [10, 11, 12]
    assert [path for _, path, _ in fake.weight_calls] == ["/update_weights_from_disk"]


def test_the_engine_refuses_a_second_release_and_a_resume_of_held_memory_before_sending():
    fake = FakeSGLang()

    async def body(engine):
        with pytest.raises(EngineError, match=r"\['weights'\] not released"):
            await engine.resume_memory(["weights"])
        await engine.release_memory(["kv_cache"])
        with pytest.raises(EngineError, match=r"\['kv_cache'\] already released"):
            await engine.release_memory()
        with pytest.raises(ValueError, match=r"\['kv'\]: expected some of"):
            await engine.release_memory(["kv"])

    run(fake, body)
    assert [path for _, path in memory_calls(fake)] == [RELEASE]
    assert fake.released == {0: {"kv_cache"}}


def test_a_server_refusal_names_the_server_and_is_not_retried():
    """The fake refuses what sglang 0.5.23 cannot do (its scheduler would fail instead)."""

    async def hold(fake):
        while not release_sent.is_set():
            await asyncio.sleep(0.01)

    release_sent = asyncio.Event()
    fake = FakeSGLang(hold=hold)

    async def body(engine):
        generating = asyncio.ensure_future(engine.generate([request(0)]))
        while fake.in_flight == 0:
            await asyncio.sleep(0.01)
        try:
            with pytest.raises(EngineError, match="only when server is idle") as info:
                await engine.release_memory()
        finally:
            release_sent.set()
        await generating
        return str(info.value)

    message = run(fake, body, max_retries=3)
    assert fake.ports and f":{fake.ports[0]}" in message
    assert [path for _, path in memory_calls(fake)].count(RELEASE) == 1
    assert fake.released == {0: set()}


def test_the_fake_refuses_releasing_twice_and_resuming_what_was_not_released():
    """Raw requests, past the engine's own checks: the fake enforces the order by itself."""
    fake = FakeSGLang()

    async def main():
        async with fake.running() as url, aiohttp.ClientSession() as session:

            async def post(path, body):
                async with session.post(url + path, json=body) as answer:
                    return answer.status, await answer.json()

            assert await post(RESUME, {"tags": ["weights"]}) == (
                400,
                {"error": {"message": "memory not released: ['weights']"}},
            )
            assert await post(RELEASE, {}) == (200, None)  # no tags: all of them
            assert await post(RELEASE, {"tags": ["kv_cache"]}) == (
                400,
                {"error": {"message": "memory already released: ['kv_cache']"}},
            )
            status, answer = await post(RELEASE, {"tags": "weights"})
            assert status == 400 and "'tags'" in answer["message"]
            assert await post(RESUME, {"tags": None}) == (200, None)

    asyncio.run(main())
    assert fake.released == {0: set()}


def test_memory_tags_are_checked():
    assert memory_tags(None) == MEMORY_TAGS == memory_tags([])
    assert memory_tags(["cuda_graph", "weights"]) == ("weights", "cuda_graph")
    with pytest.raises(ValueError, match="not one string"):
        memory_tags("weights")


def test_the_embedded_engine_keeps_its_memory_and_generates_after_a_release(fp32_engine):
    async def main():
        before = [p.data_ptr() for p in fp32_engine.model.parameters()]
        await fp32_engine.release_memory()
        await fp32_engine.resume_memory(["weights"])
        with pytest.raises(ValueError, match="expected some of"):
            await fp32_engine.release_memory(["everything"])
        (out,) = await fp32_engine.generate([request(0, n=2)])
        after = [p.data_ptr() for p in fp32_engine.model.parameters()]
        return before, after, out

    before, after, out = asyncio.run(main())
    assert before == after and len(out.output_ids) == 2


def test_health_is_a_generate_the_fake_refuses_and_the_probe_skips_while_memory_is_released():
    fake = FakeSGLang()

    async def body(engine):
        url = engine.urls[0]
        await engine.release_memory(["kv_cache"])
        async with aiohttp.ClientSession() as http:  # sglang's GET /health is a generate
            async with http.get(f"{url}/health") as answer:
                refused = answer.status, await answer.text()
        fake.calls.clear()
        released = await asyncio.to_thread(engine.probe, 5.0), await engine.health()
        asked_released = list(fake.calls)
        await engine.resume_memory(["kv_cache"])
        held = await asyncio.to_thread(engine.probe, 5.0), await engine.health()
        return refused, released, asked_released, held

    refused, released, asked_released, held = run(fake, body)
    assert refused[0] == 400 and "memory is released" in refused[1]
    assert released == (None, True) and asked_released == []  # the server is not asked
    assert held == (None, True)
    assert [path for _, path in fake.calls].count("/health") == 2


def test_the_probe_asks_every_server_at_once_with_the_timeout_it_is_given():
    fake = FakeSGLang()

    async def body(engine):
        fake.health_s = 0.6
        start = asyncio.get_running_loop().time()
        healthy = await asyncio.to_thread(engine.probe, 2.0)
        took = asyncio.get_running_loop().time() - start
        slow = await asyncio.to_thread(engine.probe, 0.2)
        return healthy, took, slow

    healthy, took, slow = run(fake, body, n_servers=3)
    assert healthy is None and took < 1.5  # one after another: 1.8 s at least
    assert slow is not None and "failed GET /health: timed out" in slow
