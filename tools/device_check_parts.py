"""The device check's hand-off parts: what a colocated run moves between the trainer and the
engines, on one GPU (`tools/device_check.py` runs them; each has a CPU dry-run form).

- offload_checkpoint: the trainer after a training step (bf16 with megatron-core's optimizer on
  a GPU) offloads both parts, writes a checkpoint from its host copies while offloaded (what a
  colocated run's save does), reloads, is perturbed, and loads the checkpoint: weights and
  optimizer state must come back bit for bit. On a GPU it also records the device memory the
  offload freed, and the seconds of each step. The dry run's torch AdamW goes into
  megatron-core's own `ChainedOptimizer` (what `get_megatron_optimizer` returns on a GPU)
  before the offload, so the offload, the checkpoint and the perturbation reach the state
  through the interface the GPU run has: a `ProxyDict` with `items()` and no `values()`.
- ipc: one flattened bucket of the actor's weights pickled as SGLang's
  /update_weights_from_tensor takes it (`serialize_flattened_bucket`: CUDA IPC handles, the
  device named by UUID), opened in a second, spawned process that maps the UUID back to its own
  device index as sglang 0.5.23 utils/patch_torch.py does; the receiver's per-tensor sums must
  equal the sender's, and a bucket on a device no other process can open (meta) is refused. The
  dry run sends a CPU bucket through the same serializer, which pickles it as a shared-memory
  file (torch's "file_system" strategy): the protocol up to the device call.
- broadcast_hf: the embedded hf engine (bf16, on the check's device) joins a gloo weight group
  with the trainer as rank 0, takes every bucket of changed weights inside a weight-update
  session, and must then serve exactly the trainer's weights (cast to bf16) and the new version.
"""

from __future__ import annotations

import asyncio
import base64
import io
import pickle
import tempfile
import time
from typing import Any

IPC_BUCKET_BYTES = 4 << 20
"""Size of the bucket the ipc part hands over."""


def _nest_to_cpu(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _nest_to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_nest_to_cpu(v) for v in value)
    return value


def _nest_diffs(a: Any, b: Any, where: str = "") -> list[str]:
    """Where two nests of tensors differ (dtype, shape or any bit of a value)."""
    import torch

    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or not torch.equal(a, b):
            return [where or "."]
        return []
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return [where or "."]
        return [d for k in a for d in _nest_diffs(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, list | tuple):
        if not isinstance(b, list | tuple) or len(a) != len(b):
            return [where or "."]
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in _nest_diffs(x, y, f"{where}/{i}")
        ]
    return [] if a == b else [where or "."]


def as_chained_optimizer(optimizer: Any) -> Any:
    """`optimizer` inside megatron-core's `ChainedOptimizer`, unless it is one already.

    megatron-core 0.16.1 `get_megatron_optimizer` (optimizer/__init__.py 689) always returns a
    ChainedOptimizer, whose `state` is a `ProxyDict` over its optimizers' states
    (optimizer/optimizer.py 1038-1073, 1125-1131) and whose single-optimizer `state_dict` and
    `load_state_dict` are the inner optimizer's (1178-1182, 1216-1220). It builds on the CPU
    around a torch optimizer, so the dry run's AdamW can stand behind the same interface.
    """
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    return optimizer if isinstance(optimizer, ChainedOptimizer) else ChainedOptimizer([optimizer])


def perturb_optimizer_state(optimizer: Any, by: float = 1.0) -> int:
    """Add `by` to every floating-point tensor of `optimizer.state`; returns how many moved.

    Through `state.items()`: megatron-core's ChainedOptimizer.state is a ProxyDict, which has
    `items()` but no `values()` (megatron-core 0.16.1 optimizer/optimizer.py 1038-1073).
    """
    import torch

    moved = 0
    for _, state in optimizer.state.items():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                value.add_(by)
                moved += 1
    return moved


def _device_bytes(device: str) -> int | None:
    import torch

    if device != "cuda":
        return None
    torch.cuda.synchronize()
    return int(torch.cuda.memory_allocated())


