"""Flattened weight buckets and the sender's process group, against an sglang-style receiver."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ember_megatron_backend.parallel import free_port
from ember_megatron_backend.weight_sync import (
    WeightBucket,
    WeightGroup,
    bucket_weights,
    dtype_name,
)

RECEIVER = Path(__file__).with_name("sglang_receiver.py")


def weights():
    return [
        ("a", torch.arange(6, dtype=torch.float32).reshape(2, 3)),  # 24 bytes
        ("b", torch.full((4,), 7.0)),  # 16 bytes
        ("c", torch.ones(2, 2, dtype=torch.bfloat16)),  # 8 bytes, another dtype
        ("d", torch.arange(10, dtype=torch.bfloat16)),  # 20 bytes
        ("e", torch.zeros(12, dtype=torch.bfloat16)),  # 24 bytes: alone over the limit
    ]


def unflatten(bucket: WeightBucket) -> dict[str, torch.Tensor]:
    """Cut a bucket as sglang's FlattenedTensorBucket does: offsets from dtypes and shapes."""
    out, offset = {}, 0
    for name, dtype, shape in zip(bucket.names, bucket.dtypes, bucket.shapes, strict=True):
        dtype = getattr(torch, dtype)
        size = torch.Size(shape).numel() * dtype.itemsize
        out[name] = bucket.flat[offset : offset + size].view(dtype).reshape(shape)
        offset += size
    assert offset == bucket.nbytes
    return out


def test_buckets_keep_order_size_and_one_dtype_each():
    buckets = list(bucket_weights(weights(), 40))
    assert [b.names for b in buckets] == [["a", "b"], ["c", "d"], ["e"]]
    assert [b.nbytes for b in buckets] == [40, 28, 24]
    assert [b.dtypes for b in buckets] == [["float32"] * 2, ["bfloat16"] * 2, ["bfloat16"]]
    assert buckets[0].shapes == [[2, 3], [4]]
    assert all(b.flat.dtype == torch.uint8 and b.flat.dim() == 1 for b in buckets)
    got = {k: v for b in buckets for k, v in unflatten(b).items()}
    for name, tensor in weights():
        assert torch.equal(got[name], tensor), name
    # The first bucket's bytes are a's then b's, as raw little-endian float32.
    assert bytes(buckets[0].flat[:4].tolist()) == torch.tensor([0.0]).numpy().tobytes()


def test_one_large_bucket_and_a_cast_to_the_engines_dtype():
    (bucket,) = bucket_weights(weights(), 1 << 20, dtype=torch.bfloat16)
    assert bucket.names == list("abcde") and set(bucket.dtypes) == {"bfloat16"}
    assert bucket.nbytes == (6 + 4 + 4 + 10 + 12) * 2
    assert torch.equal(unflatten(bucket)["a"], weights()[0][1].bfloat16())


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="bucket_bytes=0"):
        list(bucket_weights(weights(), 0))
    with pytest.raises(ValueError, match="'a' appears twice"):
        list(bucket_weights([*weights(), ("a", torch.zeros(1))], 1 << 20))
    assert dtype_name(torch.float8_e4m3fn) == "float8_e4m3fn"


@pytest.mark.slow  # a receiver subprocess
def test_an_sglang_style_receiver_joins_the_senders_group_and_gets_every_bucket(tmp_path):
    """Two receiver processes join as sglang servers do (ranks 1 and 2 of 3); the group, its
    store keys and the bucket layout must all match for them to receive the right bytes."""
    buckets = list(bucket_weights(weights(), 40))
    plan = json.dumps([{"names": b.names, "dtypes": b.dtypes, "shapes": b.shapes} for b in buckets])
    port = free_port()
    outs = [tmp_path / f"rank{r}.pt" for r in (1, 2)]
    receivers = [
        subprocess.Popen(
            [sys.executable, str(RECEIVER), "127.0.0.1", str(port), str(rank), "3"]
            + ["ember-weights-test", str(out), plan]
        )
        for rank, out in zip((1, 2), outs, strict=True)
    ]
    try:
        group = WeightGroup.create(
            master_address="127.0.0.1",
            master_port=port,
            world_size=3,
            group_name="ember-weights-test",
            backend="gloo",
            timeout=datetime.timedelta(seconds=60),
        )
        for bucket in buckets:
            group.broadcast(bucket).wait()
        for process in receivers:
            assert process.wait(timeout=60) == 0
    finally:
        for process in receivers:
            process.kill()
    for out in outs:
        got = torch.load(out)
        assert list(got) == list("abcde")
        for name, tensor in weights():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_the_group_refuses_a_bucket_on_the_wrong_device():
    group = WeightGroup("g", "nccl", 2, pg=None, store=None)
    (bucket,) = bucket_weights(weights()[:1], 1 << 20)
    with pytest.raises(ValueError, match=r"weight group g \(nccl\) sends cuda tensors"):
        group.broadcast(bucket)
    with pytest.raises(ValueError, match="world_size=1"):
        WeightGroup.create(
            master_address="127.0.0.1",
            master_port=1,
            world_size=1,
            group_name="g",
            backend="gloo",
            timeout=datetime.timedelta(seconds=1),
        )
