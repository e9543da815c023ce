"""The driver's weight path: rendezvous, initial weights, pushes to the hf and sglang engines.

Broadcast pushes run under real Ray: the training ranks and engines are actors, the sending
rank and the engines meet in a real gloo group. Direct, disk and ipc pushes run the real
`TrainRank` and `RolloutEngine` classes in this process, as `LocalActor`s of the in-process
runtime (`ember.runtimes.LocalRuntime`). Either way `ember.calls.get` is recorded: every value
it hands to the driver's code, which must never be a tensor. SGLang servers are
`fake_sglang_server.py` subprocesses that speak SGLang's HTTP format, receive broadcasts the
way SGLang does, and record what they load.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from fake_server_process import FAKE_SERVER, fake_server

import ember.calls
from ember.calls import LocalActor
from ember.config import load_config
from ember.driver import Driver
from ember.runtimes import LocalRuntime
from ember.versions import UNLOADED_WEIGHT_VERSION

pytestmark = pytest.mark.slow

TINY = [
    "train.model_overrides.num_layers=2",
    "rollout.rollout_batch_size=2",
    "rollout.n_samples_per_prompt=2",
    "rollout.max_response_len=4",
    "train.num_steps_per_rollout=1",
    "run.num_rollouts=1",
    "run.save_interval=0",
    "run.tensorboard=false",
    "run.plot=false",
    "ray.threads_per_actor=1",
]


# --------------------------------------------------------------------------------------------
# What the driver receives, and the actors in this process
# --------------------------------------------------------------------------------------------


def holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, list | tuple):
        return any(holds_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(holds_tensor(v) for v in value.values())
    return False


@pytest.fixture
def got(monkeypatch):
    """Every value `ember.calls.get` hands to the driver's code. In-process actors wait on each
    other with the same `get`, on their own threads (the training rank on the engine it feeds):
    those values stay inside the actors, as they would in Ray's processes, and are left out."""
    real = ember.calls.get
    values: list[Any] = []

    def get(refs: Any, **kwargs: Any) -> Any:
        value = real(refs, **kwargs)
        if not ember.calls.in_local_actor():
            values.append(value)
        return value

    monkeypatch.setattr(ember.calls, "get", get)
    return values


class OnThisMachine(LocalRuntime):
    """The in-process runtime for runs that need Ray in a real run (SGLang engines, whose
    servers Ray places and watches; a colocated GPU layout): the same actor classes, built in
    this process, where no GPU is granted, so their placement is the CPU layout's."""

    def placement(self, config: Any) -> Any:
        cpu = dataclasses.replace(config.ray, gpus_per_rank=0, gpus_per_engine=0)
        return super().placement(dataclasses.replace(config, ray=cpu))


@pytest.fixture
def in_process(monkeypatch, got):
    """Drivers whose actors are `LocalActor`s in this process; every call made to one of them,
    by the driver or by another actor, is recorded by actor."""
    import ember_megatron_backend.parallel as parallel

    called: list[tuple[LocalActor, str]] = []
    real_submit = LocalActor._submit

    def submit(actor: LocalActor, name: str, args: tuple, kwargs: dict) -> Any:
        called.append((actor, name))
        return real_submit(actor, name, args, kwargs)

    monkeypatch.setattr(LocalActor, "_submit", submit)
    # The runtime sizes torch's pool and OMP_NUM_THREADS for the whole process: both go back.
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    threads = torch.get_num_threads()
    had_group = torch.distributed.is_initialized()  # another module's world of one, kept
    drivers: list[Driver] = []
    try:
        yield SimpleNamespace(
            got=got,
            called=lambda actor: [name for a, name in called if a is actor],
            drivers=drivers,
        )
    finally:
        for driver in drivers:
            driver.shutdown()
        torch.set_num_threads(threads)
        if not had_group and torch.distributed.is_initialized():
            parallel.destroy_distributed()


def make_driver(ctx: Any, run_dir: Path, *overrides: str) -> Driver:
    """A driver whose actors live in this process: the in-process runtime where the run asks
    for it (`ray.enabled`), else `OnThisMachine`."""
    config, _ = load_config("default", overrides=[*TINY, *overrides])
    driver = Driver(config, run_dir)
    if not isinstance(driver.runtime, LocalRuntime):
        driver.runtime = OnThisMachine()
    ctx.drivers.append(driver)
    return driver


def trainer_weights(driver: Driver) -> dict[str, torch.Tensor]:
    worker = driver.actors.train[0].instance.worker
    return {name: t.detach().clone() for name, t in worker.hf_weights()}


