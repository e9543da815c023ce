"""R3 on a real megatron-core GPTModel and MegatronWorker on CPU, alone and with the KL checker.

The four plugin combinations (neither, R3 only, checker only, both) run here, next to the plugin
that changes the actor's forward: the checker's own tests cover its failures on a real worker
without R3, and the checker itself never names R3 (the exemption reaches it through the hook).
"""

from __future__ import annotations

import contextlib
import logging
import types
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay

from ember_ci_kl_checker import Check, KLCheckerConfig, KLCheckError
from ember_ci_kl_checker import plugin as checker_plugin
from ember_core.certify import PLANT_ENV, Fault
from ember_core.config import AlgorithmConfig, CIConfig, SamplingConfig
from ember_core.hookspecs import ExemptionScope, KLExemption, Phase, Role, hookimpl
from ember_core.plugins import EmberPlugins
from ember_core.types import Sample, pack_samples
from ember_megatron_backend.config import BackendConfig, OptimizerConfig
from ember_megatron_backend.forward import (
    model_inputs,
    router_rows,
    router_rows_to_stream,
)
from ember_megatron_backend.model import build_model
from ember_megatron_backend.parallel import destroy_distributed, init_distributed
from ember_megatron_backend.routing import natural_routing
from ember_megatron_backend.worker import MegatronWorker
from ember_r3_routing import R3RoutingConfig
from ember_r3_routing import plugin as r3_plugin

pytestmark = pytest.mark.filterwarnings("ignore:full scope is deprecated:UserWarning")

LAYERS, EXPERTS, TOPK, VOCAB = 4, 8, 2, 256
"""The tiny-moe preset's shape (every family preset has the same numbers)."""
FAMILY_PRESETS = ["tiny-moe", "tiny-deepseek-v3", "tiny-glm4-moe", "tiny-qwen2-moe", "tiny-mixtral"]
"""One preset per MoE family: softmax and sigmoid-with-bias routers, group-limited top-k,
shared experts, dense first layers."""
CHECKER_LOGGER = "ember_ci_kl_checker.plugin"
PLUGINS = {"r3_routing": r3_plugin, "ci_kl_checker": checker_plugin}


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """The parts of a run config these plugins read: the training section, the objective (the
    checker reads whether it needs a reference model) and the CI switch."""

    train: BackendConfig
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    plugins: list[str] = field(default_factory=list)
    ci: CIConfig = field(default_factory=CIConfig)


class Recompute:
    """Turns on megatron-core's full activation recompute, one layer per checkpoint."""

    @hookimpl
    def ember_model_config(self, role: Role, model_config) -> None:
        model_config.recompute_granularity = "full"
        model_config.recompute_method = "uniform"
        model_config.recompute_num_layers = 1


@pytest.fixture(scope="session")
def dist_env():
    """torch.distributed (gloo, one process) and megatron-core's parallel state, kept for the
    session like the backend tests' fixture (megatron-core's state is process-global)."""
    torch.set_num_threads(2)
    init_distributed()
    yield
    destroy_distributed()


@contextlib.contextmanager
def running(
    names: list[str], train: BackendConfig, *, algorithm=None, extra=(), ci=True, **sections
) -> Iterator:
    """A facade with `names` registered and configured as a CI run (`ci`: the `ci.test`
    switch); all undone afterwards."""
    plugins = EmberPlugins()
    registered = []
    try:
        for name in names:
            plugins.register(PLUGINS[name], name)
            registered.append(name)
        for k, obj in enumerate(extra):
            plugins.register(obj, f"extra{k}")
            registered.append(f"extra{k}")
        plugins.check_pending()
        config = RunConfig(
            train=train,
            algorithm=algorithm or AlgorithmConfig(),
            plugins=list(names),
            ci=CIConfig(test=ci),
        )
        plugins.configure(config, {n: s for n, s in sections.items() if n in names})
        yield plugins
    finally:
        for name in registered:
            plugins.unregister(name)
        r3_plugin._config = None
        checker_plugin._checker = None
        RouterReplay.clear_global_router_replay_instances()


def backend(**changes) -> BackendConfig:
    settings = dict(
        model="tiny-moe",
        # Weights far enough from uniform that a change of experts moves the log-probs.
        model_overrides={"init_method_std": 0.1},
        optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.0),
        num_steps_per_rollout=2,
        micro_batch_size=3,
    )
    settings.update(changes)
    return BackendConfig(**settings)