def part_offload_checkpoint(part: Any, sizes: Any) -> None:
    import torch
    from device_check import ensure_distributed, model_shape
    from gpu_support import megatron_worker, synthetic_samples

    from ember_megatron_backend.offload import TrainerOffload

    ensure_distributed()
    worker = megatron_worker(dtype=sizes.dtype, model_overrides=sizes.model_overrides)
    worker.train(0, worker.prepare(0, synthetic_samples(0, **model_shape(sizes))))
    if sizes.device != "cuda":
        # The step is taken; from here on the CPU's AdamW answers as megatron-core's does.
        worker.actor_optimizer.optimizer = as_chained_optimizer(worker.actor_optimizer.optimizer)
    params = [p.detach().to("cpu", copy=True) for p in worker.actor.parameters()]
    optimizer = _nest_to_cpu(worker.actor_optimizer.state_dict())
    offload = TrainerOffload(worker, device_type=sizes.device)

    before = _device_bytes(sizes.device)
    started = time.perf_counter()
    freed_state = offload.offload("training_state")
    freed_weights = offload.offload("weights")
    offload_s = time.perf_counter() - started
    after = _device_bytes(sizes.device)
    empty = all(p.untyped_storage().nbytes() == 0 for p in worker.actor.parameters())
    with tempfile.TemporaryDirectory(prefix="ember-device-check-") as tmp:
        started = time.perf_counter()
        directory = worker.save_checkpoint(tmp, host_view=offload.host_view)
        save_s = time.perf_counter() - started
        written = sum(f.stat().st_size for f in directory.iterdir())
        still_empty = all(p.untyped_storage().nbytes() == 0 for p in worker.actor.parameters())
        started = time.perf_counter()
        restored = offload.reload()
        reload_s = time.perf_counter() - started
        with torch.no_grad():
            for p in worker.actor.parameters():
                p.add_(1.0)
        perturbed = perturb_optimizer_state(worker.actor_optimizer.optimizer)
        started = time.perf_counter()
        worker.load_checkpoint(tmp)
        load_s = time.perf_counter() - started
    weight_diffs = [
        i
        for i, (a, b) in enumerate(zip(worker.actor.parameters(), params, strict=True))
        if a.dtype != b.dtype or not torch.equal(a.cpu(), b)
    ]
    state_diffs = _nest_diffs(_nest_to_cpu(worker.actor_optimizer.state_dict()), optimizer)
    part.record(
        optimizer=worker.actor_optimizer.kind,
        optimizer_class=type(worker.actor_optimizer.optimizer).__name__,
        param_dtype=str(params[0].dtype).removeprefix("torch."),
        offload_device=sizes.device,
        freed_training_state_bytes=freed_state,
        freed_weight_bytes=freed_weights,
        device_bytes_before_offload=before,
        device_bytes_after_offload=after,
        parameters_empty_while_saving=empty and still_empty,
        checkpoint_bytes=written,
        restored_bytes=restored,
        offload_seconds=offload_s,
        save_seconds=save_s,
        reload_seconds=reload_s,
        load_seconds=load_s,
        parameters=len(params),
        optimizer_state_tensors_perturbed=perturbed,
        parameters_differing_after_load=len(weight_diffs),
        optimizer_state_differences=state_diffs[:5],
    )
    if sizes.device == "cuda":
        part.expect(worker.actor_optimizer.kind == "megatron", "not megatron-core's optimizer")
        part.expect(
            before - after >= freed_state + freed_weights - (1 << 20),
            f"device bytes {before} -> {after}",
        )
    chained = type(worker.actor_optimizer.optimizer).__name__
    part.expect(chained == "ChainedOptimizer", f"the optimizer is a {chained}")
    part.expect(freed_state > 0 and freed_weights > 0, f"freed {freed_state}, {freed_weights}")
    part.expect(empty and still_empty, "parameters held device bytes while offloaded")
    part.expect(restored == freed_state + freed_weights, f"restored {restored}")
    part.expect(perturbed > 0, "no optimizer state tensor was perturbed before the load")
    part.expect(not weight_diffs, f"parameters {weight_diffs[:5]} differ after the load")
    part.expect(not state_diffs, f"optimizer state differs at {state_diffs[:5]}")


def _rebuild_by_uuid(*args: Any) -> Any:
    """torch's `rebuild_cuda_tensor`, with the device given by UUID mapped to this process's
    index first (sglang 0.5.23 utils/patch_torch.py `_device_from_maybe_uuid`)."""
    import torch
    from torch.multiprocessing import reductions

    device = args[6]
    if isinstance(device, str):
        found = [
            i
            for i in range(torch.cuda.device_count())
            if str(torch.cuda.get_device_properties(i).uuid) == device
        ]
        if not found:
            raise RuntimeError(f"no device with uuid {device} in the receiver")
        args = (*args[:6], found[0], *args[7:])
    return reductions.rebuild_cuda_tensor(*args)