def perturb(driver: Driver) -> None:
    """Change the trainer's weights, as training would, so a push of stale ones shows."""
    with torch.no_grad():
        for param in driver.actors.train[0].instance.worker.actor.parameters():
            param.add_(0.25)


def sums(weights: dict[str, torch.Tensor]) -> dict[str, float]:
    return {name: float(t.double().sum()) for name, t in weights.items()}


# --------------------------------------------------------------------------------------------
# Fake SGLang servers
# --------------------------------------------------------------------------------------------


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def launcher(tmp_path: Path) -> Path:
    """An executable that `engine.sglang.python` can name: runs the fake server."""
    script = tmp_path / "fake-python"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_SERVER}" "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def sglang_overrides(record: Path) -> list[str]:
    return [
        "engine.kind=sglang",
        "engine.sglang.health_poll_s=0.05",
        "engine.sglang.launch_timeout_s=60",
        f"engine.sglang.server_args=[--record, {record}]",
    ]


@pytest.fixture
def attached_server(tmp_path):
    """A fake SGLang server started by someone else, from a checkpoint of its own."""
    from ember_rollout.config import TinyModelConfig
    from ember_rollout.models import write_tiny_checkpoint

    own = write_tiny_checkpoint(tmp_path / "server_model", TinyModelConfig(vocab_size=17))
    record = tmp_path / "attached.jsonl"
    with fake_server(own, record) as url:
        yield SimpleNamespace(url=url, record=record)


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------


def test_sglang_launches_from_the_trainers_export_and_loads_pushes_from_disk(in_process, tmp_path):
    record = tmp_path / "launched.jsonl"
    driver = make_driver(
        in_process,
        tmp_path / "run",
        *sglang_overrides(record),
        f"engine.sglang.python={launcher(tmp_path)}",
        "weights.transport=disk",
    )
    driver.build()  # the preset has no HF checkpoint: the server starts from the export
    initial = trainer_weights(driver)
    (launch,) = records(record)
    assert launch["model_path"] == str(driver.init_dir)
    assert launch["sums"] == sums(initial)
    engine = driver.actors.engines[0].instance
    assert engine.engine.model_info.num_layers == 2
    driver.load_initial_weights()
    assert len(records(record)) == 1  # it serves them already

    pushed = []
    for rollout_id in (0, 1):
        perturb(driver)
        wanted = trainer_weights(driver)
        in_process.got.clear()
        driver.push_weights(rollout_id)
        assert not any(holds_tensor(v) for v in in_process.got)
        update = records(record)[-1]
        assert update["route"] == "/update_weights_from_disk"
        assert update["weight_version"] == str(rollout_id)
        assert update["sums"] == sums(wanted)
        pushed.append(Path(update["model_path"]))
    assert pushed[0] != pushed[1] and pushed[1].parent == driver.run_dir / "pushed_weights"
    assert list(pushed[1].parent.iterdir()) == [pushed[1]]  # the previous version is gone


def test_servers_launch_from_the_hf_checkpoint_while_the_trainer_starts_then_load_its_export(
    in_process, tmp_path
):
    """A fresh run from `train.hf_load` launches its SGLang server from that checkpoint when the
    engine actor is created, before the trainer has built its model or written `hf_init`
    (`weight_push.early_launch_source`), and loads the trainer's initial weights into it before
    rollout 0, as into an attached server."""
    from ember.actors import RolloutEngine
    from ember_rollout.config import TinyModelConfig
    from ember_rollout.models import write_tiny_checkpoint
    from ember_rollout.tokenizer import save_toy_tokenizer

    own = write_tiny_checkpoint(tmp_path / "model", TinyModelConfig(vocab_size=17, num_layers=2))
    save_toy_tokenizer(own)
    record = tmp_path / "launched.jsonl"
    config, _ = load_config(
        "default",
        overrides=[
            *TINY[1:],  # the checkpoint's shape as it is
            "train.model=null",
            f"train.hf_load={own}",
            *sglang_overrides(record),
            f"engine.sglang.python={launcher(tmp_path)}",
            "weights.transport=disk",
        ],
    )
    driver = Driver(config, tmp_path / "run")
    driver.runtime = OnThisMachine()
    in_process.drivers.append(driver)
    exported: list[bool] = []
    real_launch = RolloutEngine.launch

    def launch(engine: Any, source: str) -> None:
        exported.append((driver.init_dir / "config.json").exists())
        real_launch(engine, source)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RolloutEngine, "launch", launch)
        driver.build()
    assert exported == [False]  # launched before the trainer's export
    (launch,) = records(record)
    assert launch["route"] == "launch" and launch["model_path"] == str(own.resolve())
    # Not the initial weights until the export is loaded: no version of the run's.
    assert launch["weight_version"] == UNLOADED_WEIGHT_VERSION
    engine = driver.actors.engines[0]
    assert not engine.instance.loaded_model_path()

    initial = trainer_weights(driver)
    driver.load_initial_weights()
    (load,) = records(record)[1:]
    assert load["route"] == "/update_weights_from_disk"
    assert load["model_path"] == str(driver.init_dir) and load["weight_version"] == "-1"
    assert load["sums"] == sums(initial)
    driver.shutdown()
    assert engine.instance.launched is None and engine.instance.engine is not None


