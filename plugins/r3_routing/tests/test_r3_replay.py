"""Router replay on real megatron-core TopKRouters on CPU, driven through the forward contexts."""

from __future__ import annotations

import logging
import types

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay
from megatron.core.transformer.transformer_config import TransformerConfig
from r3_samples import NUM_EXPERTS, make_sample, small_shape

from ember_core.heads import zigzag_split
from ember_core.hookspecs import Phase, Role
from ember_core.types import pack_samples
from ember_r3_routing.replay import configure_model, replay_targets

pytestmark = pytest.mark.filterwarnings("ignore:full scope is deprecated:UserWarning")

HIDDEN = 8
NO_GROUPS = types.SimpleNamespace(tp=None, cp=None, tp_cp=None, tp_dp_cp=None)
"""Process groups a TopKRouter stores; without aux or z-loss it never uses them."""


def transformer_config(**changes) -> TransformerConfig:
    settings = dict(
        num_layers=3,
        hidden_size=HIDDEN,
        num_attention_heads=1,
        num_moe_experts=NUM_EXPERTS,
        moe_router_topk=2,
        moe_ffn_hidden_size=HIDDEN,
        moe_router_load_balancing_type="none",
        use_cpu_initialization=True,
        add_bias_linear=False,
    )
    settings.update(changes)
    return TransformerConfig(**settings)


def _cpu_gating(router: TopKRouter, hidden: torch.Tensor) -> torch.Tensor:
    # megatron-core's gating moves the router weight to CUDA; the rest of forward is unchanged.
    return F.linear(hidden, router.weight)


class ToyMoE(torch.nn.Module):
    """A stack whose MoE layers mix each token through its routed experts' vectors."""

    def __init__(self, config: TransformerConfig, moe_layers: list[int]) -> None:
        super().__init__()
        self.routers = torch.nn.ModuleList()
        for layer in moe_layers:
            router = TopKRouter(config, pg_collection=NO_GROUPS)
            router.set_layer_number(layer + 1)  # megatron-core numbers layers from 1
            router.gating = types.MethodType(_cpu_gating, router)
            self.routers.append(router)
        self.experts = torch.nn.Parameter(torch.randn(config.num_moe_experts, HIDDEN))
        self.maps: list[torch.Tensor] = []
        for router in self.routers:
            router.register_forward_hook(lambda m, args, out: self.maps.append(out[1].clone()))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, 1, H]
        for router in self.routers:
            probs, _ = router(hidden)  # [S, E]
            hidden = hidden + (probs @ self.experts).unsqueeze(1)
        return hidden


def build(role: Role, seed: int = 0, layers: list[int] | None = None) -> ToyMoE:
    config = transformer_config()
    configure_model(role, config, small_shape())
    torch.manual_seed(seed)
    return ToyMoE(config, small_shape().moe_layers if layers is None else layers)


def routing_map(ids: torch.Tensor) -> torch.Tensor:
    """[R, E] bool map of [R, k] expert ids."""
    ids = ids.long()
    return torch.zeros(ids.shape[0], NUM_EXPERTS, dtype=torch.bool).scatter_(1, ids, True)


def expected_maps(samples, shape, *, pad_to: int | None = None) -> list[torch.Tensor]:
    """Per MoE layer, the map replay must produce: rollout experts, filler 0..k-1 elsewhere."""
    maps = []
    for layer in shape.moe_layers:
        rows = []
        for sample in samples:
            rows.append(sample.rollout_routed_experts[:, layer].long())
            rows.append(torch.arange(shape.topk)[None])  # the sample's last token
        ids = torch.cat(rows)
        if pad_to is not None:
            ids = torch.cat([ids, torch.arange(shape.topk).expand(pad_to - ids.shape[0], -1)])
        maps.append(routing_map(ids))
    return maps


@pytest.fixture
def host(host):
    """The conftest host; megatron-core's global router-replay registry is cleared after."""
    yield host
    RouterReplay.clear_global_router_replay_instances()


def assert_idle(model: ToyMoE) -> None:
    for router in model.routers:
        replay = router.router_replay
        assert replay.router_replay_action is None
        assert replay.replay_backward_list == [] and replay.target_topk_idx is None


# -- model config ----------------------------------------------------------------------------


