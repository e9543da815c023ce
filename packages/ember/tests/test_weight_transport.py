"""The `weights` section: which transport carries the trainer's weights, and what is refused."""

from __future__ import annotations

import pytest

from ember.config import load_config, weight_transport

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
    assert transport() == "broadcast"  # the embedded engine, on CPU
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
    ],
)
def test_impossible_combinations_fail_naming_weights_transport(overrides, message):
    with pytest.raises(ValueError, match=rf"^{message}"):
        load_config("default", overrides=overrides)