def test_attached_sglang_serves_the_trainers_weights_from_rollout_0_and_after_resume(
    in_process, tmp_path, attached_server
):
    run_dir = tmp_path / "run"
    overrides = [
        *sglang_overrides(tmp_path / "unused.jsonl"),
        f"engine.sglang.urls=[{attached_server.url}]",
        "engine.sglang.model_path=/nonexistent/model",
        "run.save_interval=1",
        "weights.transport=disk",
    ]
    driver = make_driver(in_process, run_dir, *overrides)
    driver.run()
    log = records(attached_server.record)
    routes = [(r["route"], r.get("weight_version")) for r in log]
    first_generate = routes.index(("/generate", "-1"))
    initial = log[1]
    assert routes[1] == ("/update_weights_from_disk", "-1") and 1 < first_generate
    assert initial["model_path"] == str(driver.init_dir)
    assert initial["sums"] != log[0]["sums"]  # not what the server was started with
    after_rollout_0 = log[-1]
    assert routes[-1] == ("/update_weights_from_disk", "0")
    assert ("/update_weights_from_tensor", None) not in routes
    driver.shutdown()

    # A resumed run pushes the checkpoint's weights before its first rollout, and no others.
    resumed = make_driver(in_process, run_dir, *overrides, "run.num_rollouts=2")
    resumed.run(resume=True)
    log = records(attached_server.record)[len(routes) :]
    routes = [(r["route"], r.get("weight_version")) for r in log]
    assert routes[:2] == [("/update_weights_from_disk", "0"), ("/generate", "0")]
    assert log[0]["sums"] == after_rollout_0["sums"]


def test_ipc_buckets_go_from_the_training_rank_to_its_engine_inside_one_session(
    in_process, tmp_path
):
    """The colocated path (`weights.transport: ipc`) on CPU up to the device call: the driver
    opens the session, `TrainRank.send_weights_ipc` packs flattened buckets and hands them, by
    shared-memory file name where a GPU would pass a CUDA IPC handle, to the sglang engine of its
    GPU, which posts them to a launched server that opens and loads them. Only where the tensors
    live differs from a GPU run (the device check covers that part)."""
    record = tmp_path / "launched.jsonl"
    driver = make_driver(
        in_process,
        tmp_path / "run",
        *sglang_overrides(record),
        f"engine.sglang.python={launcher(tmp_path)}",
        "weights.bucket_mb=1",
        # Wide enough experts that the weights fill several 1 MiB buckets.
        "train.model_overrides.moe_ffn_hidden_size=256",
    )
    driver.build()
    perturb(driver)
    wanted = trainer_weights(driver)
    in_process.got.clear()
    launched = len(records(record))
    driver.pusher.in_session("5", "ipc")
    assert not any(holds_tensor(v) for v in in_process.got)  # the driver holds no weight
    log = records(record)[launched:]
    routes = [r["route"] for r in log]
    updates = [r for r in log if r["route"] == "/update_weights_from_tensor"]
    assert routes == ["/begin_weight_update", *[u["route"] for u in updates], "/end_weight_update"]
    assert len(updates) > 1 and not any("refused" in u for u in updates)
    # Every tensor once, in the trainer's order; the version only with the last bucket.
    assert [n for u in updates for n in u["names"]] == list(wanted)
    assert [u["weight_version"] for u in updates] == [None] * (len(updates) - 1) + ["5"]
    # The bytes go over untouched: the server holds the trainer's weights exactly.
    assert log[-1]["sums"] == sums(wanted)
    (sent,) = [v[0] for v in in_process.got if isinstance(v, list) and v and "buckets" in v[0]]
    assert sent["buckets"] == len(updates)
    assert sent["bytes"] == sum(t.numel() * t.element_size() for t in wanted.values())