def random_experts(
    positions: int, generator: torch.Generator, dense: tuple[int, ...] = ()
) -> torch.Tensor:
    """Valid rollout experts [positions, layers, topk]: distinct ids per row, uint8; zeros on
    `dense` layers, as engines report them."""
    order = torch.rand(positions, LAYERS, EXPERTS, generator=generator).argsort(dim=-1)
    experts = order[..., :TOPK].to(torch.uint8)
    experts[:, list(dense)] = 0
    return experts


def make_samples(count: int = 8, *, seed: int = 0, dense: tuple[int, ...] = ()) -> list[Sample]:
    """Scored samples in groups of two whose rollout experts are random (the actor's own
    routing picks other experts for most tokens)."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for k in range(count):
        length = int(torch.randint(9, 17, (1,), generator=g))
        response = int(torch.randint(3, length - 3, (1,), generator=g))
        samples.append(
            Sample(
                tokens=torch.randint(0, VOCAB, (length,), generator=g).tolist(),
                response_length=response,
                index=k,
                group_index=k // 2,
                reward=float(torch.rand(1, generator=g)),
                rollout_log_probs=(-3 * torch.rand(response, generator=g)).tolist(),
                rollout_routed_experts=random_experts(length - 1, g, dense),
            )
        )
    return samples


def routing_map(ids: torch.Tensor) -> torch.Tensor:
    """[R, E] bool map of [R, k] expert ids."""
    return torch.zeros(ids.shape[0], EXPERTS, dtype=torch.bool).scatter_(1, ids.long(), True)


def router_index(samples: list[Sample]) -> torch.Tensor:
    """[R] stream position of each row the routers see for `samples` (-1 for padding)."""
    packed = pack_samples(samples)
    index = router_rows(packed)
    return torch.arange(packed.padded_length) if index is None else index


def rollout_map(samples: list[Sample], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rollout's routing map of one layer over the rows the routers see [R, E], and [R]
    True on the rows that have rollout experts (every token but each sample's last)."""
    maps, valid = [], []
    for sample in samples:
        experts = sample.rollout_routed_experts[:, layer]
        maps += [routing_map(experts), torch.zeros(1, EXPERTS, dtype=torch.bool)]
        valid += [torch.ones(len(experts), dtype=torch.bool), torch.zeros(1, dtype=torch.bool)]
    index = router_index(samples)
    rows = index.clamp(min=0)
    return torch.cat(maps)[rows], torch.cat(valid)[rows] & (index >= 0)


def batch_of(model, samples: list[Sample]) -> types.SimpleNamespace:
    """What the plugins' forward contexts receive for one forward of `samples`."""
    return types.SimpleNamespace(
        model=model, samples=samples, token_index=router_rows(pack_samples(samples))
    )


def natural_topk(router, hidden: torch.Tensor) -> torch.Tensor:
    """[R, k] experts the router picks by itself (its family's rule, no replay)."""
    routing = natural_routing(router, hidden)  # [R, E] bool
    return routing.float().topk(TOPK, dim=-1).indices


class RouterLog:
    """Records every call of a model's TopKRouters: layer, grad mode, the routing map it used
    and the top-k its own logits give (what it would pick without replay)."""

    def __init__(self, model) -> None:
        self.calls: list[tuple[int, bool, torch.Tensor, torch.Tensor]] = []
        self.routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        self.handles = [r.register_forward_hook(self.hook) for r in self.routers]

    def hook(self, router, args, output) -> None:
        with torch.no_grad():
            natural = natural_topk(router, args[0])
        grad = torch.is_grad_enabled()
        self.calls.append((router.layer_number - 1, grad, output[1].detach().clone(), natural))

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


# -- the four combinations ------------------------------------------------------------------


