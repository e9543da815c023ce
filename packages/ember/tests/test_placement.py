"""Placement groups on Ray's own multi-node test cluster, and the colocated memory hand-off.

One cluster for the module (`ray.cluster_utils.Cluster`): the head node, which the driver joins,
and a worker node, each with 8 fake GPUs, as the 16-GPU example's two 8-GPU nodes. Small probe
actors created with the placement's options report the node and GPU ids Ray gave them. The
hand-off's order is checked against `fake_sglang_server.py`, which refuses generation and
weight loads into released memory as SGLang would fail on them.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import ray
from fake_server_process import fake_server as running_fake_server
from ray.util.placement_group import placement_group, placement_group_table
from test_cluster_examples import load_example

import ember  # noqa: F401  (sets RAY_ENV before any Ray process starts)
from ember.config import load_config
from ember.placement import (
    COLOCATED,
    ROLLOUT,
    TRAIN,
    MemoryHandoff,
    Node,
    Placement,
    assign_nodes,
    plan_layout,
)

pytestmark = pytest.mark.slow


@ray.remote
class Probe:
    """Reports where Ray put it."""

    def where(self) -> dict[str, Any]:
        import os

        return {
            "node": ray.get_runtime_context().get_node_id(),
            "gpus": [int(g) for g in ray.get_gpu_ids()],
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "address": ray.util.get_node_ip_address(),
        }

    def visible_after_setup(self) -> str | None:
        """CUDA_VISIBLE_DEVICES once the process is set up as every Ember actor is."""
        import os

        from ember.actors import _prepare_process

        _prepare_process(None)
        return os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    if ray.is_initialized():
        ray.shutdown()
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 8})
    worker = nodes.add_node(num_cpus=1, num_gpus=8)
    nodes.wait_for_nodes()
    ray.init(address=nodes.address, include_dashboard=False, logging_level="WARNING")
    try:
        yield {"head": nodes.head_node.node_id, "worker": worker.node_id}
    finally:
        ray.shutdown()
        nodes.shutdown()


def probe(placement: Placement, *, ranks: int = 0, engines: int = 0) -> list[dict[str, Any]]:
    """Where probe actors with the options of `ranks` ranks, `engines` engines and the rollout
    manager land (in that order); the actors are gone afterwards."""
    actors = [Probe.options(**placement.train_options(r)).remote() for r in range(ranks)]
    actors += [Probe.options(**placement.engine_options(j)).remote() for j in range(engines)]
    actors.append(Probe.options(**placement.manager_options()).remote())
    try:
        return ray.get([a.where.remote() for a in actors], timeout=120)
    finally:
        for actor in actors:
            ray.kill(actor)


def live_groups() -> set[str]:
    return {
        pg["name"]
        for pg in placement_group_table().values()
        if pg["name"].startswith("ember-") and pg["state"] != "REMOVED"
    }


def config_of(*overrides: str):
    """The default config with `overrides`, rollout and training in turn unless they say
    otherwise (the default overlaps them, which shared GPUs refuse)."""
    return load_config("default", overrides=["rollout.async=false", *overrides])[0]


# --------------------------------------------------------------------------------------------
# The examples on the fake cluster
# --------------------------------------------------------------------------------------------


def test_the_16gpu_example_lands_where_its_comments_say(cluster, tmp_path):
    _, config, _ = load_example("qwen3_30b_a3b_r3_16gpu", tmp_path)
    placement = Placement.create(config)
    try:
        assert live_groups() == {"ember-train", "ember-rollout"}
        where = probe(placement, ranks=8, engines=1)
    finally:
        placement.remove()
    ranks, (engine, manager) = where[:8], where[8:]
    # training: ranks 0-7 on the node `ember train` runs on (the head), rank i on GPU i
    assert [r["node"] for r in ranks] == [cluster["head"]] * 8
    assert [r["gpus"] for r in ranks] == [[i] for i in range(8)]
    assert [r["visible"] for r in ranks] == [str(i) for i in range(8)]
    # rollout: the one SGLang engine on the other node, all 8 of its GPUs (TP 8 from GPU 0)
    assert engine["node"] == cluster["worker"]
    assert engine["gpus"] == list(range(8)) and engine["visible"] == "0,1,2,3,4,5,6,7"
    # the rollout manager: the driver's node, no GPU
    assert manager["node"] == cluster["head"] and manager["gpus"] == []
    # what placement says before the actors start is where they are
    assert [placement.train_node(r).node_id for r in range(8)] == [r["node"] for r in ranks]
    assert placement.engine_node(0).node_id == engine["node"]
    assert placement.rendezvous_host() == ranks[0]["address"]
    assert live_groups() == set()


def test_the_1gpu_example_shares_one_gpu_between_rank_and_engine(cluster, tmp_path):
    _, config, _ = load_example("moe_r3_1gpu", tmp_path)
    placement = Placement.create(config)
    try:
        assert live_groups() == {"ember-colocated"}
        shares = [placement.train_options(0)["num_gpus"], placement.engine_options(0)["num_gpus"]]
        rank, engine, manager = probe(placement, ranks=1, engines=1)
    finally:
        placement.remove()
    # rank 0 and engine 0 take half of bundle 0 each: the same GPU of the driver's node
    assert shares == [0.5, 0.5]
    assert rank["node"] == engine["node"] == manager["node"] == cluster["head"]
    assert rank["gpus"] == engine["gpus"] == [0] and rank["visible"] == engine["visible"] == "0"


def test_a_1gpu_node_holds_the_colocated_layout_and_nothing_larger(tmp_path):
    _, config, _ = load_example("moe_r3_1gpu", tmp_path)
    layout = plan_layout(config)
    assert layout.bundles == {COLOCATED: [1]} and layout.gpus == 1
    node = Node("n" * 56, "10.0.0.1", 1)
    assert assign_nodes(layout, [node]) == {COLOCATED: [node]}
    config.ray.colocate = False  # the same shares on GPUs of their own: 2 GPUs
    with pytest.raises(ValueError, match=r"needs 2 GPUs .* the cluster has 1 \(10\.0\.0\.1"):
        assign_nodes(plan_layout(config), [node])


def test_cpu_runs_create_no_placement_group(cluster):
    placement = Placement.create(config_of())
    assert placement.groups == {} and live_groups() == set()
    assert (
        placement.train_options(0)
        == placement.engine_options(0)
        == {
            "num_cpus": 0,
            "num_gpus": 0,
        }
    )
    assert placement.train_node(0) is None and placement.rendezvous_host() is None
    rank, engine, manager = probe(placement, ranks=1, engines=1)
    assert rank["gpus"] == engine["gpus"] == manager["gpus"] == []
    assert manager["node"] == cluster["head"]


# --------------------------------------------------------------------------------------------
# Layouts that cannot work fail before anything starts
# --------------------------------------------------------------------------------------------


def test_more_gpus_than_the_cluster_has_fails_with_the_arithmetic(cluster):
    config = config_of(
        "ray.data_parallel=8", "ray.gpus_per_rank=1", "ray.colocate=false",
        "ray.num_engines=2", "ray.gpus_per_engine=8",
    )  # fmt: skip
    with pytest.raises(ValueError) as info:
        Placement.create(config)
    message = str(info.value)
    assert "needs 24 GPUs" in message
    assert "ray.data_parallel 8 x ray.gpus_per_rank 1 = 8 GPUs" in message
    assert "ray.num_engines 2 x ray.gpus_per_engine 8 = 16 GPUs, 8 on one node" in message
    assert "the cluster has 16" in message and message.count(": 8") == 2  # both nodes listed
    assert live_groups() == set()


def test_an_engine_larger_than_any_node_fails_naming_the_nodes(cluster):
    config = config_of("ray.num_engines=1", "ray.gpus_per_engine=16", "ray.colocate=false")
    with pytest.raises(
        ValueError, match=r"bundle 0 of rollout needs 16 GPUs on one node.*at most 8"
    ):
        Placement.create(config)
    assert live_groups() == set()


def test_bundles_that_do_not_pack_fail_although_the_total_fits():
    config = config_of("ray.num_engines=3", "ray.gpus_per_engine=5", "ray.colocate=false")
    nodes = [Node("a" * 56, "10.0.0.1", 8), Node("b" * 56, "10.0.0.2", 8)]
    with pytest.raises(
        ValueError, match=r"bundle \d of rollout needs 5 GPUs on one node.*at most 3"
    ):
        assign_nodes(plan_layout(config), nodes)
    # two such engines fit, and the training ranks fill the GPUs they leave on both nodes
    config = config_of(
        "ray.num_engines=2", "ray.gpus_per_engine=5", "ray.colocate=false",
        "ray.data_parallel=6", "ray.gpus_per_rank=1",
    )  # fmt: skip
    placed = assign_nodes(plan_layout(config), nodes)
    assert [n.address for n in placed[ROLLOUT]] == ["10.0.0.2", "10.0.0.1"]
    assert [n.address for n in placed[TRAIN]] == ["10.0.0.1"] * 3 + ["10.0.0.2"] * 3


def test_busy_gpus_time_out_and_leave_nothing_behind(cluster, tmp_path):
    _, config, _ = load_example("qwen3_30b_a3b_r3_16gpu", tmp_path)
    blocker = placement_group(
        [{"GPU": 1}],
        name="other-job",
        bundle_label_selector=[{"ray.io/node-id": cluster["worker"]}],
    )
    ray.get(blocker.ready(), timeout=60)
    try:
        with pytest.raises(TimeoutError, match=r"\['rollout'\] within ray.placement_timeout_s=1s"):
            Placement.create(config, timeout_s=1)
    finally:
        ray.util.remove_placement_group(blocker)
    assert live_groups() == set()


def test_half_a_run_holds_no_gpu_for_the_other_half(tmp_path):
    gpus = ("ray.colocate=false", "ray.gpus_per_rank=1", "ray.gpus_per_engine=1")
    assert set(plan_layout(config_of(*gpus)).bundles) == {TRAIN, ROLLOUT}
    rollout_only = plan_layout(config_of(*gpus, "run.rollout_only=true"))
    assert rollout_only.bundles == {ROLLOUT: [1]} and rollout_only.train is None
    from_dump = plan_layout(config_of(*gpus, f"run.train_from_rollouts={tmp_path}"))
    assert from_dump.bundles == {TRAIN: [1]} and from_dump.engines is None


def test_engine_shares_pack_onto_gpus_ranks_never_do_and_bad_shares_name_the_key():
    layout = plan_layout(
        config_of(
            "ray.colocate=false",
            "ray.data_parallel=3",
            "ray.gpus_per_rank=0.6",
            "ray.num_engines=5",
            "ray.gpus_per_engine=0.25",
        )  # fmt: skip
    )
    assert layout.bundles == {TRAIN: [1, 1, 1], ROLLOUT: [1, 1]}
    assert [s.bundle for s in layout.train] == [0, 1, 2]
    assert [s.bundle for s in layout.engines] == [0, 0, 0, 0, 1]
    assert "4 engines per GPU = 2 GPUs" in layout.arithmetic[1]
    # One rank may take a share of its GPU; two on one GPU would be one NCCL group on one
    # device, which NCCL refuses (2.30.7 src/init.cc 1057: "Multiple Ranks are using the same
    # GPU/Partition").
    assert plan_layout(config_of("ray.colocate=false", "ray.gpus_per_rank=0.25")).train
    bad = [
        (
            ["ray.colocate=false", "ray.data_parallel=3", "ray.gpus_per_rank=0.4"],
            "ray.gpus_per_rank=0.4: expected 1, or a share above 0.5: 2 of the data_parallel 3 "
            "ranks would share one GPU, and NCCL refuses two ranks of one group on one GPU",
        ),
        (  # CPU engines: not colocated either
            ["ray.data_parallel=2", "ray.gpus_per_rank=0.5"],
            "ray.gpus_per_rank=0.5: expected 1, or a share above 0.5",
        ),
        (
            ["ray.gpus_per_rank=2"],
            "ray.gpus_per_rank=2.0: expected 0 (CPU), a share of one GPU, or 1",
        ),
        (["ray.gpus_per_engine=1.5"], "ray.gpus_per_engine=1.5: expected 0 (CPU), a share"),
        (
            ["ray.gpus_per_rank=0.6", "ray.gpus_per_engine=0.6"],
            "ray.gpus_per_engine=0.6: expected at most 1 - gpus_per_rank = 0.4 with colocate: true",
        ),
    ]
    for overrides, message in bad:
        with pytest.raises(ValueError, match=re.escape(message)):
            config_of(*overrides)


def test_launched_sglang_servers_packed_onto_one_gpu_are_refused_in_one_line():
    """Two launched SGLang servers on one GPU cannot run, whatever their memory fractions:
    sglang 0.5.23 sizes each KV pool from the memory free before the others loaded
    (mem_cache/kv_cache_configurator.py 3007, 3038; distributed/bootstrap.py 207), so the
    next server raises "Loaded weights leave no GPU memory for the KV cache" (3043-3059), and
    with a GPU trainer NCCL 2.30.7 refuses two ranks of the weight group on one GPU
    (src/init.cc 1057)."""
    packed = [
        "ray.colocate=false", "ray.num_engines=3", "ray.gpus_per_engine=0.3",
        "engine.kind=sglang", "engine.sglang.model_path=/m",
    ]  # fmt: skip
    refusal = (
        "ray.gpus_per_engine=0.3: with ray.colocate=false it puts 3 of the ray.num_engines=3 "
        "launched SGLang servers on one GPU, which cannot run (sglang sizes each server's KV "
        "pool from the GPU memory free before the others loaded, so the next finds none, and "
        "NCCL refuses two ranks of the weight group on one GPU); give each engine a GPU "
        "(ray.gpus_per_engine=1, or a share above 0.5), or attach servers you started "
        "(engine.sglang.urls)"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(refusal)}$"):
        config_of(*packed)
    # A memory fraction that adds up to one GPU does not make it work: the pool is sized from
    # the memory free, not from the fraction alone.
    for fraction in ("0.3", "0.1"):
        with pytest.raises(ValueError, match=r"puts 3 of the ray.num_engines=3 launched"):
            config_of(*packed, f"engine.sglang.mem_fraction_static={fraction}")
    # Two engines at 0.3 (or 0.5) share a GPU as well, with a CPU trainer too.
    for share in ("0.3", "0.5"):
        with pytest.raises(ValueError, match=r"puts 2 of the ray.num_engines=2 launched"):
            config_of(*packed[:1], "ray.num_engines=2", f"ray.gpus_per_engine={share}", *packed[3:])
    with pytest.raises(ValueError, match=r"puts 3 of the ray.num_engines=3 launched"):
        config_of(*packed, "ray.gpus_per_rank=1")
    # One server per GPU: a lone engine's share, or shares above 0.5.
    layout = plan_layout(config_of(*packed[:1], "ray.num_engines=1", *packed[2:]))
    assert layout.bundles == {"rollout": [1]}
    layout = plan_layout(config_of(*packed[:2], "ray.gpus_per_engine=0.6", *packed[3:]))
    assert [s.bundle for s in layout.engines] == [0, 1, 2]
    # Attached servers and the embedded engine still pack three to a GPU.
    for overrides in (
        [*packed[:4], "engine.sglang.urls=[http://127.0.0.1:1]"],
        packed[:3],
    ):
        layout = plan_layout(config_of(*overrides))
        assert [s.bundle for s in layout.engines] == [0, 0, 0]


def test_colocated_gpu_layouts_refuse_what_cannot_share():
    shared = ["ray.gpus_per_rank=0.5", "ray.gpus_per_engine=0.5"]
    with pytest.raises(ValueError, match="rollout.async=true with ray.colocate=true"):
        plan_layout(config_of(*shared, "rollout.async=true"))
    with pytest.raises(ValueError, match="need --enable-memory-saver"):
        plan_layout(config_of(*shared, "engine.kind=sglang", "engine.sglang.model_path=/m"))
    ok = config_of(
        *shared, "engine.kind=sglang", "engine.sglang.model_path=/m",
        "engine.sglang.server_args=[--enable-memory-saver]",
    )  # fmt: skip
    assert plan_layout(ok).bundles == {COLOCATED: [1]}
    with pytest.raises(ValueError, match=r"tp_size 4 x .*num_servers 1 = 4 GPUs per engine"):
        plan_layout(
            config_of(
                "ray.colocate=false",
                "ray.gpus_per_engine=8",
                "engine.kind=sglang",
                "engine.sglang.model_path=/m",
                "engine.sglang.tp_size=4",
            )  # fmt: skip
        )


# --------------------------------------------------------------------------------------------
# Colocated memory hand-off, in order, against the fake SGLang server
# --------------------------------------------------------------------------------------------


@ray.remote(num_cpus=0)
class EngineStub:
    """An engine actor as the driver sees one: a real sglang engine attached to the fake."""

    def __init__(self, url: str) -> None:
        from ember_rollout.config import SGLangEngineConfig
        from ember_rollout.sglang_engine import SGLangEngine

        self.loop = asyncio.new_event_loop()
        config = SGLangEngineConfig(urls=[url], health_poll_s=0.05, max_retries=0)
        self.engine = SGLangEngine(config)
        self.loop.run_until_complete(self.engine.start())

    def generate(self) -> list[int]:
        from ember_rollout.engine import GenerateRequest, SamplingParams

        request = GenerateRequest(input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=2))
        return self.loop.run_until_complete(self.engine.generate([request]))[0].output_ids

    def release_memory(self, tags: list[str] | None) -> None:
        self.loop.run_until_complete(self.engine.release_memory(tags))

    def resume_memory(self, tags: list[str] | None) -> None:
        self.loop.run_until_complete(self.engine.resume_memory(tags))

    def update_weights_from_disk(self, path: str, version: str) -> None:
        self.loop.run_until_complete(
            self.engine.update_weights_from_disk(path, weight_version=version)
        )


@ray.remote(num_cpus=0)
class TrainerStub:
    """A training rank's offload calls, written to the fake server's record as they happen."""

    def __init__(self, record: str) -> None:
        self.record = Path(record)

    def _log(self, route: str) -> None:
        with self.record.open("a") as handle:
            handle.write(json.dumps({"route": route}) + "\n")

    def offload(self, part: str) -> None:
        self._log(f"trainer offload {part}")

    def reload(self) -> None:
        self._log("trainer reload")

    def train(self) -> None:
        self._log("trainer train")


@pytest.fixture
def fake_server(tmp_path):
    from ember_rollout.config import TinyModelConfig
    from ember_rollout.models import write_tiny_checkpoint

    model = write_tiny_checkpoint(tmp_path / "model", TinyModelConfig(vocab_size=17))
    record = tmp_path / "record.jsonl"
    with running_fake_server(model, record) as url:
        yield url, record, model


def timeline(record: Path) -> list[str]:
    out = []
    for line in record.read_text().splitlines():
        entry = json.loads(line)
        route = entry["route"]
        if route == "launch":
            continue
        if "tags" in entry:
            route += " " + ",".join(entry["tags"])
        if "refused" in entry:
            route += " REFUSED"
        out.append(route)
    return out


def test_colocated_hand_off_runs_in_order_against_the_fake_server(cluster, fake_server):
    url, record, model = fake_server
    engine, trainer = EngineStub.remote(url), TrainerStub.remote(str(record))
    config = config_of("ray.gpus_per_rank=0.5", "ray.gpus_per_engine=0.5")
    handoff = MemoryHandoff.for_run(config, [engine], [trainer])
    assert handoff.enabled

    def push(version: str):
        return lambda: ray.get(engine.update_weights_from_disk.remote(str(model), version))

    handoff.to_rollout()
    for rollout_id in range(2):
        ray.get(engine.generate.remote())
        handoff.to_training()
        if rollout_id == 0:  # the fake refuses to generate into released memory
            with pytest.raises(ray.exceptions.RayTaskError, match="memory is released"):
                ray.get(engine.generate.remote())
        ray.get(trainer.train.remote())
        handoff.after_training(push(str(rollout_id)))
    ray.get(engine.generate.remote())
    ray.kill(engine)
    ray.kill(trainer)

    one_iteration = [
        "/generate",
        "/release_memory_occupation weights,kv_cache,cuda_graph",
        "trainer reload",
    ]
    refused = ["/generate REFUSED"]
    rest = [
        "trainer train",
        "trainer offload training_state",
        "/resume_memory_occupation weights",
        "/update_weights_from_disk",
        "trainer offload weights",
        "/resume_memory_occupation kv_cache,cuda_graph",
    ]
    assert timeline(record) == (
        ["trainer offload training_state", "trainer offload weights"]
        + one_iteration + refused + rest
        + one_iteration + rest
        + ["/generate"]
    )  # fmt: skip


def test_without_shared_gpus_the_hand_off_only_pushes(cluster, fake_server):
    url, record, model = fake_server
    engine, trainer = EngineStub.remote(url), TrainerStub.remote(str(record))
    for config in (
        config_of(),
        config_of("ray.colocate=false", "ray.gpus_per_rank=1", "ray.gpus_per_engine=1"),
    ):
        handoff = MemoryHandoff.for_run(config, [engine], [trainer])
        assert not handoff.enabled
        handoff.to_rollout()
        ray.get(engine.generate.remote())
        handoff.to_training()
        handoff.after_training(
            lambda: ray.get(engine.update_weights_from_disk.remote(str(model), "0"))
        )
    ray.kill(engine)
    ray.kill(trainer)
    assert timeline(record) == ["/generate", "/update_weights_from_disk"] * 2


# --------------------------------------------------------------------------------------------
# The driver's loop goes through the hand-off
# --------------------------------------------------------------------------------------------


class Recorder:
    """An actor handle whose `method.remote(*args)` records "name.method args" and answers
    from `answers`."""

    def __init__(self, calls: list[str], name: str, **answers: Any) -> None:
        self.calls, self.name, self.answers = calls, name, answers

    def __getattr__(self, attr: str) -> Any:
        def remote(*args: Any) -> Any:
            words = (a if isinstance(a, list) else [a] for a in args)
            shown = [",".join(w) for w in words if w and all(isinstance(t, str) for t in w)]
            self.calls.append(" ".join([f"{self.name}.{attr}", *shown]))
            return self.answers.get(attr)

        return type("Method", (), {"remote": staticmethod(remote)})()


def test_the_driver_iterates_through_the_colocated_hand_off(tmp_path, monkeypatch):
    import ember.calls
    from ember.driver import Actors, Driver
    from ember_core.types import Sample
    from ember_rollout.rollout import RolloutBatch

    # The recorders answer at once: a call's answer is its own result.
    monkeypatch.setattr(ember.calls, "get", lambda refs: refs)
    config = config_of(
        "ray.gpus_per_rank=0.5",
        "ray.gpus_per_engine=0.5",
        "rollout.rollout_batch_size=1",
        "rollout.n_samples_per_prompt=2",
        f"run.dir={tmp_path}",
    )
    samples = [
        Sample(tokens=[1, 2], response_length=1, index=i, weight_version="-1") for i in range(2)
    ]
    calls: list[str] = []
    rank = Recorder(calls, "rank", prepare={}, train=[{}])
    engine = Recorder(calls, "engine")
    manager = Recorder(calls, "manager", generate=RolloutBatch(samples))
    driver = Driver(config, tmp_path)
    driver.actors = Actors(train=[rank], engines=[engine], manager=manager)
    driver.handoff = MemoryHandoff.for_run(config, [engine], [rank])
    monkeypatch.setattr(driver.pusher, "push", lambda rollout_id: calls.append("push"))

    driver.iteration(0)
    assert [c.split(" ")[0] for c in calls] == [
        "manager.generate",
        "engine.release_memory",  # every engine releases all its memory...
        "rank.reload",  # ...before the trainer takes it back
        "rank.prepare",
        "rank.train",
        "rank.offload",
        "engine.resume_memory",
        "push",  # the new weights go into the engines' resumed weight memory
        "rank.offload",
        "engine.resume_memory",
    ]
    assert calls[5:] == [
        "rank.offload training_state",
        "engine.resume_memory weights",
        "push",
        "rank.offload weights",
        "engine.resume_memory kv_cache,cuda_graph",
    ]


def test_actors_granted_no_gpu_see_none_and_the_others_see_theirs(cluster):
    # ray 2.60 leaves CUDA_VISIBLE_DEVICES alone for actors with no GPU ids
    # (_private/utils.py 289-291): without Ember's own step they would see every GPU.
    placement = Placement.create(config_of("ray.gpus_per_engine=1", "ray.colocate=false"))
    try:
        actors = [
            Probe.options(**placement.train_options(0)).remote(),
            Probe.options(**placement.engine_options(0)).remote(),
            Probe.options(**placement.manager_options()).remote(),
        ]
        rank, engine, manager = ray.get([a.visible_after_setup.remote() for a in actors])
        granted = ray.get(actors[1].where.remote())["gpus"]
        for actor in actors:
            ray.kill(actor)
    finally:
        placement.remove()
    assert rank == "" and manager == ""
    assert len(granted) == 1 and engine == str(granted[0])
