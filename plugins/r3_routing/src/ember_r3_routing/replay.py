"""Training side of R3: megatron-core's RouterReplay, driven around the actor's passes."""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ember_core.certify import Fault, planted
from ember_core.hookspecs import Phase, Role
from ember_r3_routing.config import SECTION, R3RoutingConfig
from ember_r3_routing.experts import describe

logger = logging.getLogger(__name__)

# megatron-core is imported inside the functions below: only training processes need it.


def configure_model(role: Role, model_config: Any, config: R3RoutingConfig) -> None:
    """Give the actor's and the reference's routers replay, and the critic's none.

    megatron-core creates a `RouterReplay` for a `TopKRouter` only when its config has
    `moe_enable_routing_replay` set at construction. A router with one routes normally until an
    action is set (`replay_context` sets it around a pass and clears it after), so the
    reference keeps normal routing in every pass but the check-only `Phase.REPLAY_CHECK`
    forward; the critic, built with it off, never replays.

    Args:
        role: The model about to be built.
        model_config: Its megatron-core `TransformerConfig` (modified in place).
        config: The r3_routing section, checked against the actor's shape.

    Raises:
        ValueError: The actor is dense, its shape differs from the section, or it uses a routing
            feature that replay cannot reproduce exactly.
    """
    if role not in (Role.ACTOR, Role.REF):
        if hasattr(model_config, "moe_enable_routing_replay"):
            model_config.moe_enable_routing_replay = False
        return
    num_experts = getattr(model_config, "num_moe_experts", None)
    if not num_experts and role == Role.REF:
        return  # a dense reference: nothing routes (the actor's check names the problem)
    if not num_experts:
        raise ValueError(
            f"r3_routing is enabled but the actor model is dense (num_moe_experts="
            f"{num_experts!r}): there is no routing to replay; remove r3_routing from plugins"
        )
    shape = (
        ("num_layers", "num_layers", model_config.num_layers),
        ("num_experts", "num_moe_experts", num_experts),
        ("topk", "moe_router_topk", model_config.moe_router_topk),
    )
    for ours, theirs, value in shape:
        if getattr(config, ours) != value:
            raise ValueError(
                f"{SECTION}.{ours}={getattr(config, ours)} but the actor model has "
                f"{theirs}={value}; the section must describe the model being trained"
            )
    balancing = getattr(model_config, "moe_router_load_balancing_type", None)
    if "sinkhorn" in ([balancing] if isinstance(balancing, str) else list(balancing or [])):
        raise ValueError(
            "r3_routing cannot replay sinkhorn routing (megatron-core selects its experts outside "
            "the replayable top-k); use another moe_router_load_balancing_type"
        )
    if getattr(model_config, "moe_expert_capacity_factor", None) is not None:
        raise ValueError(
            "r3_routing cannot replay routing with token dropping (moe_expert_capacity_factor="
            f"{model_config.moe_expert_capacity_factor}): dropped tokens would not use the "
            "rollout's experts; set it to None"
        )
    if getattr(model_config, "mtp_num_layers", None):
        raise ValueError(
            "r3_routing cannot replay multi-token-prediction layers (mtp_num_layers="
            f"{model_config.mtp_num_layers}): engines report no routing for them"
        )
    if getattr(model_config, "moe_router_fusion", False):
        # The fused top-k kernel returns before megatron-core consults RouterReplay.
        if role == Role.ACTOR:  # one line for the run: the reference shares the config
            logger.warning(
                "r3_routing: moe_router_fusion turned off, the fused router cannot replay"
            )
        model_config.moe_router_fusion = False
    model_config.moe_enable_routing_replay = True