@pytest.mark.slow  # about 9 s
@pytest.mark.parametrize(
    "names",
    [[], ["r3_routing"], ["ci_kl_checker"], ["r3_routing", "ci_kl_checker"]],
    ids=["neither", "r3_only", "checker_only", "both"],
)
def test_plugin_combinations_on_a_megatron_worker(dist_env, caplog, names):
    caplog.set_level(logging.INFO, logger=CHECKER_LOGGER)
    r3 = "r3_routing" in names
    train = backend()
    # make_samples' rollout log-probs are random draws, about 4.6 from the trainer's, not an
    # engine's, and its experts are random: the checker's mismatch ceiling and recorded-routing
    # floor are not what these combinations test.
    checker = KLCheckerConfig(
        train_rollout_logprob_abs_diff_threshold=10.0,
        train_rollout_logprob_max_abs_diff_threshold=10.0,
        recorded_routing_agreement_min=0.0,
    )
    sections = {"r3_routing": R3RoutingConfig(), "ci_kl_checker": checker}
    algorithm = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.01)
    samples = make_samples()
    with running(names, train, algorithm=algorithm, **sections) as plugins:
        worker = MegatronWorker(train, algorithm, SamplingConfig(temperature=0.8), plugins)
        assert worker.ref is not None
        batch = worker.prepare(0, samples)
        rollout = worker.log_rollout_data(0, batch)
        steps = worker.train(0, batch)  # the checker, when on, has checked every step here
        again = worker.train(1, worker.prepare(1, samples))
        if "ci_kl_checker" in names:
            assert checker_plugin._checker.active  # ci.test reached the checker
        if r3:
            assert r3_plugin._config.num_layers == LAYERS  # the shape came from `train`

    # Old and new actor log-probs of a rollout's first step share weights and experts.
    for first in (steps[0], again[0]):
        assert first["train/ppo_kl"] == 0.0 and first["train/pg_clipfrac"] == 0.0
    gap = abs(rollout["rollout/log_probs"] - rollout["rollout/ref_log_probs"])
    if r3:
        # The actor replays the rollout's experts, the reference routes by itself.
        assert gap > 1e-3, rollout
        assert steps[0]["train/kl_loss"] > 1e-5, steps[0]
        assert not torch.equal(torch.cat(batch.log_probs), torch.cat(batch.ref_log_probs))
    else:
        assert gap == 0.0 and steps[0]["train/kl_loss"] == 0.0
        for actor, ref in zip(batch.log_probs, batch.ref_log_probs, strict=True):
            assert torch.equal(actor, ref)
    assert steps[1]["train/kl_loss"] > 0  # the first update moved the actor
    # The routing agreement is measured on the actor's own top-k, replay or not.
    assert rollout["rollout/routing_agreement"] < 0.2
    if r3:
        assert rollout["rollout/replay_agreement"] == 1.0
    else:
        assert "rollout/replay_agreement" not in rollout

    # Under replay every training forward used the rollout's experts.
    if r3:
        assert [s["train/replay_agreement"] for s in steps + again] == [1.0] * 4
        assert all(s["train/routing_agreement"] < 0.2 for s in steps + again)
    else:
        assert all("train/replay_agreement" not in s for s in steps + again)
    lines = [r for r in caplog.records if "exempted by" in r.getMessage()]
    if names == ["r3_routing", "ci_kl_checker"]:
        assert len(lines) == 1, [r.getMessage() for r in lines]
        message = lines[0].getMessage()
        assert lines[0].levelno == logging.INFO
        assert "stand down" in message and "exempted by r3_routing:" in message
        assert r3_plugin.EXEMPTION_REASON in message
    else:
        assert lines == []


# -- the checker's replayed reference ----------------------------------------------------------

BOTH = ["r3_routing", "ci_kl_checker"]
REPLAYED = "rollout/ref_replayed_log_probs_max_abs_diff"
LOOSE = KLCheckerConfig(
    train_rollout_logprob_abs_diff_threshold=10.0,
    train_rollout_logprob_max_abs_diff_threshold=10.0,
    recorded_routing_agreement_min=0.0,
)
"""make_samples' rollout log-probs and experts are random draws, not an engine's: no mismatch
ceiling and no recorded-routing floor."""


@pytest.fixture(scope="module")
def trained_checkpoint(dist_env, tmp_path_factory):
    """An HF checkpoint of the actor after one rollout of training: a reference of its own (RL
    continued from a checkpoint), which the actor need not equal."""
    with running([], backend()) as plugins:
        worker = MegatronWorker(backend(), AlgorithmConfig(), SamplingConfig(), plugins)
        worker.train(0, worker.prepare(0, make_samples(seed=3)))
        return str(worker.export_hf(tmp_path_factory.mktemp("trained")))


REBUILT = "rollout/ref_rebuilt_log_probs_max_abs_diff"