class _ReceiverUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return _rebuild_by_uuid
        return super().find_class(module, name)


def receive_bucket(payload: str) -> dict[str, Any]:
    """In the receiving process: open the bucket and cut it by its metadata, as sglang 0.5.23's
    `_update_weights_from_flattened_bucket` does; per-tensor float64 sums and the device."""
    import torch

    torch.multiprocessing.set_sharing_strategy("file_system")
    obj = _ReceiverUnpickler(io.BytesIO(base64.b64decode(payload))).load()
    flat = obj["flattened_tensor"]
    sums = {}
    for meta in obj["metadata"]:
        part = flat[meta.start_idx : meta.end_idx].view(meta.dtype).reshape(meta.shape)
        sums[meta.name] = float(part.double().sum())
    if flat.is_cuda:
        torch.cuda.synchronize()
    device = str(flat.device)
    uuid = str(torch.cuda.get_device_properties(flat.device).uuid) if flat.is_cuda else None
    return {"sums": sums, "device": device, "uuid": uuid}


def part_ipc(part: Any, sizes: Any) -> None:
    import torch
    from device_check import ensure_distributed
    from gpu_support import megatron_worker

    from ember_megatron_backend.weight_sync import bucket_weights
    from ember_rollout.sglang_weights import serialize_flattened_bucket

    ensure_distributed()
    worker = megatron_worker(dtype=sizes.dtype, model_overrides=sizes.model_overrides)
    bucket = next(iter(bucket_weights(worker.hf_weights(), IPC_BUCKET_BYTES, device=sizes.device)))
    wanted = {}
    for name, dtype, shape, (start, end) in zip(
        bucket.names, bucket.dtypes, bucket.shapes, _spans(bucket), strict=True
    ):
        view = bucket.flat[start:end].view(getattr(torch, dtype)).reshape(shape)
        wanted[name] = float(view.double().sum())
    started = time.perf_counter()
    # The serializer the engine client uses: CUDA buckets as IPC handles, CPU buckets as the
    # name of a shared-memory file (sglang_weights.IPC_DEVICE_TYPES).
    payload = serialize_flattened_bucket(bucket.flat, bucket.names, bucket.dtypes, bucket.shapes)
    if sizes.device == "cuda":
        sender_uuid = str(torch.cuda.get_device_properties(bucket.flat.device).uuid)
    else:
        sender_uuid = None
    try:  # a device no other process can open is refused before anything is pickled
        serialize_flattened_bucket(
            torch.empty(bucket.nbytes, dtype=torch.uint8, device="meta"),
            bucket.names,
            bucket.dtypes,
            bucket.shapes,
        )
        refusal = None
    except ValueError as exc:
        refusal = str(exc)
    serialize_s = time.perf_counter() - started
    context = torch.multiprocessing.get_context("spawn")
    started = time.perf_counter()
    with context.Pool(1) as pool:
        got = pool.apply(receive_bucket, (payload,))
    receive_s = time.perf_counter() - started
    gaps = [abs(got["sums"].get(n, float("nan")) - s) for n, s in wanted.items()]
    part.record(
        tensors=len(bucket.names),
        bucket_bytes=bucket.nbytes,
        payload_chars=len(payload),
        sender_device=str(bucket.flat.device),
        sender_uuid=sender_uuid,
        receiver_device=got["device"],
        receiver_uuid=got["uuid"],
        max_abs_sum_diff=max(gaps),
        names_received=sorted(got["sums"]) == sorted(wanted),
        meta_bucket_refusal=refusal,
        serialize_seconds=serialize_s,
        receive_seconds=receive_s,
    )
    part.expect(sorted(got["sums"]) == sorted(wanted), "the receiver cut other tensors")
    part.expect(max(gaps) == 0.0, f"per-tensor sums differ by up to {max(gaps)}")
    if sizes.device == "cuda":
        part.expect(got["uuid"] == sender_uuid, f"receiver on {got['uuid']}, sender {sender_uuid}")
    part.expect(refusal is not None, "a bucket on the meta device was not refused")


def _spans(bucket: Any) -> list[tuple[int, int]]:
    import torch

    spans, offset = [], 0
    for dtype, shape in zip(bucket.dtypes, bucket.shapes, strict=True):
        size = torch.Size(shape).numel() * getattr(torch, dtype).itemsize
        spans.append((offset, offset + size))
        offset += size
    return spans