def test_a_direct_push_lands_the_trainers_exact_weights_inside_a_session(in_process, tmp_path):
    """`weights.transport: direct`, the default of a run in one process: the training rank hands
    its tensors, in the engine's dtype, to the embedded engine in buckets, inside the session
    the driver opens; a bucket handed over outside a session is refused."""
    import re

    from ember.config import weight_transport
    from ember_rollout.engine import EngineError
    from ember_rollout.hf_engine import OUTSIDE_SESSION
    from ember_rollout.models import _resolve, naming_of

    driver = make_driver(
        in_process,
        tmp_path / "run",
        "ray.enabled=false",
        "weights.bucket_mb=1",
        # Wide enough experts that the weights fill several 1 MiB buckets.
        "train.model_overrides.moe_ffn_hidden_size=256",
    )
    assert type(driver.runtime) is LocalRuntime and weight_transport(driver.config) == "direct"
    driver.build()
    rank, engine = driver.actors.train[0], driver.actors.engines[0]

    def mismatches(wanted: dict[str, torch.Tensor]) -> list[str]:
        """Names whose tensor the engine does not serve (cast to its dtype)."""
        model = engine.instance.engine.model
        state, naming = model.state_dict(), naming_of(model)
        bad = []
        for name, tensor in wanted.items():
            target, _ = _resolve(state, name, tensor, naming)
            if not torch.equal(target, tensor.to(target.dtype)):
                bad.append(name)
        return bad

    perturb(driver)
    wanted = trainer_weights(driver)
    assert mismatches(wanted) == list(wanted)  # the engine still serves the initial weights
    in_process.got.clear()
    before = len(in_process.called(engine))
    driver.push_weights(0)
    assert not any(holds_tensor(v) for v in in_process.got)  # the driver holds no weight
    assert mismatches(wanted) == [] and engine.instance.engine.weight_version == "0"
    pushed = in_process.called(engine)[before:]
    buckets = pushed[1:-1]
    assert pushed[0] == "begin_weight_update" and pushed[-1] == "end_weight_update"
    assert len(buckets) > 1 and set(buckets) == {"update_weights_direct"}
    (sent,) = [v[0] for v in in_process.got if isinstance(v, list) and v and isinstance(v[0], dict)]
    assert sent["buckets"] == len(buckets)
    size = getattr(torch, driver.config.engine.hf.dtype).itemsize  # the engine's dtype
    assert sent["bytes"] == sum(t.numel() * size for t in wanted.values())

    # Outside a session the engine refuses the first bucket and keeps serving version 0.
    perturb(driver)
    with pytest.raises(EngineError, match=re.escape(OUTSIDE_SESSION)):
        ember.calls.get(rank.send_weights_direct.remote([engine], "1"))
    assert mismatches(wanted) == [] and engine.instance.engine.weight_version == "0"


# --------------------------------------------------------------------------------------------
# Broadcast under Ray: the sending rank and the engines in one gloo group
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_session():
    import ray

    from ember import RAY_ENV

    ray.init(
        num_cpus=4,
        include_dashboard=False,
        logging_level="WARNING",
        runtime_env={"env_vars": dict(RAY_ENV)},
    )
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture
def on_ray(ray_session, got):
    """Drivers whose actors are Ray actors, what `get` hands the driver recorded; the test's
    actors are killed after it."""
    ctx = SimpleNamespace(ray=ray_session, got=got, drivers=[])
    try:
        yield ctx
    finally:
        for driver in ctx.drivers:
            actors = driver.actors
            driver.shutdown()
            if actors is not None:
                for actor in [*actors.train, *actors.engines, actors.manager]:
                    ray_session.kill(actor)


def build_on_ray(ctx: Any, run_dir: Path, *overrides: str) -> Driver:
    """A built driver of Ray actors that push by broadcast (the default under Ray, named here
    because these tests are of it)."""
    config, _ = load_config(
        "default", overrides=[*TINY, "ray.enabled=true", "weights.transport=broadcast", *overrides]
    )
    driver = Driver(config, run_dir)
    assert driver.runtime.name == "ray"
    ctx.drivers.append(driver)
    driver.build()
    return driver


def perturb_ranks(ray: Any, driver: Driver) -> None:
    """Change every rank's weights alike, as a training step would."""

    def perturb(rank: Any) -> None:
        import torch

        with torch.no_grad():
            for param in rank.worker.actor.parameters():
                param.add_(0.25)

    ray.get([t.__ray_call__.remote(perturb) for t in driver.actors.train])


