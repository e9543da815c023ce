"""The `weights` section: which transport carries the trainer's weights, and what is refused."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from ember.config import load_config, weight_group_backend, weight_transport

SGLANG = ["engine.kind=sglang"]
COLOCATED_GPUS = [
    "ray.gpus_per_rank=0.5",
    "ray.gpus_per_engine=0.5",
    # What a colocated GPU layout needs besides (`ember.placement.plan_layout`, which
    # load_config runs): rollout and training in turn, and SGLang's memory saver.
    "rollout.async=false",
    "engine.sglang.server_args=[--enable-memory-saver]",
]


def transport(*overrides: str) -> str:
    config, _ = load_config("default", overrides=list(overrides))
    return weight_transport(config)


def test_defaults_follow_the_engine_and_the_placement():
    config, _ = load_config("default")
    assert (config.weights.transport, config.weights.bucket_mb) == ("auto", 512)
    assert config.weights.bucket_bytes == 512 << 20
    assert transport() == "direct"  # the embedded engine, on CPU, in one process
    assert transport("ray.enabled=true") == "broadcast"  # the same under Ray
    assert transport("ray.num_engines=2") == "broadcast"  # engines of their own: Ray
    assert transport(*SGLANG) == "broadcast"  # disaggregated servers
    assert transport(*SGLANG, *COLOCATED_GPUS) == "ipc"  # on the training ranks' GPUs
    assert transport(*SGLANG, *COLOCATED_GPUS, "ray.colocate=false") == "broadcast"
    assert transport("weights.transport=disk") == "disk"
    assert transport(*SGLANG, *COLOCATED_GPUS, "weights.transport=disk") == "disk"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["weights.transport=ipc"],
            r"weights\.transport=ipc: CUDA IPC handles reach SGLang servers only; ",
        ),
        (
            [*SGLANG, "weights.transport=ipc"],
            r"weights\.transport=ipc: the engines must sit on the training ranks'",
        ),
        (
            [*SGLANG, *COLOCATED_GPUS, "weights.transport=ipc", "ray.num_engines=2"],
            r"weights\.transport=ipc: training rank i feeds engine i, and "
            r"ray.num_engines=2 > ray.data_parallel=1",
        ),
        (
            [*SGLANG, *COLOCATED_GPUS, "weights.transport=broadcast"],
            r"weights\.transport=broadcast: with ray.colocate true on GPUs, "
            r".* NCCL cannot hold two ranks",
        ),
        (["weights.transport=tensors"], r"weights\.transport='tensors': expected auto or one of"),
        (["weights.bucket_mb=0"], r"weights\.bucket_mb=0: expected an integer >= 1"),
        (
            ["weights.transport=direct", "ray.enabled=true"],
            r"weights\.transport=direct copies tensors within one process, and this run's "
            r"roles are Ray actors \(ray\.enabled=true\)",
        ),
        (
            ["ray.enabled=false", "ray.num_engines=2"],
            r"ray\.enabled=false: ray\.num_engines=2: each engine is a process",
        ),
        (["ray.enabled=maybe"], r"ray\.enabled: 'maybe' is not one of 'auto', True, False"),
    ],
)
def test_impossible_combinations_fail_naming_weights_transport(overrides, message):
    with pytest.raises(ValueError, match=rf"^{message}"):
        load_config("default", overrides=overrides)


GPU_TRAINER = ["ray.gpus_per_rank=1"]
GPU_ENGINES = ["ray.gpus_per_engine=1", "ray.colocate=false"]
ATTACHED = ["engine.sglang.urls=[http://127.0.0.1:1]"]


@pytest.mark.parametrize(
    ("overrides", "trainer_on_gpu", "backend"),
    [
        # Launched servers on GPUs of their own, fed by a GPU trainer: NCCL.
        ([*SGLANG, *GPU_TRAINER, *GPU_ENGINES], True, "nccl"),
        # An engine actor granted no GPU sees none, so its launched server runs on the CPU.
        ([*SGLANG, *GPU_TRAINER], True, "gloo"),
        ([*SGLANG, *GPU_TRAINER, *GPU_ENGINES, "engine.sglang.device=cpu"], True, "gloo"),
        # Attached servers: on GPUs unless the device says cpu.
        ([*SGLANG, *ATTACHED], True, "nccl"),
        ([*SGLANG, *ATTACHED, "engine.sglang.device=cpu"], True, "gloo"),
        # A CPU trainer, and the embedded engine, always use gloo.
        ([*SGLANG, *GPU_ENGINES], False, "gloo"),
        ([*GPU_TRAINER, *GPU_ENGINES], True, "gloo"),
    ],
)
def test_the_weight_group_backend_follows_both_ends_devices(overrides, trainer_on_gpu, backend):
    config, _ = load_config("default", overrides=["rollout.async=false", *overrides])
    assert weight_group_backend(config, trainer_on_gpu=trainer_on_gpu) == backend


class _Call:
    """A Ray actor method stand-in: `.remote(...)` records the call and returns a ref."""

    def __init__(self, calls: list[tuple[Any, ...]], result: Any) -> None:
        self.calls, self.result = calls, result

    def remote(self, *args: Any) -> Any:
        self.calls.append(args)
        return self.result


def test_a_gpu_trainer_forms_a_gloo_group_with_a_cpu_sglang_server(monkeypatch):
    """The sending rank's `_join_engines` on a GPU, with the SGLang engine granted no GPU (its
    launched server runs on the CPU): trainer and server must both be told gloo. NCCL there
    fails in torch's ProcessGroupNCCL constructor on the server ("ProcessGroupNCCL is only
    supported with GPUs, no GPUs found!"), at the first push."""
    import ember.actors
    import ember.calls
    import ember_megatron_backend.parallel
    import ember_megatron_backend.weight_sync

    config, _ = load_config(
        "default", overrides=["rollout.async=false", *SGLANG, "ray.gpus_per_rank=1"]
    )
    created: list[dict[str, Any]] = []
    monkeypatch.setattr(ember.calls, "get", lambda refs: refs)
    monkeypatch.setattr(
        ember.calls, "wait", lambda pending, num_returns, timeout=None: (pending[:1], pending[1:])
    )
    monkeypatch.setattr(ember_megatron_backend.parallel, "uses_gpu", lambda: True)
    monkeypatch.setattr(
        ember_megatron_backend.weight_sync.WeightGroup,
        "create",
        classmethod(lambda cls, **kwargs: created.append(kwargs) or "group"),
    )
    joins: list[tuple[Any, ...]] = []
    engine = SimpleNamespace(
        weight_group_size=_Call([], 1), join_weights_group=_Call(joins, "joined")
    )
    cls = ember.actors.TrainRank
    rank = cls.__new__(cls)
    rank.config = config

    assert rank._join_engines([engine]) == "group"
    assert [kw["backend"] for kw in created] == ["gloo"] and created[0]["world_size"] == 2
    (join,) = joins  # address, port, rank offset, world size, group name, backend
    assert join[2:4] == (1, 2) and join[5] == "gloo"
