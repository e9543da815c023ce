"""A training rank's GPU memory handed to colocated engines while they generate, and taken back.

Plain torch: every storage (the memory under a tensor and all its views) is copied into a host
buffer, then shrunk to zero bytes with `UntypedStorage.resize_(0)`; reload grows it back and
copies the bytes in. Tensor objects, views and references all stay valid: parameters, the
`main_grad` views DDP keeps into its gradient buffer, optimizer state keyed by parameter. So
neither megatron-core nor the optimizer is rebuilt, and megatron-core 0.16.1 frees its own DDP
gradient buffers the same way (distributed/distributed_data_parallel.py
`offload_grad_buffers`). The host buffers are pinned on GPU machines and kept between rounds.

Why not torch-memory-saver (what SGLang uses on the engine side, and slime and verl on the
trainer side): it frees only memory allocated inside its `region()` through its own allocator
(an LD_PRELOAD hook present when the process starts, or a pluggable-allocator memory pool), so
the worker's models, DDP buffers and optimizer would all have to be built inside a region in
an actor launched with the hook; it drops the contents unless asked to back them up; and it
needs CUDA, so no CPU test could run it. What it frees beyond the storages named here
(allocator fragments, stray tensors) does not justify that, and storages keep their objects,
so its unchanged virtual addresses buy nothing here. It is not a dependency of this package;
it comes with the `[sglang]` extra, for the servers.

Two parts, offloaded separately so the weights can still be pushed after the training state is
gone (`ember.placement.MemoryHandoff`):

- "training_state": optimizer moments and the optimizer's own parameter copies (fp32 master
  weights of bf16 models), kept in host memory; gradients (DDP's `main_grad` buffers and the
  optimizer parameters' `.grad`) are dropped and come back as zeros, since every step starts
  from zero gradients.
- "weights": the parameters and buffers of the actor, the reference and the critic, kept.

Only storages on `device_type` ("cuda" by default) move, so on a CPU run every call is a no-op.

While offloaded, a tensor has no bytes to read: a checkpoint taken then is written from the
host copies (`host_view`), since `torch.save` of the tensors themselves writes empty storages
that `torch.load` cannot rebuild.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

PARTS = ("training_state", "weights")
"""What `TrainerOffload.offload` moves, in the order a hand-off moves them."""


@dataclass(slots=True)
class _Held:
    storage: torch.UntypedStorage
    nbytes: int
    backup: Tensor | None
    """uint8 host copy of the bytes; None: dropped, reloaded as zeros."""


def _bytes(storage: torch.UntypedStorage) -> Tensor:
    """The storage as one uint8 tensor over all its bytes."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _key(storage: torch.UntypedStorage) -> int:
    # torch 2.14: the address of the StorageImpl that the tensor and all its views share; it
    # stays the same across resize_, which only swaps the allocation underneath.
    return storage._cdata