class ForwardCount:
    """Counts the forwards of one model."""

    def __init__(self, model) -> None:
        self.count = 0
        model.register_forward_hook(self.hook)

    def hook(self, module, args, output) -> None:
        self.count += 1


def micro_batches(batch) -> int:
    return sum(len(step) for step in batch.steps)


@pytest.mark.slow  # about 9 s
def test_under_r3_the_reference_replaying_the_rollout_routing_matches_the_actor(dist_env):
    train = backend()
    algorithm = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.01)
    samples = make_samples()
    with running(BOTH, train, algorithm=algorithm, ci_kl_checker=LOOSE) as plugins:
        worker = MegatronWorker(train, algorithm, SamplingConfig(temperature=0.8), plugins)
        ref = RouterLog(worker.ref)
        batch = worker.prepare(0, samples)
        rollout = worker.log_rollout_data(0, batch)  # the check passes
        steps = worker.train(0, batch)
    # Exactly the actor's old log-probs, token by token, once the reference routes as the
    # rollout did; its own forward (the KL loss's) still routes by itself and differs.
    for actor, replayed in zip(batch.log_probs, batch.ref_replayed_log_probs, strict=True):
        assert torch.equal(actor, replayed)
    assert rollout[REPLAYED] == 0.0
    assert rollout["rollout/log_probs_ref_max_abs_diff"] > 1e-3
    assert steps[0]["train/kl_loss"] > 1e-5
    # Per micro-batch: the normal forward routes naturally, the check-only one replays.
    calls = [(layer, used, natural) for layer, _, used, natural in ref.calls]
    per_forward = LAYERS
    assert len(calls) == 2 * micro_batches(batch) * per_forward
    for k in range(0, len(calls), 2 * per_forward):
        normal, check = calls[k : k + per_forward], calls[k + per_forward : k + 2 * per_forward]
        assert all(torch.equal(used, routing_map(nat)) for _, used, nat in normal)
        assert any(not torch.equal(used, routing_map(nat)) for _, used, nat in check)


@pytest.mark.parametrize("own_checkpoint", [False, True], ids=["actors-start", "ref-load"])
def test_under_r3_a_wrong_reference_stops_the_run_at_rollout_0(
    dist_env, trained_checkpoint, monkeypatch, own_checkpoint
):
    """The reference scaled by 1.01 (the certifier's planted fault): against the actor, with the
    rollout's routing replayed; with a trained checkpoint as its own `train.ref_load`, against
    a second reference built from it (each routing by itself)."""
    monkeypatch.setenv(PLANT_ENV, Fault.REFERENCE.value)
    train = backend(ref_load=trained_checkpoint if own_checkpoint else None)
    algorithm = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.01)
    with running(BOTH, train, algorithm=algorithm, ci_kl_checker=LOOSE) as plugins:
        worker = MegatronWorker(train, algorithm, SamplingConfig(), plugins)
        batch = worker.prepare(0, make_samples())
        with pytest.raises(KLCheckError) as info:
            worker.log_rollout_data(0, batch)
    error = info.value
    check, metric = (
        (Check.ROLLOUT_REF_REBUILT_LOG_PROBS, REBUILT)
        if own_checkpoint
        else (Check.ROLLOUT_REF_REPLAYED_LOG_PROBS, REPLAYED)
    )
    assert error.check == check
    assert error.step == "rollout 0 (log_rollout_data)"
    assert error.metrics[metric] > 1e-3
    assert f"|{metric}| = " in str(error) and "expected < 1e-08" in str(error)


class AnyDifference:
    """A plugin whose exemption is not about routing: the checker cannot restore exactness."""

    @hookimpl
    def ember_kl_check_exemptions(self) -> KLExemption:
        return KLExemption("adapter", "only the actor carries an adapter", ExemptionScope.ANY)