def trainer_weights_on_ray(ray: Any, driver: Driver) -> dict[str, torch.Tensor]:
    """Rank 0's weights under HF names (fetched by the test, not by the driver)."""

    def weights(rank: Any) -> list:
        return [(n, t.detach().clone()) for n, t in rank.worker.hf_weights()]

    return dict(ray.get(driver.actors.train[0].__ray_call__.remote(weights)))


def served_mismatches(ray: Any, engine: Any, wanted: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensor the hf engine does not serve (cast to its dtype), and its version."""

    def compare(actor: Any, wanted: dict) -> tuple[list[str], str]:
        from ember_rollout.models import _resolve

        state = actor.engine.model.state_dict()
        bad = []
        for name, tensor in wanted.items():
            target, _ = _resolve(state, name, tensor)
            if not torch.equal(target, tensor.to(target.dtype)):
                bad.append(name)
        return bad, actor.engine.weight_version

    return ray.get(engine.__ray_call__.remote(compare, wanted))


def test_hf_engines_receive_rank_0s_buckets_over_gloo_and_the_driver_holds_no_weight(
    on_ray, tmp_path
):
    driver = build_on_ray(
        on_ray,
        tmp_path,
        "ray.data_parallel=2",
        "ray.num_engines=2",
        "rollout.rollout_batch_size=4",
        "train.model_overrides.moe_ffn_hidden_size=256",  # about 1.7 MB in bf16
        "engine.hf.dtype=bfloat16",  # weights travel in the engine's dtype
        "weights.bucket_mb=1",
    )
    ray, got = on_ray.ray, on_ray.got
    for version in ("0", "1"):
        perturb_ranks(ray, driver)
        wanted = trainer_weights_on_ray(ray, driver)
        got.clear()
        driver.push_weights(int(version))
        assert not any(holds_tensor(v) for v in got)
        # What the ranks answered the driver: rank 0 sent every weight once, in bf16 (the
        # engine's dtype), in buckets of at most 1 MiB; rank 1 sent nothing.
        (sent,) = [v for v in got if isinstance(v, list) and len(v) == 2 and {} in v]
        total = sum(t.numel() * 2 for t in wanted.values())
        assert sent[1] == {} and sent[0]["bytes"] == total > 1 << 20
        assert sent[0]["buckets"] >= -(-total // (1 << 20))
        for engine in driver.actors.engines:
            bad, served = served_mismatches(ray, engine, wanted)
            assert bad == [] and served == version

    def sent(rank: Any) -> tuple[str | None, int]:
        group = rank._weight_group
        return (group.name if group else None), (group.world_size if group else 0)

    (name, world), (other, _) = ray.get([t.__ray_call__.remote(sent) for t in driver.actors.train])
    assert name is not None and world == 3, "rank 0 and two engines, formed once"
    assert other is None, "rank 1 walked the weights and sent nothing"


def test_sglang_servers_receive_broadcasts_the_way_sglang_does(on_ray, tmp_path):
    record = tmp_path / "launched.jsonl"
    driver = build_on_ray(
        on_ray,
        tmp_path / "run",
        *sglang_overrides(record),
        f"engine.sglang.python={launcher(tmp_path)}",
        "weights.bucket_mb=1",
    )
    ray = on_ray.ray

    def node_ip(_: Any) -> str:
        import ray.util

        return ray.util.get_node_ip_address()

    node = ray.get(driver.actors.train[0].__ray_call__.remote(node_ip))
    perturb_ranks(ray, driver)
    wanted = trainer_weights_on_ray(ray, driver)
    on_ray.got.clear()
    driver.push_weights(0)
    assert not any(holds_tensor(v) for v in on_ray.got)

    log = records(record)
    routes = [r["route"] for r in log]
    # The sending rank forms its group on its first push, once the session is open.
    assert routes[:3] == ["launch", "/begin_weight_update", "/init_weights_update_group"]
    join = log[2]
    assert join["master_address"] == node, "the rendezvous is on the sending rank's node"
    assert (join["rank_offset"], join["world_size"], join["backend"]) == (1, 2, "gloo")
    updates = [r for r in log if r["route"] == "/update_weights_from_distributed"]
    assert len(updates) >= 1 and routes[-1] == "/end_weight_update"
    assert all(u["load_format"] == "flattened_bucket" and "refused" not in u for u in updates)
    assert all(u["ignored"] == [] for u in updates), "every name is one the server has"
    assert [u["weight_version"] for u in updates] == [None] * (len(updates) - 1) + ["0"]
    assert [u["flush_cache"] for u in updates] == [False] * (len(updates) - 1) + [True]
    assert sorted(n for u in updates for n in u["names"]) == sorted(wanted)
    assert log[-1]["sums"] == sums(wanted)

    # The next push reuses the group: a session, buckets, and no second join.
    perturb_ranks(ray, driver)
    wanted = trainer_weights_on_ray(ray, driver)
    driver.push_weights(1)
    later = records(record)[len(log) :]
    assert {r["route"] for r in later} == {
        "/begin_weight_update",
        "/update_weights_from_distributed",
        "/end_weight_update",
    }
    assert later[-2]["weight_version"] == "1" and later[-1]["sums"] == sums(wanted)


def test_a_broadcast_that_fails_midway_frees_every_engine_and_the_next_push_regroups(
    on_ray, tmp_path
):
    driver = build_on_ray(
        on_ray,
        tmp_path,
        "ray.num_engines=2",
        "rollout.rollout_batch_size=4",
        "train.model_overrides.moe_ffn_hidden_size=256",
        "weights.bucket_mb=1",
    )
    ray = on_ray.ray
    rank, engines = driver.actors.train[0], driver.actors.engines

    def fail_second_broadcast(actor: Any) -> None:
        # Every engine has been told bucket 2 and waits in its receive; the sender fails. The
        # rank waits as long as it takes for the engines to leave their receive: the abort
        # must free them (it did not while a Work of the group was held: 60 s, the wait's
        # limit then).
        import ember.actors
        from ember_megatron_backend.weight_sync import WeightGroup

        ember.actors.DROP_GROUP_WAIT_S = 3600.0

        real, calls = WeightGroup.broadcast, []

        def broadcast(self: Any, bucket: Any) -> Any:
            calls.append(1)
            if len(calls) == 2:
                WeightGroup.broadcast = real
                raise RuntimeError("injected: bucket 2 failed")
            return real(self, bucket)

        WeightGroup.broadcast = broadcast

    def groups(actor: Any) -> list[str]:
        return sorted(actor.engine._weight_groups)

    def group_name(actor: Any) -> str | None:
        return None if actor._weight_group is None else actor._weight_group.name

    ray.get(rank.__ray_call__.remote(fail_second_broadcast))
    outcome: dict[str, BaseException] = {}

    def push() -> None:
        try:
            driver.push_weights(0)
        except BaseException as exc:
            outcome["error"] = exc

    import threading

    thread = threading.Thread(target=push, daemon=True)
    thread.start()
    thread.join(120)  # the engines' receive would otherwise wait out its 30-minute timeout
    assert not thread.is_alive(), "the failed push left the engines blocked in its broadcast"
    assert "injected: bucket 2 failed" in str(outcome["error"])
    assert ray.get([e.__ray_call__.remote(groups) for e in engines]) == [[], []]
    assert ray.get(rank.__ray_call__.remote(group_name)) is None

    perturb_ranks(ray, driver)
    wanted = trainer_weights_on_ray(ray, driver)
    driver.push_weights(1)
    for engine in engines:
        bad, served = served_mismatches(ray, engine, wanted)
        assert bad == [] and served == "1"
    (name,) = set(sum(ray.get([e.__ray_call__.remote(groups) for e in engines]), []))
    assert name == ray.get(rank.__ray_call__.remote(group_name)), "one new group, all joined"


def test_a_partial_rollout_engine_takes_a_broadcast_while_it_generates(ray_session, tmp_path):
    """`rollout.partial_rollouts`: the engine actor runs the calls a push makes (the driver's
    session, the sending rank's group and buckets, as `TrainRank.send_weights` makes them) on
    its weight thread while `generate` runs, and the sample carries both versions' spans."""
    import datetime
    import time

    import ray

    from ember.actors import WEIGHT_CALLS, PartialRolloutEngine, _meet, engine_actor
    from ember.runtimes import ray_actor
    from ember_megatron_backend.parallel import free_port
    from ember_megatron_backend.weight_sync import WeightGroup, bucket_weights
    from ember_rollout.config import TinyModelConfig
    from ember_rollout.data import PromptRecord
    from ember_rollout.engine import GenerateRequest, SamplingParams
    from ember_rollout.models import iter_checkpoint, write_tiny_checkpoint
    from ember_rollout.rollout import PromptGroup

    overrides = ["rollout.max_staleness=1", "rollout.partial_rollouts=true"]
    config, _ = load_config("default", overrides=[*overrides, "ray.threads_per_actor=1"])
    assert engine_actor(config) is PartialRolloutEngine
    initial = write_tiny_checkpoint(tmp_path / "initial", TinyModelConfig())
    pushed = dict(
        iter_checkpoint(write_tiny_checkpoint(tmp_path / "new", TinyModelConfig(init_seed=1)))
    )
    engine = (
        ray_actor(PartialRolloutEngine)
        .options(num_cpus=0)
        .remote(config.to_dict(), model_path=str(initial), threads=1)
    )

    def slow_decoder(actor: Any) -> None:
        """Count the model's forwards and make each take 10 ms more, so that generation lasts
        seconds whatever the machine's speed."""
        actor.forwards = 0

        def hook(module: Any, args: Any) -> None:
            actor.forwards += 1
            time.sleep(0.01)

        actor.engine.model.register_forward_pre_hook(hook)

    def forwards(actor: Any) -> int:
        return actor.forwards

    try:
        ray.get(engine.start.remote())
        ray.get(engine.__ray_call__.remote(slow_decoder))
        request = GenerateRequest(
            input_ids=[12, 5, 3, 16],
            sampling=SamplingParams(max_new_tokens=300, ignore_eos=True, seed=1),
            name="sample 0",
        )
        group = PromptGroup(PromptRecord(prompt="p"), [12, 5, 3, 16], [request], 0)
        generating = engine.generate.remote([group])
        # The default thread runs `generate`; a probe on the weight thread sees it decode.
        probe = engine.__ray_call__.options(concurrency_group=WEIGHT_CALLS)
        deadline = time.monotonic() + 60
        while ray.get(probe.remote(forwards)) < 5:
            assert time.monotonic() < deadline, "generation never started"
            time.sleep(0.05)

        ray.get(engine.begin_weight_update.remote())
        name, port = "ember-weights-partial", free_port()
        joins = [engine.join_weights_group.remote("127.0.0.1", port, 1, 2, name, "gloo")]
        weight_group = _meet(
            lambda: WeightGroup.create(
                master_address="127.0.0.1",
                master_port=port,
                world_size=2,
                group_name=name,
                backend="gloo",
                timeout=datetime.timedelta(seconds=60),
            ),
            joins,
        )
        buckets = list(bucket_weights(pushed.items(), 256 << 10))
        assert len(buckets) > 1
        for k, bucket in enumerate(buckets):
            last = k == len(buckets) - 1
            loaded = engine.update_weights_from_distributed.remote(
                bucket.names, bucket.dtypes, bucket.shapes, name, "7" if last else None, last
            )
            work = weight_group.broadcast(bucket)
            ray.get(loaded)
            work.wait()
        ray.get(engine.end_weight_update.remote())
        done = ray.get(probe.remote(forwards))
        assert not ray.wait([generating], timeout=0)[0], "the push waited for generate"

        ((sample,),) = ray.get(generating)
        ((start, first), (switch, second)) = sample.weight_versions
        assert (start, first, second) == (0, "-1", "7") and 5 <= switch <= done
        assert sample.weight_version == "-1" and sample.response_length == 300
        bad, served = served_mismatches(ray, engine, pushed)
        assert bad == [] and served == "7"
    finally:
        ray.kill(engine)


# --------------------------------------------------------------------------------------------
# The colocated memory hand-off, wired by Driver.build and Driver.restore
# --------------------------------------------------------------------------------------------


def test_colocated_hand_off_through_build_the_loop_and_restore_with_real_offload(
    in_process, tmp_path, monkeypatch
):
    """A colocated GPU layout (`ray.gpus_per_rank` and `gpus_per_engine` > 0) as `Driver.build`
    wires it, on CPU: the trainer's real `TrainerOffload` moves its CPU storages out and back
    as it would move GPU ones, and the run trains, checkpoints and resumes through it."""
    import ember_megatron_backend.offload as offload

    moved: list[tuple[str, int]] = []
    real_init, real_offload = offload.TrainerOffload.__init__, offload.TrainerOffload.offload
    real_reload = offload.TrainerOffload.reload

    def init(self, worker, *, device_type="cuda"):
        real_init(self, worker, device_type="cpu")  # the storages this machine has

    def offload_part(self, part):
        moved.append((f"offload {part}", real_offload(self, part)))
        return moved[-1][1]

    def reload(self):
        moved.append(("reload", real_reload(self)))
        return moved[-1][1]

    monkeypatch.setattr(offload.TrainerOffload, "__init__", init)
    monkeypatch.setattr(offload.TrainerOffload, "offload", offload_part)
    monkeypatch.setattr(offload.TrainerOffload, "reload", reload)
    # No GPUs here: the actors go where a CPU layout puts them (`OnThisMachine`; placement
    # has its own tests).
    run_dir = tmp_path / "run"
    colocated = ["ray.gpus_per_rank=0.5", "ray.gpus_per_engine=0.5", "run.save_interval=1",
                 "rollout.async=false",  # colocated engines cannot generate during training
                 "weights.transport=disk"]  # fmt: skip
    driver = make_driver(in_process, run_dir, *colocated, "run.num_rollouts=2")
    driver.run()
    assert isinstance(driver.runtime, OnThisMachine) and driver.handoff.enabled
    sizes = dict(moved[:2])
    assert [m for m, _ in moved[:2]] == ["offload training_state", "offload weights"]
    assert sizes["offload weights"] > 0  # the parameters really left
    restored = [b for m, b in moved if m == "reload"]
    assert restored and all(b >= sizes["offload weights"] for b in restored)
    rank = in_process.called(driver.actors.train[0])
    engine = in_process.called(driver.actors.engines[0])
    first = rank.index("prepare")
    assert rank[rank.index("save_tokenizer") + 1 : first] == ["offload", "offload", "reload"]
    assert engine.index("release_memory") < engine.index("resume_memory")
    assert [r["rollout_id"] for r in records(run_dir / "metrics.jsonl") if r["kind"] == "rollout"]\
        == [0, 1]  # fmt: skip
    driver.shutdown()

    # Restore: the trainer reloads before it loads the checkpoint, the push sits between the
    # offloads, and the run goes on.
    moved.clear()
    # On a GPU the optimizer's load_state_dict casts the loaded state onto the parameters'
    # device, into fresh storages; on CPU it keeps torch.load's own, which cannot be resized
    # (so cannot be offloaded): give the CPU run fresh ones too.
    import ember_megatron_backend.checkpoint as checkpoint

    def fresh(value):
        if isinstance(value, torch.Tensor):
            return value.clone()
        if isinstance(value, dict):
            return {k: fresh(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(fresh(v) for v in value)
        return value

    real_load = torch.load
    monkeypatch.setattr(checkpoint.torch, "load", lambda *a, **k: fresh(real_load(*a, **k)))
    resumed = make_driver(in_process, run_dir, *colocated, "run.num_rollouts=3")
    resumed.run(resume=True)
    calls = in_process.called(resumed.actors.train[0])
    load = calls.index("load")
    assert calls[load - 1] == "reload"
    assert calls[load + 1 : load + 4] == ["offload", "export_hf", "offload"]
    assert [m for m, _ in moved][:2] == ["offload training_state", "offload weights"]
    assert [r["rollout_id"] for r in records(run_dir / "metrics.jsonl") if r["kind"] == "rollout"]\
        == [0, 1, 2]  # fmt: skip


@pytest.mark.parametrize(
    ("scheme", "method"),
    [
        (["engine.quantization=fp8_block"], "fp8"),
        (
            ["engine.quantization=int4_w4a16", "engine.quantization_targets=experts"],
            "compressed-tensors",
        ),
    ],
)
def test_quantized_sglang_servers_launch_from_the_quantized_export_and_load_its_pushes(
    in_process, tmp_path, scheme, method
):
    """Under `engine.quantization` the trainer's export is the quantized checkpoint SGLang
    loads (`quantization_config` in config.json, the tensors every push sends), the server
    launches from it naming the scheme, and disk pushes pass the loader rules the fake server
    holds a quantized model to (`sglang_fake_model.ServedModel`). The servers are taken to be
    on GPUs: on CPU the run is refused (neither scheme has a CPU kernel there)."""
    from ember_core.quant import quantize_named

    record = tmp_path / "launched.jsonl"
    driver = make_driver(
        in_process,
        tmp_path / "run",
        *sglang_overrides(record),
        f"engine.sglang.python={launcher(tmp_path)}",
        "engine.sglang.device=cuda",
        "engine.sglang.dtype=bfloat16",
        "engine.quantization_group_size=32",
        "weights.transport=disk",
        *scheme,
    )
    driver.build()
    config = json.loads((driver.init_dir / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == method
    spec = driver.config.engine.quant_spec()

    def served() -> dict[str, float]:
        named = quantize_named(trainer_weights(driver).items(), spec, dtype=torch.bfloat16)
        return sums(dict(named))

    (launch,) = records(record)
    assert launch["model_path"] == str(driver.init_dir) and launch["quantization"] == method
    assert launch["sums"] == served()
    perturb(driver)
    driver.push_weights(0)
    update = records(record)[-1]
    assert update["route"] == "/update_weights_from_disk" and "refused" not in update
    assert update["sums"] == served()