def _tensors(value: Any) -> Iterator[Tensor]:
    """Every tensor in a nest of dicts, lists and tuples (optimizer state)."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)


class StorageOffload:
    """Frees the `device_type` memory under sets of tensors and restores it, keeping every
    tensor object valid. Host buffers are reused from one offload to the next."""

    def __init__(self, device_type: str = "cuda") -> None:
        self.device_type = device_type
        self._held: dict[int, _Held] = {}
        self._backups: dict[int, Tensor] = {}

    @property
    def offloaded_bytes(self) -> int:
        """Device bytes freed and not reloaded yet."""
        return sum(h.nbytes for h in self._held.values())

    def _storages(self, tensors: Iterable[Tensor], skip: set[int]) -> dict[int, Any]:
        found: dict[int, Any] = {}
        for tensor in tensors:
            storage = tensor.untyped_storage()
            key = _key(storage)
            if (
                storage.device.type == self.device_type
                and storage.nbytes() > 0
                and key not in self._held
                and key not in skip
            ):
                found.setdefault(key, storage)
        return found

    def offload(
        self, keep: Iterable[Tensor], drop: Iterable[Tensor] = (), *, skip: Iterable[Tensor] = ()
    ) -> int:
        """Free the memory of `keep` (copied to host first) and `drop` (not copied), except
        storages shared with `skip` or already offloaded. Returns the bytes freed."""
        skipped = {_key(t.untyped_storage()) for t in skip}
        kept = self._storages(keep, skipped)
        dropped = {k: s for k, s in self._storages(drop, skipped).items() if k not in kept}
        if not kept and not dropped:
            return 0
        cuda = self.device_type == "cuda"
        for key, storage in kept.items():
            backup = self._backups.get(key)
            if backup is None or backup.numel() != storage.nbytes():
                backup = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=cuda)
                self._backups[key] = backup
            backup.copy_(_bytes(storage), non_blocking=cuda)
            self._held[key] = _Held(storage, storage.nbytes(), backup)
        for key, storage in dropped.items():
            self._held[key] = _Held(storage, storage.nbytes(), None)
        if cuda:
            torch.cuda.synchronize()  # the copies read the memory about to be freed
        freed = 0
        for key in [*kept, *dropped]:
            held = self._held[key]
            held.storage.resize_(0)
            freed += held.nbytes
        if cuda:
            torch.cuda.empty_cache()  # hand the blocks back to the driver, for the engines
        return freed

    def host_view(self, value: Any) -> Any:
        """`value` (a nest of dicts, lists and tuples, as a checkpoint payload is) with every
        offloaded tensor replaced by a CPU tensor over its host copy: same dtype, shape,
        strides and offset, views of one storage sharing one copy. A dropped storage reads as
        the zeros `reload` would give. Nothing is moved back to the device.

        An offloaded tensor itself must not be read: its storage has zero bytes, so
        `torch.save` writes an empty storage that `torch.load` cannot rebuild ("Trying to
        resize storage that is not resizable").
        """
        if self.device_type == "cuda" and self._held:
            torch.cuda.synchronize()  # the copies into the pinned buffers are asynchronous
        return self._host_view(value)

    def _host_view(self, value: Any) -> Any:
        if isinstance(value, Tensor):
            held = self._held.get(_key(value.untyped_storage()))
            if held is None:
                return value
            if held.backup is None:
                return torch.zeros(value.shape, dtype=value.dtype)
            storage = held.backup.untyped_storage()
            view = torch.empty(0, dtype=value.dtype)
            return view.set_(storage, value.storage_offset(), value.shape, value.stride())
        if isinstance(value, dict):
            out = type(value)((k, self._host_view(v)) for k, v in value.items())
            if hasattr(value, "_metadata"):  # nn.Module.state_dict's per-module versions
                out._metadata = value._metadata  # type: ignore[attr-defined]
            return out
        if isinstance(value, list | tuple):
            return type(value)(self._host_view(v) for v in value)
        return value

    def reload(self) -> int:
        """Give every offloaded storage its memory back, with its bytes (or zeros where
        dropped). Returns the bytes restored."""
        restored = 0
        for held in self._held.values():
            held.storage.resize_(held.nbytes)
            data = _bytes(held.storage)
            if held.backup is None:
                data.zero_()
            else:
                data.copy_(held.backup, non_blocking=self.device_type == "cuda")
            restored += held.nbytes
        if self.device_type == "cuda" and restored:
            torch.cuda.synchronize()
        self._held.clear()
        return restored


class TrainerOffload:
    """Offload and reload of a `MegatronWorker`'s models and optimizers, in `PARTS`."""

    def __init__(self, worker: Any, *, device_type: str = "cuda") -> None:
        self.worker = worker
        self.storage = StorageOffload(device_type)

    def _models(self) -> list[Any]:
        w = self.worker
        return [m for m in (w.actor, w.ref, w.critic) if m is not None]

    def _optimizers(self) -> list[Any]:
        w = self.worker
        found = [o for o in (w.actor_optimizer, w.critic_optimizer) if o is not None]
        # ModelOptimizer.optimizer: torch's AdamW, or megatron-core's optimizer, whose
        # `param_groups` and `state` reach the inner torch optimizer(s) it wraps or chains.
        return [o.optimizer for o in found]

    def _weights(self) -> list[Tensor]:
        # nn.Module.buffers by name: megatron-core's DDP has a `buffers` attribute of its own
        # (its gradient buffers), which hides the method.
        return [t for m in self._models() for t in (*m.parameters(), *torch.nn.Module.buffers(m))]

    def offload(self, part: str) -> int:
        """Free the GPU memory of `part` (one of `PARTS`); returns the bytes freed.

        Raises:
            ValueError: `part` is not one of `PARTS`.
        """
        if part not in PARTS:
            raise ValueError(f"offload part {part!r}: expected one of {list(PARTS)}")
        weights = self._weights()
        if part == "weights":
            return self.storage.offload(weights)
        params = [p for o in self._optimizers() for g in o.param_groups for p in g["params"]]
        state = [t for o in self._optimizers() for _, s in o.state.items() for t in _tensors(s)]
        grads = [p.grad for p in params if p.grad is not None]
        grads += [
            p.main_grad
            for m in self._models()
            for p in m.parameters()
            if getattr(p, "main_grad", None) is not None
        ]
        # Parameters that are the model's own (fp32 models) belong to "weights".
        return self.storage.offload([*state, *params], grads, skip=weights)

    @property
    def offloaded(self) -> bool:
        """Whether any part is offloaded (and not reloaded yet)."""
        return self.storage.offloaded_bytes > 0

    def host_view(self, value: Any) -> Any:
        """`StorageOffload.host_view`: a checkpoint payload readable while offloaded."""
        return self.storage.host_view(value)

    def reload(self) -> int:
        """Bring back every offloaded part; returns the bytes restored."""
        return self.storage.reload()