@pytest.mark.parametrize(
    ("ci", "disable", "extra", "extra_forward"),
    [
        (True, False, (), True),
        (False, False, (), False),
        (True, True, (), False),
        (True, False, (AnyDifference(),), False),
    ],
    ids=["ci", "not_ci", "disabled", "exemption_not_about_routing"],
)
def test_the_replayed_reference_forward_runs_only_at_rollout_0_of_a_routing_exempt_ci_run(
    dist_env, monkeypatch, ci, disable, extra, extra_forward
):
    # A wrong reference: wherever the replayed check does not run, nothing stops the run.
    monkeypatch.setenv(PLANT_ENV, Fault.REFERENCE.value)
    train = backend()
    algorithm = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.01)
    checker = KLCheckerConfig(
        disable=disable,
        train_rollout_logprob_abs_diff_threshold=10.0,
        train_rollout_logprob_max_abs_diff_threshold=10.0,
        recorded_routing_agreement_min=0.0,  # the samples' experts are random
    )
    with running(BOTH, train, algorithm=algorithm, extra=extra, ci=ci, ci_kl_checker=checker) as (
        plugins
    ):
        worker = MegatronWorker(train, algorithm, SamplingConfig(), plugins)
        forwards = ForwardCount(worker.ref)
        counts, logged = [], []
        for rollout_id in (0, 1):
            batch = worker.prepare(rollout_id, make_samples(seed=rollout_id))
            counts.append(forwards.count / micro_batches(batch))
            forwards.count = 0
            if extra_forward and rollout_id == 0:
                with pytest.raises(KLCheckError, match=Check.ROLLOUT_REF_REPLAYED_LOG_PROBS):
                    worker.log_rollout_data(rollout_id, batch)
                continue
            logged.append(REPLAYED in worker.log_rollout_data(rollout_id, batch))
            worker.train(rollout_id, batch)  # kl_loss > 0 stands down or is not checked
    assert counts == ([2.0, 1.0] if extra_forward else [1.0, 1.0])
    assert not any(logged)


# -- replay on a whole GPTModel -------------------------------------------------------------


@pytest.mark.parametrize("preset", FAMILY_PRESETS)
def test_actor_forwards_and_backward_recompute_use_the_rollout_experts(dist_env, preset):
    train = backend(model=preset, micro_batch_size=3, num_steps_per_rollout=2)
    moe = train.model_config().moe_layers
    samples = make_samples(10, seed=1, dense=train.model_config().dense_layers)
    algorithm = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.01)
    with running(["r3_routing"], train, extra=[Recompute()]) as plugins:
        worker = MegatronWorker(train, algorithm, SamplingConfig(), plugins)
        assert worker.actor.module.config.recompute_granularity == "full"
        actor, ref = RouterLog(worker.actor), RouterLog(worker.ref)
        batch = worker.prepare(0, samples)
        scored = list(actor.calls)
        actor.calls.clear()
        worker.train(0, batch)
        actor.close()
        ref.close()

    micro_batches = [[samples[i] for i in mb] for step in batch.steps for mb in step]
    assert max(len(mb) for mb in micro_batches) == 3  # packed micro-batches of several samples
    # Scoring: one no-grad forward per micro-batch, layers in order.
    expected = [(mb, layer, False) for mb in micro_batches for layer in moe]
    # Training: per micro-batch, the checkpointed forward (no grad inside each checkpoint),
    # then its backward, which recomputes every layer with grad, last layer first.
    trained = []
    for mb in micro_batches:
        trained += [(mb, layer, False) for layer in moe]
        trained += [(mb, layer, True) for layer in reversed(moe)]
    for calls, plan in ((scored, expected), (actor.calls, trained)):
        assert len(calls) == len(plan)
        for (layer, grad, used, natural), (mb, want_layer, want_grad) in zip(
            calls, plan, strict=True
        ):
            assert (layer, grad) == (want_layer, want_grad)
            want, valid = rollout_map(mb, layer)
            assert torch.equal(used[valid], want[valid])
            # The rollout's experts are random: the router alone would pick others.
            assert not torch.equal(routing_map(natural)[valid], want[valid])
    # The reference routes by itself, under the same contexts.
    assert ref.calls and all(torch.equal(used, routing_map(nat)) for _, _, used, nat in ref.calls)