def test_replay_is_built_for_the_actor_and_the_reference_only(host):
    actor, ref, critic = transformer_config(), transformer_config(), transformer_config()
    critic.moe_enable_routing_replay = True  # even a config shared with the actor is reset
    host.model_config(Role.ACTOR, actor)
    host.model_config(Role.REF, ref)
    host.model_config(Role.CRITIC, critic)
    assert actor.moe_enable_routing_replay is True and ref.moe_enable_routing_replay is True
    assert critic.moe_enable_routing_replay is False
    assert ToyMoE(actor, [0, 2]).routers[0].router_replay is not None
    assert ToyMoE(ref, [0, 2]).routers[0].router_replay is not None
    assert ToyMoE(critic, [0, 2]).routers[0].router_replay is None


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"num_moe_experts": None, "moe_ffn_hidden_size": None},
            r"actor model is dense \(num_moe_experts=None\)",
        ),
        ({"moe_router_topk": 3}, r"r3_routing.topk=2 but the actor model has moe_router_topk=3"),
        ({"num_layers": 4}, r"r3_routing.num_layers=3 but the actor model has num_layers=4"),
        ({"num_moe_experts": 8}, r"r3_routing.num_experts=6 but the actor model has num_moe"),
    ],
)
def test_actor_model_must_match_the_section(host, changes, message):
    with pytest.raises(ValueError, match=message):
        host.model_config(Role.ACTOR, transformer_config(**changes))


def test_routing_features_replay_cannot_reproduce_are_refused(host, caplog):
    dropping = transformer_config()
    dropping.moe_expert_capacity_factor = 1.0
    with pytest.raises(ValueError, match="token dropping"):
        host.model_config(Role.ACTOR, dropping)
    fused = transformer_config()
    fused.moe_router_fusion = True
    with caplog.at_level(logging.WARNING):
        host.model_config(Role.ACTOR, fused)
    assert fused.moe_router_fusion is False and fused.moe_enable_routing_replay is True
    assert "moe_router_fusion turned off" in caplog.text


# -- forward-only scoring -----------------------------------------------------------------------


def test_log_prob_pass_routes_every_token_as_the_rollout_did(host, shape):
    model = build(Role.ACTOR)
    samples = [make_sample(5, shape, seed=1, index=0), make_sample(6, shape, seed=2, index=1)]
    packed = pack_samples(samples, pad_multiple=4)  # 11 tokens + 1 padding row
    hidden = torch.randn(packed.padded_length, 1, HIDDEN)
    batch = types.SimpleNamespace(model=model, samples=samples, packed=packed)

    with torch.no_grad():
        model(hidden)
        live = list(model.maps)
        model.maps.clear()
        with host.forward_context(Role.ACTOR, Phase.LOG_PROB, batch):
            model(hidden)
    expected = expected_maps(samples, shape, pad_to=12)
    assert len(model.maps) == 2
    for got, want, natural in zip(model.maps, expected, live, strict=True):
        assert torch.equal(got, want)
        assert not torch.equal(natural, want)  # replay changed the routing
    assert_idle(model)
    model.maps.clear()
    with torch.no_grad():
        model(hidden)  # after the pass the router routes by itself again
    assert all(torch.equal(a, b) for a, b in zip(model.maps, live, strict=True))


def test_pipeline_stages_replay_their_own_layers(host, shape):
    """Under pipeline parallelism each stage holds some layers, numbered globally: a stage with
    only the last MoE layer replays that layer's experts, and a stage of dense layers has no
    router and nothing to replay in any phase."""
    samples = [make_sample(5, shape, seed=1)]
    hidden = torch.randn(5, 1, HIDDEN)
    last = build(Role.ACTOR, layers=[shape.moe_layers[-1]])
    with torch.no_grad(), host.forward_context(Role.ACTOR, Phase.LOG_PROB, batch_of(last, samples)):
        last(hidden)
    assert len(last.maps) == 1
    assert torch.equal(last.maps[0], expected_maps(samples, shape)[-1])
    assert_idle(last)
    dense = build(Role.ACTOR, layers=[])
    for phase in (Phase.LOG_PROB, Phase.TRAIN, Phase.BACKWARD):
        with host.forward_context(Role.ACTOR, phase, batch_of(dense, samples)):
            dense(hidden)
    assert dense.maps == []


def batch_of(model, samples):
    return types.SimpleNamespace(model=model, samples=samples)