def replay_routers(model: Any, config: R3RoutingConfig) -> list[tuple[int, Any]]:
    """The replaying routers of a model, as (layer index from 0, router), ascending by layer.

    Router layer numbers are global: under pipeline parallelism megatron-core adds the stage's
    layer offset, so each stage replays its own layers of the rollout's routing.

    Args:
        model: A module or a list of model chunks (pipeline stages of this rank).
        config: The r3_routing section: every router must sit on one of its MoE layers.

    Returns:
        The routers; none for a model chunk without any MoE layer (a pipeline stage of dense
        layers).

    Raises:
        RuntimeError: Routers exist but none replays (the model was built without
            `configure_model`).
        ValueError: A router sits on a layer the section calls dense or beyond num_layers.
    """
    from megatron.core.transformer.moe.router import TopKRouter

    chunks = model if isinstance(model, list | tuple) else [model]
    found: list[tuple[int, Any]] = []
    routers = 0
    for chunk in chunks:
        for module in chunk.modules():
            if not isinstance(module, TopKRouter):
                continue
            routers += 1
            if module.router_replay is not None:
                if module.layer_number is None:
                    raise ValueError("r3_routing: a replaying router has no layer_number")
                found.append((module.layer_number - 1, module))
    if not routers:
        return []  # a pipeline stage whose layers are all dense: nothing routes here
    if not found:
        raise RuntimeError(
            "r3_routing: the model has no router with replay on; the backend must call the "
            "plugins' model_config hook for the actor and the reference before building them"
        )
    moe = set(config.moe_layers)
    for layer, _ in found:
        if layer not in moe:
            raise ValueError(
                f"r3_routing: the actor has a router on layer {layer}, but {SECTION} "
                f"(num_layers={config.num_layers}, dense_layers={config.dense_layers}) has no "
                "MoE layer there"
            )
    found.sort(key=lambda item: item[0])
    return found


def replay_targets(
    samples: Sequence[Any],
    layers: Sequence[int],
    config: R3RoutingConfig,
    *,
    token_index: torch.Tensor | None = None,
    num_rows: int | None = None,
) -> torch.Tensor:
    """The experts each row of a packed micro-batch replays, for some layers.

    Rows without rollout routing (the last token of every sample, which the engine never
    forwarded, and padding) get experts 0 .. topk-1: their outputs reach no loss term.

    Args:
        samples: The micro-batch's samples in packing order, with `rollout_routed_experts`.
        layers: Layer indices (from 0) to take.
        config: The model shape.
        token_index: [R] for each row the routers see on this rank, its position in the samples'
            concatenated tokens, or -1 for padding (covers context-parallel zigzag slicing and
            sequence-parallel splits). None: the rows are the concatenated tokens themselves.
        num_rows: With `token_index` None, pad the rows to this many (the packed stream's padded
            length).

    Returns:
        [R, len(layers), topk] in the compact expert dtype, on CPU.

    Raises:
        ValueError: A sample has no routed experts or the wrong shape, or the index is invalid.
    """
    topk, dtype = config.topk, config.expert_dtype
    filler = torch.arange(topk, dtype=dtype).expand(1, len(layers), topk)
    pieces = []
    for sample in samples:
        experts = sample.rollout_routed_experts
        expected = (len(sample.tokens) - 1, config.num_layers, topk)
        if experts is None:
            raise ValueError(
                f"{describe(sample)}: no rollout_routed_experts to replay; with r3_routing on, "
                "every training sample needs the engine's routed experts"
            )
        if tuple(experts.shape) != expected:
            raise ValueError(
                f"{describe(sample)}: rollout_routed_experts has shape {list(experts.shape)}, "
                f"expected [len(tokens) - 1, num_layers, topk] = {list(expected)}"
            )
        pieces.append(experts[:, list(layers)].to(dtype))
        pieces.append(filler)
    rows = torch.cat(pieces)  # [T, M, k], T = sum(len(tokens))
    total = rows.shape[0]
    if token_index is None:
        if num_rows is None or num_rows == total:
            return rows
        if num_rows < total:
            raise ValueError(f"num_rows={num_rows} is smaller than the {total} packed tokens")
        return torch.cat([rows, filler.expand(num_rows - total, -1, -1)])
    index = token_index.to("cpu", torch.long)
    if index.dim() != 1 or bool(((index < -1) | (index >= total)).any()):
        raise ValueError(
            f"token_index must be [R] positions in [0, {total}) or -1 for padding, got shape "
            f"{list(index.shape)} with range [{int(index.min())}, {int(index.max())}]"
        )
    out = filler.expand(index.numel(), -1, -1).clone()
    valid = index >= 0
    out[valid] = rows[index[valid]]
    return out