def assign_unpicked_experts(model, plugins, samples: list[Sample], inputs: dict) -> None:
    """Give every MoE row of `samples` the experts its live router ranks lowest.

    Layer l's input depends on the experts of layers < l only, so fixing one layer per forward,
    in layer order with the earlier ones already replaying, makes every layer's replayed
    experts ones its router would not pick at that point.
    """
    routers = sorted(
        (m for m in model.modules() if isinstance(m, TopKRouter)), key=lambda r: r.layer_number
    )
    batch = batch_of(model, samples)
    for router in routers:
        layer = router.layer_number - 1
        seen = []
        handle = router.register_forward_pre_hook(lambda m, args, seen=seen: seen.append(args[0]))
        try:
            with torch.no_grad(), plugins.forward_context(Role.ACTOR, Phase.LOG_PROB, batch):
                model(**inputs)
            logits = router.gating(seen[0]).view(-1, EXPERTS)
            natural = natural_routing(router, seen[0])
        finally:
            handle.remove()
        # The lowest-scored experts outside the router's own choice.
        worst = logits.masked_fill(natural, float("inf")).topk(TOPK, dim=-1, largest=False).indices
        worst = router_rows_to_stream(worst, pack_samples(samples))
        start = 0
        for sample in samples:
            count = sample.rollout_routed_experts.shape[0]
            sample.rollout_routed_experts[:, layer] = worst[start : start + count]
            start += count + 1  # the sample's last token has no rollout experts


@pytest.mark.parametrize("preset", FAMILY_PRESETS)
def test_experts_the_routers_would_not_pick_still_train_every_router(dist_env, preset):
    train = backend(model=preset)
    cfg = train.model_config()
    samples = make_samples(3, seed=2, dense=cfg.dense_layers)
    inputs = model_inputs(pack_samples(samples))
    grads = []
    with running(["r3_routing"], train) as plugins:
        for recompute in (False, True):

            def adjust(config, recompute=recompute):
                plugins.model_config(Role.ACTOR, config)
                if recompute:
                    Recompute().ember_model_config(Role.ACTOR, config)

            model = build_model(cfg, seed=5, adjust_config=adjust)
            if not recompute:
                assign_unpicked_experts(model, plugins, samples, inputs)
            model.train()
            log = RouterLog(model)
            batch = batch_of(model, samples)
            with plugins.forward_context(Role.ACTOR, Phase.TRAIN, batch):
                loss = model(**inputs).square().mean()
            with plugins.forward_context(Role.ACTOR, Phase.BACKWARD, batch):
                loss.backward()
            log.close()
            assert len(log.calls) == (2 if recompute else 1) * len(cfg.moe_layers)
            for layer, _, used, natural in log.calls:
                want, valid = rollout_map(samples, layer)
                assert torch.equal(used[valid], want[valid])
                # Not one replayed expert is among the router's own top-k.
                assert not (routing_map(natural) & want)[valid].any()
            grads.append([r.weight.grad.clone() for r in log.routers])
    assert all(g.abs().sum() > 0 for g in grads[0])
    for with_recompute, without in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(with_recompute, without)


# -- the embedded engine's replay against megatron-core's -----------------------------------


@pytest.mark.parametrize("preset", FAMILY_PRESETS)
def test_the_embedded_engine_replays_experts_as_megatron_core_does(dist_env, tmp_path, preset):
    """`ember certify`'s row 3 compares the trainer's replayed forward with the embedded
    engine's (`replay_routing`): in every family both must weigh the same experts alike."""
    from transformers import AutoModelForCausalLM

    from ember_megatron_backend.weights import export_hf_checkpoint
    from ember_rollout.routing import replay_routing

    train = backend(model=preset)
    samples = make_samples(3, seed=4, dense=train.model_config().dense_layers)
    temperature = 0.8
    with running(["r3_routing"], train) as plugins:
        sampling = SamplingConfig(temperature=temperature)
        worker = MegatronWorker(train, AlgorithmConfig(), sampling, plugins)
        replayed = worker.prepare(0, samples).log_probs
        export_hf_checkpoint(worker.actor, train.model_config(), tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()

    def engine_log_probs(sample: Sample, replay: bool) -> torch.Tensor:
        tokens = torch.tensor([sample.tokens[:-1]])
        routing = replay_routing(model, sample.rollout_routed_experts) if replay else None
        with torch.no_grad(), routing or contextlib.nullcontext():
            logits = model(input_ids=tokens).logits[0].double() / temperature
        rows = logits[sample.total_length - sample.response_length - 1 :].log_softmax(-1)
        return rows.gather(1, torch.tensor(sample.tokens[-sample.response_length :])[:, None])[:, 0]

    for sample, trainer in zip(samples, replayed, strict=True):
        torch.testing.assert_close(
            engine_log_probs(sample, replay=True), trainer.double(), atol=1e-5, rtol=0
        )
        # The rollout's experts are random: routing afresh gives other log-probs.
        assert (engine_log_probs(sample, replay=False) - trainer.double()).abs().max() > 1e-3