def test_reference_routes_by_itself_except_in_its_replay_check(host, shape):
    ref = build(Role.REF)
    samples = [make_sample(6, shape, seed=3)]
    hidden = torch.randn(6, 1, HIDDEN)
    batch = batch_of(ref, samples)
    natural = len(ref.routers)
    with torch.no_grad():
        ref(hidden)
        for phase in (Phase.LOG_PROB, Phase.TRAIN):
            with host.forward_context(Role.REF, phase, batch):
                ref(hidden)
        with host.forward_context(Role.REF, Phase.REPLAY_CHECK, batch):
            ref(hidden)
        ref(hidden)  # and normal again afterwards
    maps = [ref.maps[k : k + natural] for k in range(0, len(ref.maps), natural)]
    first, *scoring, check, after = maps
    for other in (*scoring, after):
        assert all(torch.equal(a, b) for a, b in zip(first, other, strict=True))
    for used, expected in zip(check, expected_maps(samples, shape), strict=True):
        assert torch.equal(used, expected)  # the engine's choice at every forwarded position
    assert not all(torch.equal(a, b) for a, b in zip(first, check, strict=True))
    critic = build(Role.CRITIC)
    with pytest.raises(RuntimeError, match="no router with replay on"):
        with host.forward_context(Role.ACTOR, Phase.LOG_PROB, batch_of(critic, samples)):
            pass


# -- training: gradients and recompute ------------------------------------------------------------


def reference_loss(model: ToyMoE, hidden: torch.Tensor, ids: list[torch.Tensor]) -> torch.Tensor:
    """The toy stack written out by hand with fixed experts: probs = softmax of gathered logits."""
    for router, layer_ids in zip(model.routers, ids, strict=True):
        logits = hidden.view(-1, HIDDEN) @ router.weight.t()  # [S, E]
        probs = torch.softmax(logits.gather(1, layer_ids), dim=-1)
        dense = torch.zeros_like(logits).scatter(1, layer_ids, probs)
        hidden = hidden + (dense @ model.experts).unsqueeze(1)
    return hidden.square().sum()


def test_replayed_experts_the_router_would_not_pick_still_train_it(host, shape):
    model = build(Role.ACTOR, seed=4)
    sample = make_sample(7, shape, seed=5)
    hidden = torch.randn(7, 1, HIDDEN)
    # Give the sample the experts each router ranks *lowest* for these inputs.
    with torch.no_grad():
        h, worst = hidden, []
        for router in model.routers:
            logits = _cpu_gating(router, h).view(-1, NUM_EXPERTS)
            worst.append(logits.topk(shape.topk, dim=1, largest=False).indices)
            probs, _ = router(h)
            h = h + (probs @ model.experts).unsqueeze(1)
    experts = torch.zeros(6, shape.num_layers, shape.topk, dtype=torch.uint8)
    for layer, ids in zip(shape.moe_layers, worst, strict=True):
        experts[:, layer] = ids[:6].to(torch.uint8)
    sample.rollout_routed_experts = experts
    batch = types.SimpleNamespace(model=model, samples=[sample])

    model.maps.clear()
    with host.forward_context(Role.ACTOR, Phase.TRAIN, batch):
        loss = model(hidden).square().sum()
    with host.forward_context(Role.ACTOR, Phase.BACKWARD, batch):
        loss.backward()
    assert_idle(model)

    filler = torch.arange(shape.topk)[None]
    ids = [torch.cat([experts[:, layer].long(), filler]) for layer in shape.moe_layers]
    for got, layer_ids in zip(model.maps, ids, strict=True):
        assert torch.equal(got, routing_map(layer_ids))
    grads = [router.weight.grad.clone() for router in model.routers]
    assert all(g.abs().sum() > 0 for g in grads)

    model.zero_grad()
    expected_loss = reference_loss(model, hidden, ids)
    expected_loss.backward()
    torch.testing.assert_close(loss, expected_loss)
    for got, router in zip(grads, model.routers, strict=True):
        torch.testing.assert_close(got, router.weight.grad)


def run_step(host, model, batches, hiddens, *, recompute: bool) -> list[torch.Tensor]:
    """1F1B order for two micro-batches: F0 F1 B0 B1; returns the router weight gradients."""

    def forward(hidden):
        if recompute:
            return torch.utils.checkpoint.checkpoint(model, hidden, use_reentrant=False)
        return model(hidden)

    losses = []
    for batch, hidden in zip(batches, hiddens, strict=True):
        with host.forward_context(Role.ACTOR, Phase.TRAIN, batch):
            losses.append(forward(hidden).square().sum())
    for batch, loss in zip(batches, losses, strict=True):
        with host.forward_context(Role.ACTOR, Phase.BACKWARD, batch):
            loss.backward()
    return [router.weight.grad.clone() for router in model.routers]


