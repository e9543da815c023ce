"""NCCL's device rule on a CPU machine: the backend's collectives must run on the group's GPU.

torch 2.14 registers an ``"nccl"`` process group for the ``cuda`` device type only, and its
collectives refuse a CPU tensor ("No backend type associated with device type cpu"). A CPU
machine has no GPU, so ``NcclDeviceCheck`` stands one in: torch's lazy-tensor device, which
holds real values on the CPU. While installed, every group reports backend ``"nccl"``, the
backend's ``comm`` module is told that NCCL's device is the lazy device, and the collectives
that ember's backend code calls (directly or through ``comm``) accept only tensors on that
device. Accepted calls run on real gloo through CPU copies and write the result back; refused
ones are recorded (and still run, so a run finishes and reports every refusal). Collectives
called by megatron-core or torch themselves run unchanged.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

ACCELERATOR = torch.device("lazy", 0)
_BACKEND = "ember_megatron_backend"
_COMM = "ember_megatron_backend.comm"


def _init_lazy() -> None:
    import torch._lazy.ts_backend

    torch._lazy.ts_backend.init()


class NcclDeviceCheck:
    """Install with ``with NcclDeviceCheck() as check:``; read ``check.accepted`` / ``refused``."""

    def __init__(self) -> None:
        self.accepted: list[str] = []
        """Who asked for each accepted collective: the backend function outside ``comm``."""
        self.refused: list[str] = []
        """Each refused call: who, which collective, the offending tensor's device."""
        self._saved: dict[tuple[Any, str], Any] = {}

    def __enter__(self) -> NcclDeviceCheck:
        from ember_megatron_backend import comm

        _init_lazy()
        self._patch(dist, "get_backend", lambda group=None: dist.Backend.NCCL)
        self._patch(comm, "_nccl_device", lambda: ACCELERATOR)
        real_all_reduce, real_all_gather = dist.all_reduce, dist.all_gather
        real_broadcast = dist.broadcast

        def all_reduce(tensor: Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, **kw):
            if not self._checked(sys._getframe(1), "all_reduce", [tensor]):
                return real_all_reduce(tensor, op=op, group=group, **kw)
            return self._on_cpu(lambda ts: real_all_reduce(ts[0], op=op, group=group), [tensor])

        def all_gather(tensors: list[Tensor], tensor: Tensor, group: Any = None, **kw):
            if not self._checked(sys._getframe(1), "all_gather", [tensor, *tensors]):
                return real_all_gather(tensors, tensor, group=group, **kw)
            return self._on_cpu(
                lambda ts: real_all_gather(ts[1:], ts[0], group=group), [tensor, *tensors]
            )

        def broadcast(tensor: Tensor, src: Any = None, group: Any = None, **kw):
            if not self._checked(sys._getframe(1), "broadcast", [tensor]):
                return real_broadcast(tensor, src=src, group=group, **kw)
            return self._on_cpu(lambda ts: real_broadcast(ts[0], src=src, group=group), [tensor])

        self._patch(dist, "all_reduce", all_reduce)
        self._patch(dist, "all_gather", all_gather)
        self._patch(dist, "broadcast", broadcast)
        return self

    def __exit__(self, *exc: Any) -> None:
        for (owner, name), value in self._saved.items():
            setattr(owner, name, value)
        self._saved.clear()

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._saved.setdefault((owner, name), getattr(owner, name))
        setattr(owner, name, value)

    def _checked(self, frame: Any, collective: str, tensors: list[Tensor]) -> bool:
        """Record the call if ember's backend made it; whether it did."""
        if not frame.f_globals.get("__name__", "").startswith(_BACKEND):
            return False
        while frame.f_globals.get("__name__") == _COMM:
            frame = frame.f_back
        who = f"{frame.f_globals['__name__'].rsplit('.', 1)[-1]}.{frame.f_code.co_qualname}"
        wrong = [t.device for t in tensors if t.device != ACCELERATOR]
        if wrong:
            self.refused.append(
                f"{who}: {collective} got a tensor on {wrong[0]} (no backend type associated "
                f"with device type {wrong[0].type})"
            )
        else:
            self.accepted.append(who)
        return True

    @staticmethod
    def _on_cpu(run: Any, tensors: list[Tensor]) -> None:
        """Run a gloo collective on CPU copies of `tensors`, then write the results back."""
        copies = [t.detach().to("cpu") for t in tensors]
        run(copies)
        with torch.no_grad():
            for t, c in zip(tensors, copies, strict=True):
                t.copy_(c)