BROADCAST_BUCKET_BYTES = 256 << 10
"""Bucket size of the check's broadcasts: small, so that every model takes several."""


async def push_by_broadcast(
    engine: Any, weights: Any, *, version: str, dtype: Any, group_name: str = "ember-device-check"
) -> dict[str, Any]:
    """Push `weights()` ((name, tensor) pairs) into `engine` as a run's broadcast transport
    does: the engine joins a fresh gloo weight group as rank 1 with this process as rank 0,
    takes every bucket (cast to `dtype`) inside one weight-update session, the last naming
    `version`, and leaves the group. Returns the buckets, bytes and seconds of the session."""
    import datetime

    from ember_megatron_backend.parallel import free_port
    from ember_megatron_backend.weight_sync import WeightGroup, bucket_weights

    port = free_port()
    join = asyncio.create_task(
        engine.init_weights_update_group(
            master_address="127.0.0.1",
            master_port=port,
            rank_offset=1,
            world_size=2,
            group_name=group_name,
            backend="gloo",
        )
    )
    group = await asyncio.to_thread(
        WeightGroup.create,
        master_address="127.0.0.1",
        master_port=port,
        world_size=2,
        group_name=group_name,
        backend="gloo",
        timeout=datetime.timedelta(minutes=2),
    )
    await join
    try:
        started, buckets, sent = time.perf_counter(), 0, 0
        await engine.begin_weight_update()
        items = list(bucket_weights(weights(), BROADCAST_BUCKET_BYTES, dtype=dtype, device="cpu"))
        for i, bucket in enumerate(items):
            last = i == len(items) - 1
            load = asyncio.create_task(
                engine.update_weights_from_distributed(
                    bucket.names,
                    bucket.dtypes,
                    bucket.shapes,
                    group_name=group_name,
                    weight_version=version if last else None,
                    flush_cache=last,
                )
            )
            await asyncio.to_thread(lambda b=bucket: group.broadcast(b).wait())
            await load
            buckets, sent = buckets + 1, sent + bucket.nbytes
        await engine.end_weight_update()
        seconds = time.perf_counter() - started
    finally:
        await engine.destroy_weights_update_group(group_name)
        group.abort()
    return {"buckets": buckets, "bytes": sent, "seconds": seconds}


def part_broadcast_hf(part: Any, sizes: Any) -> None:
    import torch
    from device_check import ensure_distributed
    from gpu_support import megatron_worker

    from ember_rollout import HFEngineConfig
    from ember_rollout.hf_engine import HFEngine
    from ember_rollout.models import _resolve
    from ember_rollout.tokenizer import save_toy_tokenizer

    ensure_distributed()
    worker = megatron_worker(dtype=sizes.dtype, model_overrides=sizes.model_overrides)

    async def run(path: str) -> dict[str, Any]:
        config = HFEngineConfig(model_path=path, dtype="bfloat16", device=sizes.device)
        async with HFEngine(config) as engine:
            await engine.start()
            with torch.no_grad():
                for p in worker.actor.parameters():
                    p.add_(0.01)
            wanted = {
                n: t.detach().to("cpu", torch.bfloat16, copy=True) for n, t in worker.hf_weights()
            }
            pushed = await push_by_broadcast(
                engine, worker.hf_weights, version="1", dtype=torch.bfloat16
            )
            state = engine.model.state_dict()
            bad = [
                n
                for n, t in wanted.items()
                if not torch.equal(
                    _resolve(state, n, t)[0].cpu(), t.to(_resolve(state, n, t)[0].dtype)
                )
            ]
            return {
                **pushed,
                "tensors": len(wanted),
                "mismatched": bad[:5],
                "served_version": engine.weight_version,
                "engine_device": str(next(engine.model.parameters()).device),
            }

    with tempfile.TemporaryDirectory(prefix="ember-device-check-") as tmp:
        worker.export_hf(tmp, dtype=torch.bfloat16)
        save_toy_tokenizer(tmp)
        got = asyncio.run(run(tmp))
    part.record(**{f"broadcast_{k}" if k in ("seconds", "bytes") else k: v for k, v in got.items()})
    part.expect(got["buckets"] > 1, f"{got['buckets']} bucket(s): the model fits in one")
    part.expect(not got["mismatched"], f"engine weights differ: {got['mismatched']}")
    part.expect(got["served_version"] == "1", f"engine serves version {got['served_version']!r}")
    part.expect(got["engine_device"].startswith(sizes.device), f"engine on {got['engine_device']}")
