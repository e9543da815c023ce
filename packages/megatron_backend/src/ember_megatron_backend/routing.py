"""Routing agreement: does the actor's own top-k expert choice match the rollout engine's?

The metric ``rollout/routing_agreement`` is the fraction of (token, MoE layer) routings whose
top-k expert *set* in the training forward equals the set the engine reported, measured without
replay. Forward hooks on every ``TopKRouter`` record the routing map during the old-log-prob
actor forward. When a router replays (R3 on), its output is the replayed choice, so the hook
recomputes the router's natural choice from its own logits (megatron-core's top-k routing
without replay). When routers replay, ``rollout/replay_agreement`` is the same fraction for the
experts the forward actually used (1.0 exactly when replay works). Compared positions: every
position the engine forwarded, i.e. the first ``len(tokens) - 1`` tokens of each sample (prompt
and response); dense layers are skipped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from ember_megatron_backend import comm
from ember_megatron_backend.batches import MicroBatch

__all__ = ["RoutingRecorder", "natural_routing"]


def _describe(sample: Any) -> str:
    return f"sample {sample.index} (group {sample.group_index})"


class RoutingRecorder:
    """Records the MoE routers of one model and scores them against the rollout's experts."""

    def __init__(self, model: Any) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        self._maps: list[tuple[int, Tensor]] = []

    @property
    def active(self) -> bool:
        """Whether the model has MoE routers to record."""
        return bool(self.routers)

    @contextlib.contextmanager
    def record(self, mb: MicroBatch, out: Tensor) -> Iterator[None]:
        """Record the routers during one forward of `mb`; on exit add its per-sample counts.

        Args:
            mb: The micro-batch being forwarded.
            out: [B, 4] float64 per rank-batch sample: (natural routings that agree, routings
                compared, replayed routings that agree, replayed routings compared); rows
                `mb.indices` are incremented.

        Raises:
            ValueError: naming the sample whose routed experts do not fit the model.
        """
        table, flat = self._targets(mb)
        self._maps = []
        handles = [r.register_forward_hook(self._hook) for r in self.routers]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
        counts = self._score(mb, table, flat)
        if getattr(self.routers[0].config, "sequence_parallel", False):
            from megatron.core import parallel_state as ps

            # Each TP rank saw a slice of the stream: add the slices up.
            comm.all_reduce(counts, group=ps.get_tensor_model_parallel_group())
        out[mb.indices] += counts
        self._maps = []

    def _hook(self, router: Any, args: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
        used = output[1].detach()
        if router.router_replay is not None:
            natural = natural_routing(router, args[0]).detach()
            self._maps.append((router.layer_number - 1, natural, used))
        else:
            self._maps.append((router.layer_number - 1, used, None))

    def _targets(self, mb: MicroBatch) -> tuple[Tensor, Tensor]:
        """The rollout experts of all samples [P, layers, k] and, per stream position, its row
        in that table or -1 (padding, a sample's last token, samples without experts)."""
        config = self.routers[0].config
        num_experts, num_layers = config.num_moe_experts, config.num_layers
        pieces, flat = [], torch.full((mb.packed.padded_length,), -1, dtype=torch.long)
        start, offset = 0, 0
        for sample in mb.samples:
            experts = sample.rollout_routed_experts
            length = sample.total_length
            if experts is not None:
                if experts.shape[1] != num_layers:
                    raise ValueError(
                        f"{_describe(sample)}: rollout_routed_experts has {experts.shape[1]} "
                        f"layers but the actor has {num_layers}"
                    )
                if experts.numel() and not 0 <= int(experts.min()) <= int(experts.max()) < (
                    num_experts
                ):
                    raise ValueError(
                        f"{_describe(sample)}: rollout_routed_experts holds ids in "
                        f"[{int(experts.min())}, {int(experts.max())}], outside [0, {num_experts})"
                    )
                pieces.append(experts.to(torch.long))
                flat[start : start + length - 1] = torch.arange(offset, offset + length - 1)
                offset += length - 1
            start += length
        topk = self.routers[0].topk
        table = torch.cat(pieces) if pieces else torch.zeros(0, num_layers, topk, dtype=torch.long)
        return table, flat

    def _score(self, mb: MicroBatch, table: Tensor, flat: Tensor) -> Tensor:
        lengths = torch.tensor([s.total_length for s in mb.samples])
        sample_of = torch.repeat_interleave(torch.arange(len(mb.samples)), lengths)
        sample_of = torch.cat(
            [sample_of, torch.full((mb.packed.padded_length - len(sample_of),), -1)]
        )
        rows = torch.arange(mb.packed.padded_length) if mb.token_index is None else mb.token_index
        rows = rows.to(torch.long)
        row_flat = torch.where(rows >= 0, flat[rows.clamp(min=0)], torch.full_like(rows, -1))
        valid = row_flat >= 0
        owner = sample_of[rows.clamp(min=0)][valid]
        counts = torch.zeros(len(mb.samples), 4, dtype=torch.float64)
        for layer, natural, used in self._maps:
            ids = table[row_flat[valid], layer]  # [V, k]
            for column, routing_map in ((0, natural), (2, used)):
                if routing_map is None:
                    continue
                local = routing_map.reshape(rows.numel(), -1).cpu()[valid]  # [V, E] bool
                rollout = torch.zeros_like(local).scatter_(1, ids, True)
                agree = (rollout == local).all(dim=-1).to(torch.float64)
                counts[:, column].index_add_(0, owner, agree)
                counts[:, column + 1].index_add_(0, owner, torch.ones_like(agree))
        return counts


def natural_routing(router: Any, hidden: Tensor) -> Tensor:
    """The routing map [tokens, E] the router would choose from its own logits, no replay
    (under `rollout.true_on_policy`, the mode's own choice: `exact.route`)."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    own = getattr(router, "natural_routing", None)
    if own is not None:
        return own(hidden)

    config = router.config
    logits = router.gating(hidden).view(-1, config.num_moe_experts)
    _, routing_map = topk_routing_with_score_function(
        logits,
        router.topk,
        use_pre_softmax=config.moe_router_pre_softmax,
        num_groups=config.moe_router_num_groups,
        group_topk=config.moe_router_group_topk,
        scaling_factor=config.moe_router_topk_scaling_factor,
        score_function=router.score_function,
        expert_bias=router.expert_bias,
        fused=False,
        router_replay=None,
    )
    return routing_map
