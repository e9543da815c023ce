"""Partial rollouts on SGLang: a push pauses generation in place, loads without flushing the
cache, continues, and the request it overlapped reports one span per version."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sglang_fake import INFO, NOT_FLUSHED, FakeSGLang, request, run

from ember_rollout.config import SGLangEngineConfig
from ember_rollout.engine import EngineError
from ember_rollout.sglang_engine import SGLangEngine
from ember_rollout.sglang_launch import NO_RADIX_CACHE

SHAPES = {"lm_head.weight": (2, 3)}
JOIN = {
    "master_address": "127.0.0.1",
    "master_port": 29500,
    "rank_offset": 1,
    "world_size": 2,
    "group_name": "ember-weights-1",
    "backend": "gloo",
}
BUCKET = (["lm_head.weight"], ["float32"], [[2, 3]])
CONTROL = ("/pause_generation", "/begin_weight_update", "/update_weights_from_distributed")


def _held() -> tuple[asyncio.Event, asyncio.Event, object]:
    """(started, release, hold): /generate sets `started`, then waits for `release`."""
    started, release = asyncio.Event(), asyncio.Event()

    async def hold(_fake):
        started.set()
        await release.wait()

    return started, release, hold


def _push_during_a_request(partial: bool):
    """A request starts, a push of version "1" runs while it is held, then it finishes."""
    started, release, hold = _held()
    fake = FakeSGLang(hold=hold, model_shapes=SHAPES, radix_cache=not partial)
    outcome: dict = {}

    async def body(engine):
        await engine.init_weights_update_group(**JOIN)
        generating = asyncio.create_task(engine.generate([request(n=4)]))
        await started.wait()
        try:
            await engine.begin_weight_update()
            await engine.update_weights_from_distributed(
                *BUCKET, group_name="ember-weights-1", weight_version="1"
            )
            await engine.end_weight_update()
        except EngineError as exc:
            outcome["error"] = exc
        release.set()
        (outcome["output"],) = await generating

    run(fake, body, partial_rollouts=partial)
    return fake, outcome


def test_a_push_mid_request_pauses_in_place_loads_unflushed_and_continues():
    fake, outcome = _push_during_a_request(partial=True)
    assert "error" not in outcome
    paths = [path for _, path, _ in fake.weight_calls]
    assert paths == [
        "/init_weights_update_group",
        *CONTROL,
        "/end_weight_update",
        "/continue_generation",
    ]
    bodies = {path: body for _, path, body in fake.weight_calls}
    assert bodies["/pause_generation"]["mode"] == "in_place"
    assert bodies["/update_weights_from_distributed"]["flush_cache"] is False
    # The request the push overlapped: its first tokens from version "0", the rest from "1".
    output = outcome["output"]
    assert output.weight_spans("sample 0") == [(0, "default"), (2, "1")]
    assert fake.states[0].paused is None and fake.open_sessions == set()
    assert fake.ignored_fields == set()


def test_without_partial_rollouts_a_push_neither_pauses_nor_keeps_the_cache():
    fake, outcome = _push_during_a_request(partial=False)
    assert "error" not in outcome
    paths = [path for _, path, _ in fake.weight_calls]
    assert "/pause_generation" not in paths and "/continue_generation" not in paths
    bodies = {path: body for _, path, body in fake.weight_calls}
    assert bodies["/update_weights_from_distributed"]["flush_cache"] is True


def test_a_flush_while_requests_are_paused_fails_as_sglang_fails_it():
    """Why the engine never asks for a flush under partial rollouts."""
    started, release, hold = _held()
    fake = FakeSGLang(hold=hold, model_shapes=SHAPES, radix_cache=False)

    async def body(engine):
        await engine.init_weights_update_group(**JOIN)
        generating = asyncio.create_task(engine.generate([request()]))
        await started.wait()
        url = engine.urls[0]
        await engine._post(f"{url}/pause_generation", {"mode": "in_place"}, where="test")
        await engine._post(f"{url}/begin_weight_update", {}, where="test")
        try:
            with pytest.raises(EngineError) as info:
                await engine._post(
                    f"{url}/update_weights_from_distributed",
                    {"names": BUCKET[0], "dtypes": BUCKET[1], "shapes": BUCKET[2],
                     "group_name": "ember-weights-1", "flush_cache": True},
                    where="test",
                )  # fmt: skip
        finally:
            release.set()
        await engine._post(f"{url}/end_weight_update", {}, where="test")
        await engine._post(f"{url}/continue_generation", {}, where="test")
        await generating
        return str(info.value)

    assert NOT_FLUSHED in run(fake, body)


def test_a_refused_begin_does_not_leave_generation_paused():
    fake = FakeSGLang(radix_cache=False)

    async def body(engine):
        await engine._post(f"{engine.urls[0]}/begin_weight_update", {}, where="someone else")
        with pytest.raises(EngineError, match="already open"):
            await engine.begin_weight_update()
        # Generation goes on: a request is answered, not held by a pause.
        return await asyncio.wait_for(engine.generate([request()]), 5)

    run(fake, body, partial_rollouts=True)
    paths = [path for _, path, _ in fake.weight_calls]
    assert paths[-2:] == ["/begin_weight_update", "/continue_generation"]
    assert fake.states[0].paused is None


def test_partial_rollouts_refuse_an_attached_server_that_keeps_its_radix_cache():
    fake = FakeSGLang()

    async def body(engine):
        return None

    with pytest.raises(EngineError) as info:
        run(fake, body, partial_rollouts=True)
    message = str(info.value)
    assert "reports disable_radix_cache=False" in message and NO_RADIX_CACHE in message
    assert "rollout.partial_rollouts=true" in message and "\n" not in message


@pytest.mark.parametrize("partial", [True, False])
def test_launched_servers_run_without_the_radix_cache_under_partial_rollouts(tmp_path, partial):
    config = SGLangEngineConfig(model_path=str(tmp_path), device="cpu")
    engine = SGLangEngine(config, model_info=INFO)
    engine.partial_rollouts = partial
    command = engine.server_command(30000)
    assert (NO_RADIX_CACHE in command) is partial
    assert command.count(NO_RADIX_CACHE) <= 1


def test_a_pause_that_fails_on_one_server_leaves_no_server_paused():
    fake = FakeSGLang(radix_cache=False, fail_pause_on=(1,))

    async def body(engine):
        with pytest.raises(EngineError, match="pause_generation on .* HTTP 500"):
            await engine.begin_weight_update()
        return await asyncio.wait_for(engine.generate([request(), request(1)]), 5)

    run(fake, body, n_servers=2, partial_rollouts=True, max_retries=0)
    assert [state.paused for state in fake.states] == [None, None]
    assert fake.open_sessions == set()
    continued = [s for s, path, _ in fake.weight_calls if path == "/continue_generation"]
    assert sorted(continued) == [0, 1]


# -- a push that stops partway --------------------------------------------------------------------
#
# sglang 0.5.23 loads each bucket as it arrives, and the sender names the version with the last
# one: servers whose session ends without it hold weights of two versions under the old label.

UNVERSIONED = "serves no weight version until a complete"


def _stop_partway(engine) -> Any:
    """Begin a session, load one bucket that names no version (not the last), end it."""

    async def push() -> None:
        await engine.begin_weight_update()
        await engine.update_weights_from_distributed(*BUCKET, group_name="ember-weights-1")
        await engine.end_weight_update()

    return push()


def test_a_push_that_stops_partway_keeps_generation_paused_until_a_complete_one():
    fake = FakeSGLang(model_shapes=SHAPES, radix_cache=False)

    async def body(engine):
        await engine.init_weights_update_group(**JOIN)
        with pytest.raises(EngineError, match=f"end_weight_update: .*{UNVERSIONED}"):
            await _stop_partway(engine)
        assert fake.states[0].paused == "in_place", "generation continued on the mix"
        generating = asyncio.create_task(engine.generate([request(n=4)]))
        await asyncio.sleep(0.3)
        assert not generating.done(), "a request ran on weights no version names"
        await engine.begin_weight_update()
        await engine.update_weights_from_distributed(
            *BUCKET, group_name="ember-weights-1", weight_version="2"
        )
        await engine.end_weight_update()
        (output,) = await asyncio.wait_for(generating, 5)
        return output

    output = run(fake, body, partial_rollouts=True)
    paths = [path for _, path, _ in fake.weight_calls]
    session = ["/begin_weight_update", "/update_weights_from_distributed", "/end_weight_update"]
    assert paths == [
        "/init_weights_update_group",
        "/pause_generation",
        *session,  # stopped partway: generation stays paused
        *session,
        "/continue_generation",
    ]
    assert output.weight_spans("sample 0") == [(0, "2")]
    assert fake.states[0].paused is None


def test_without_partial_rollouts_a_push_that_stops_partway_refuses_to_generate():
    fake = FakeSGLang(model_shapes=SHAPES)

    async def body(engine):
        await engine.init_weights_update_group(**JOIN)
        with pytest.raises(EngineError, match=UNVERSIONED):
            await _stop_partway(engine)
        sent = len(fake.bodies)
        with pytest.raises(EngineError, match=f"generate: .*last bucket .*{UNVERSIONED}"):
            await engine.generate([request()])
        assert len(fake.bodies) == sent, "refused before anything was sent"
        # A failed disk load leaves it so; a complete one ends it.
        with pytest.raises(EngineError, match="no such checkpoint"):
            await engine.update_weights_from_disk("/missing", weight_version="6")
        with pytest.raises(EngineError, match=UNVERSIONED):
            await engine.generate([request()])
        await engine.update_weights_from_disk("/checkpoint", weight_version="7")
        (output,) = await engine.generate([request()])
        return output

    assert run(fake, body).meta_info["weight_version"] == "7"


def test_a_bucket_that_fails_leaves_no_version_even_when_it_names_one():
    fake = FakeSGLang(model_shapes=SHAPES)

    async def body(engine):
        await engine.init_weights_update_group(**JOIN)
        await engine.begin_weight_update()
        with pytest.raises(EngineError, match="Attempted to load weight"):
            await engine.update_weights_from_distributed(
                BUCKET[0], BUCKET[1], [[3, 2]], group_name="ember-weights-1", weight_version="2"
            )
        with pytest.raises(EngineError, match=f"update_weights_from_distributed .*{UNVERSIONED}"):
            await engine.end_weight_update()
        with pytest.raises(EngineError, match=UNVERSIONED):
            await engine.generate([request()])
        # The whole update in one request, naming its version: complete.
        await engine.begin_weight_update()
        await engine.update_weights_from_distributed(
            *BUCKET, group_name="ember-weights-1", weight_version="3"
        )
        await engine.end_weight_update()
        (output,) = await engine.generate([request()])
        return output

    assert run(fake, body).meta_info["weight_version"] == "3"