_guarded: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def _guard_row_count(layer: int, router: torch.nn.Module) -> None:
    """Make a replaying router refuse input whose token count differs from its replay rows.

    Without it, fewer replay rows than tokens would silently route the remaining tokens to no
    expert at all (megatron-core scatters the gathered rows into a zero routing map).
    """
    if router in _guarded:
        return
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    def check(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        replay = module.router_replay
        if replay.router_replay_action == RouterReplayAction.REPLAY_FORWARD:
            target = replay.target_topk_idx
        elif replay.router_replay_action == RouterReplayAction.REPLAY_BACKWARD:
            target = replay.replay_backward_list[0] if replay.replay_backward_list else None
        else:
            return
        if target is None:
            raise RuntimeError(
                f"r3_routing: the layer {layer} router replays but holds no experts for this "
                "pass (a recompute outside a training step's backward?)"
            )
        hidden = args[0]
        tokens = hidden.numel() // hidden.shape[-1]
        if tokens != target.shape[0]:
            raise ValueError(
                f"r3_routing: the layer {layer} router sees {tokens} tokens but the replay data "
                f"has {target.shape[0]} rows; the batch's token_index must list exactly the rows "
                "this rank's model input holds"
            )

    router.register_forward_pre_hook(check)
    _guarded.add(router)


@contextlib.contextmanager
def replay_context(phase: Phase, batch: Any, config: R3RoutingConfig) -> Iterator[None]:
    """Make every MoE router of a model select the rollout's experts during one pass.

    Selection is replayed; the probabilities are still the router's scores gathered at the
    replayed ids, so the router weights get gradients.

    Args:
        phase: LOG_PROB or REPLAY_CHECK (forward only: the actor's scoring, the reference's
            check-only forward), TRAIN (a training forward; its experts are queued for
            the recompute of its backward) or BACKWARD (the backward of the oldest queued
            training forward, with any activation recompute it triggers).
        batch: The backend's micro-batch. Read: `model` (module or list of chunks),
            `samples` (in packing order), and optionally `token_index` ([R] rows the routers
            see, -1 for padding; see `replay_targets`) or `packed` (an
            `ember_core.types.PackedBatch` whose padded length is the row count).
        config: The r3_routing section.
    """
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = replay_routers(batch.model, config)
    if not routers or planted(Fault.REPLAY_OFF):
        yield
        return
    for layer, router in routers:
        _guard_row_count(layer, router)
    replays = [router.router_replay for _, router in routers]

    if phase == Phase.BACKWARD:
        for (layer, _), replay in zip(routers, replays, strict=True):
            if not replay.replay_backward_list:
                raise RuntimeError(
                    f"r3_routing: backward of the actor with no queued experts on layer {layer}; "
                    "each backward must follow its forward under phase 'train'"
                )
        queued = [len(replay.replay_backward_list) for replay in replays]
        for replay in replays:
            replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
        try:
            yield
        finally:
            for replay, before in zip(replays, queued, strict=True):
                if len(replay.replay_backward_list) == before:
                    # No recompute ran this router: drop the micro-batch's queued experts here.
                    replay.replay_backward_list.pop(0)
                replay.clear_router_replay_action()
        return

    forward_only = phase in (Phase.LOG_PROB, Phase.REPLAY_CHECK)
    packed = getattr(batch, "packed", None)
    rows = replay_targets(
        batch.samples,
        [layer for layer, _ in routers],
        config,
        token_index=getattr(batch, "token_index", None),
        num_rows=packed.padded_length if packed is not None else None,
    )
    for j, ((_, router), replay) in enumerate(zip(routers, replays, strict=True)):
        if forward_only:
            replay.clear_indices()
        # gather() needs int64 ids; the compact copy stays the stored form.
        replay.set_target_indices(rows[:, j].to(router.weight.device, torch.long))
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    completed = False
    try:
        yield
        completed = True
    finally:
        for replay in replays:
            if forward_only:
                replay.clear_indices()
                replay.clear_router_replay_action()
            elif completed:
                # Recompute in this forward's backward pops the queued experts in order.
                replay.target_topk_idx = None
                replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
            else:
                replay.replay_backward_list.pop()
                replay.target_topk_idx = None
                replay.clear_router_replay_action()