def test_backward_recompute_replays_each_micro_batch_in_order(host, shape):
    model = build(Role.ACTOR, seed=6)
    samples = [
        [make_sample(5, shape, seed=7, index=0), make_sample(4, shape, seed=8, index=1)],
        [make_sample(6, shape, seed=9, index=2)],
    ]
    batches = [types.SimpleNamespace(model=model, samples=s) for s in samples]
    hiddens = [torch.randn(9, 1, HIDDEN), torch.randn(6, 1, HIDDEN)]

    with_recompute = run_step(host, model, batches, hiddens, recompute=True)
    assert_idle(model)
    first, second = expected_maps(samples[0], shape), expected_maps(samples[1], shape)
    # Router calls: F0 (2 layers), F1 (2 layers), recompute of B0 (2), recompute of B1 (2).
    assert len(model.maps) == 8
    for got, want in zip(model.maps, first + second + first + second, strict=True):
        assert torch.equal(got, want)

    model.zero_grad()
    model.maps.clear()
    without_recompute = run_step(host, model, batches, hiddens, recompute=False)
    assert_idle(model)  # the queued experts no recompute used were dropped
    assert len(model.maps) == 4
    for got, want in zip(with_recompute, without_recompute, strict=True):
        torch.testing.assert_close(got, want)


def test_a_failed_training_forward_leaves_nothing_queued(host, shape):
    model = build(Role.ACTOR)
    batch = types.SimpleNamespace(model=model, samples=[make_sample(5, shape, seed=10)])
    with pytest.raises(ZeroDivisionError):
        with host.forward_context(Role.ACTOR, Phase.TRAIN, batch):
            raise ZeroDivisionError
    assert_idle(model)
    with pytest.raises(RuntimeError, match="backward of the actor with no queued experts"):
        with host.forward_context(Role.ACTOR, Phase.BACKWARD, batch):
            pass


# -- layout: context parallelism, row counts, layers ----------------------------------------------


def test_zigzag_context_parallel_ranks_replay_their_own_rows(host, shape):
    model = build(Role.ACTOR, seed=11)
    samples = [make_sample(7, shape, seed=12, index=0), make_sample(10, shape, seed=13, index=1)]
    lengths = [len(s.tokens) for s in samples]
    full = replay_targets(samples, shape.moe_layers, shape)  # [17, 2, k]
    cp = 2
    seen = []
    for rank in range(cp):
        # The rank's rows: zigzag chunks r and 2cp-1-r of every sample, -1 where padded.
        token_index = zigzag_split(torch.arange(sum(lengths)) + 1, lengths, cp, rank) - 1
        local = replay_targets(samples, shape.moe_layers, shape, token_index=token_index)
        valid = token_index >= 0
        assert torch.equal(local[valid], full[token_index[valid]])
        assert torch.equal(local[valid], zigzag_split(full, lengths, cp, rank)[valid])
        assert (local[~valid] == torch.arange(shape.topk)).all()
        seen.append(token_index[valid])

        batch = types.SimpleNamespace(model=model, samples=samples, token_index=token_index)
        model.maps.clear()
        with torch.no_grad(), host.forward_context(Role.ACTOR, Phase.LOG_PROB, batch):
            model(torch.randn(token_index.numel(), 1, HIDDEN))
        for j, got in enumerate(model.maps):
            assert torch.equal(got, routing_map(local[:, j]))
    assert sorted(torch.cat(seen).tolist()) == list(range(sum(lengths)))


def test_a_row_count_that_does_not_match_the_input_is_refused(host, shape):
    model = build(Role.ACTOR)
    batch = types.SimpleNamespace(model=model, samples=[make_sample(6, shape, seed=14)])
    with torch.no_grad(), host.forward_context(Role.ACTOR, Phase.LOG_PROB, batch):
        with pytest.raises(ValueError, match="router sees 8 tokens but the replay data has 6 rows"):
            model(torch.randn(8, 1, HIDDEN))


def test_a_router_on_a_dense_layer_is_refused(host, shape):
    model = build(Role.ACTOR, layers=[0, 1])
    batch = types.SimpleNamespace(model=model, samples=[make_sample(6, shape, seed=15)])
    with pytest.raises(ValueError, match="router on layer 1, but r3_routing .* has no MoE layer"):
        with host.forward_context(Role.ACTOR, Phase.LOG_PROB, batch):
            pass


def test_a_training_sample_without_experts_is_named(host, shape):
    model = build(Role.ACTOR)
    sample = make_sample(6, shape, seed=16, index=5, group=2)
    sample.rollout_routed_experts = None
    batch = types.SimpleNamespace(model=model, samples=[sample])
    with pytest.raises(ValueError, match=r"sample 5 \(group 2\): no rollout_routed_experts"):
        with host.forward_context(Role.ACTOR, Phase.TRAIN, batch):
            pass
