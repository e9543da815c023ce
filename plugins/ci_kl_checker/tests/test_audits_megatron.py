"""Audits of the default loop (overlapped rollouts, the engine's log-probs as the old policy)
under routing replay, on a real MegatronWorker (megatron-core on CPU) with both plugins: the
README's "R3 + CI checks" run. Each fault injected into the worker stops the run at the check
that guards it: a wrong reference, +2^-10 on one trainer log-prob, engine log-probs shifted by
one token, replay switched off after rollout 0.

The engine here is a second worker of the same seed scoring under replay, so its log-probs are
the trainer's exactly, as an fp32 engine's are to within the per-token ceiling.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from megatron.core.transformer.moe.router_replay import RouterReplay

from ember_ci_kl_checker import Check, KLCheckerConfig, KLCheckError
from ember_ci_kl_checker import plugin as checker_plugin
from ember_core.certify import PLANT_ENV, Fault
from ember_core.config import AlgorithmConfig, CIConfig, SamplingConfig
from ember_core.plugins import EmberPlugins
from ember_core.types import Sample
from ember_megatron_backend.config import BackendConfig, OptimizerConfig
from ember_megatron_backend.parallel import destroy_distributed, init_distributed
from ember_megatron_backend.worker import MegatronWorker
from ember_r3_routing import R3RoutingConfig, replay
from ember_r3_routing import plugin as r3_plugin

pytestmark = pytest.mark.filterwarnings("ignore:full scope is deprecated:UserWarning")

LAYERS, EXPERTS, TOPK, VOCAB = 4, 8, 2, 256
LOGGER = "ember_ci_kl_checker.plugin"
D = 2.0**-10
"""A per-token fault: exact in fp32 next to log-probs of a few units, about 10x the fp32 ceiling."""


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """What the plugins read of the default run config (examples/default.yaml)."""

    train: BackendConfig
    algorithm: AlgorithmConfig = field(
        default_factory=lambda: AlgorithmConfig(use_rollout_log_probs=True)
    )
    rollout: SamplingConfig = field(default_factory=lambda: SamplingConfig(async_=True))
    engine: dict[str, Any] = field(
        default_factory=lambda: {"kind": "hf", "hf": {"dtype": "float32"}}
    )
    plugins: list[str] = field(default_factory=lambda: ["r3_routing", "ci_kl_checker"])
    ci: CIConfig = field(default_factory=lambda: CIConfig(test=True))


@pytest.fixture(scope="session")
def dist_env():
    torch.set_num_threads(2)
    init_distributed()
    yield
    destroy_distributed()


def backend(**changes) -> BackendConfig:
    settings = dict(
        model="tiny-moe",
        model_overrides={"init_method_std": 0.1},
        optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.0),
        num_steps_per_rollout=2,
        micro_batch_size=4,
    )
    settings.update(changes)
    return BackendConfig(**settings)


@contextlib.contextmanager
def running(
    train: BackendConfig, routing_floor: float = 0.0, **algorithm
) -> Iterator[EmberPlugins]:
    """Both plugins registered and configured as the default run in CI mode. The samples'
    experts are random, so the trainer's own routing agrees with them about as often as
    chance: the recorded-routing floor is 0 unless a test sets it."""
    plugins = EmberPlugins()
    plugins.register(r3_plugin, "r3_routing")
    plugins.register(checker_plugin, "ci_kl_checker")
    config = RunConfig(train=train)
    for key, value in algorithm.items():
        setattr(config.algorithm, key, value)
    try:
        plugins.configure(
            config,
            {
                "r3_routing": R3RoutingConfig(),
                "ci_kl_checker": KLCheckerConfig(
                    audit_interval=2, recorded_routing_agreement_min=routing_floor
                ),
            },
        )
        yield plugins
    finally:
        plugins.unregister("r3_routing")
        plugins.unregister("ci_kl_checker")
        r3_plugin._config = None
        checker_plugin._checker = None
        RouterReplay.clear_global_router_replay_instances()


def make_samples(version: int, seed: int = 0) -> list[Sample]:
    """Scored samples in groups of two with valid random rollout experts, generated from
    weight version `version`; no engine log-probs yet."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for k in range(8):
        length = int(torch.randint(9, 15, (1,), generator=g))
        response = int(torch.randint(3, length - 3, (1,), generator=g))
        order = torch.rand(length - 1, LAYERS, EXPERTS, generator=g).argsort(dim=-1)
        samples.append(
            Sample(
                tokens=torch.randint(0, VOCAB, (length,), generator=g).tolist(),
                response_length=response,
                index=k,
                group_index=k // 2,
                reward=float(k % 2),
                rollout_routed_experts=order[..., :TOPK].to(torch.uint8),
                weight_version=str(version),
            )
        )
    return samples


def engine_log_probs(engine: MegatronWorker, samples: list[Sample]) -> list[Sample]:
    """Give `samples` the log-probs the engine (a worker scoring under replay) sampled with."""
    scored = engine.prepare(0, samples)
    for sample, log_probs in zip(samples, scored.log_probs, strict=True):
        sample.rollout_log_probs = log_probs.tolist()
    return samples


@pytest.fixture
def run(dist_env):
    """(worker, engine): the trainer of the default loop and its engine, same weights."""
    with running(backend()) as plugins:
        engine = MegatronWorker(backend(), AlgorithmConfig(), SamplingConfig(), plugins)
        algorithm = AlgorithmConfig(use_rollout_log_probs=True)
        worker = MegatronWorker(backend(), algorithm, SamplingConfig(), plugins)
        yield worker, engine


@pytest.fixture(scope="module")
def other_checkpoint(dist_env, tmp_path_factory):
    """A transformers checkpoint of the same shape, from another seed: a wrong reference."""
    other = MegatronWorker(backend(seed=7), AlgorithmConfig(), SamplingConfig())
    return str(other.export_hf(tmp_path_factory.mktemp("other")))


def test_the_default_loop_is_audited_exactly_and_stands_down_between_audits(run, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    worker, engine = run
    # Rollout 0, an audit: the trainer scores it itself although the old policy is the engine's.
    batch = worker.prepare(0, engine_log_probs(engine, make_samples(-1)))
    assert batch.audit and not batch.old_from_engine
    rollout = worker.log_rollout_data(0, batch)
    assert rollout["rollout/audit"] == 1.0
    assert rollout["rollout/train_rollout_logprob_max_abs_diff"] == 0.0
    steps = worker.train(0, batch)
    assert steps[0]["train/ppo_kl"] == 0.0
    assert [s["train/replay_agreement"] for s in steps] == [1.0, 1.0]
    # Rollout 1 was generated ahead, from the weights before rollout 0's updates: no audit, no
    # scoring forward; the gap to the engine is logged as staleness, not as a mismatch.
    stale = worker.prepare(1, engine_log_probs(engine, make_samples(-1, seed=1)))
    assert not stale.audit and stale.old_from_engine and stale.stale
    rollout = worker.log_rollout_data(1, stale)
    assert "rollout/audit" not in rollout and "rollout/log_probs" not in rollout
    steps = worker.train(1, stale)
    assert steps[0]["train/stale_rollout_logprob_abs_diff"] > 1e-4
    assert "train/train_rollout_logprob_abs_diff" not in steps[0]
    assert [s["train/replay_agreement"] for s in steps] == [1.0, 1.0]
    # Rollout 2, an audit, must come from the trainer's weights: a rollout generated ahead
    # into it is refused.
    with pytest.raises(RuntimeError, match="the driver must let no rollout generate ahead"):
        worker.prepare(2, engine_log_probs(engine, make_samples(0, seed=2)))
    engine.actor.module.load_state_dict(worker.actor.module.state_dict())
    batch = worker.prepare(2, engine_log_probs(engine, make_samples(1, seed=2)))
    rollout = worker.log_rollout_data(2, batch)
    assert rollout["rollout/train_rollout_logprob_max_abs_diff"] == 0.0
    assert worker.train(2, batch)[0]["train/ppo_kl"] == 0.0
    audited = [m.getMessage() for m in caplog.records if " passed: " in m.getMessage()]
    for rollout_id in (0, 2):
        checks = {m.split(": ")[2].split(" ")[0] for m in audited if f"rollout {rollout_id}" in m}
        assert checks == {
            Check.TRAIN_ROLLOUT_MISMATCH_MAX,
            Check.TRAIN_ROLLOUT_MISMATCH,
            Check.PPO_KL,
            Check.PPO_KL_MAX,
            Check.REPLAY_AGREEMENT,
            Check.RECORDED_ROUTING,  # against a floor of 0 here: the experts are random
            Check.SHIFTED_REPLAY,
        }


@pytest.mark.parametrize("own_checkpoint", [False, True], ids=["actors-start", "ref-load"])
def test_a_wrong_reference_stops_the_run(dist_env, other_checkpoint, monkeypatch, own_checkpoint):
    """The reference is scaled by 1.01 (the certifier's planted fault): against the actor's
    start it fails the replayed reference check, and where it comes from a checkpoint of its
    own (`train.ref_load`, which the actor need not equal) the check against that checkpoint."""
    monkeypatch.setenv(PLANT_ENV, Fault.REFERENCE.value)
    train = backend(ref_load=other_checkpoint if own_checkpoint else None)
    with running(train, use_kl_loss=True, kl_loss_coef=0.01) as plugins:
        engine = MegatronWorker(backend(), AlgorithmConfig(), SamplingConfig(), plugins)
        algorithm = AlgorithmConfig(use_rollout_log_probs=True, use_kl_loss=True, kl_loss_coef=0.01)
        worker = MegatronWorker(train, algorithm, SamplingConfig(), plugins)
        batch = worker.prepare(0, engine_log_probs(engine, make_samples(-1)))
        with pytest.raises(KLCheckError) as info:
            worker.log_rollout_data(0, batch)
    error = info.value
    if own_checkpoint:
        assert error.check == Check.ROLLOUT_REF_REBUILT_LOG_PROBS
        assert error.metrics["rollout/ref_rebuilt_log_probs_max_abs_diff"] > 1e-3
    else:  # under replay the reference that replays the rollout's routing is the one compared
        assert error.check == Check.ROLLOUT_REF_REPLAYED_LOG_PROBS
        assert error.metrics["rollout/ref_replayed_log_probs_max_abs_diff"] > 1e-3
    assert error.metrics["rollout/train_rollout_logprob_max_abs_diff"] == 0.0


def test_one_trainer_log_prob_off_by_2_to_the_minus_10_stops_the_run(run):
    worker, engine = run
    batch = worker.prepare(0, engine_log_probs(engine, make_samples(-1)))
    batch.log_probs[1][0] += D
    with pytest.raises(KLCheckError) as info:
        worker.log_rollout_data(0, batch)
    error = info.value
    assert error.check == Check.TRAIN_ROLLOUT_MISMATCH_MAX
    assert error.metrics["rollout/train_rollout_logprob_max_abs_diff"] == D
    # The mean of the same gap is far inside slime's ceiling: only the maximum sees it.
    assert error.metrics["rollout/train_rollout_logprob_abs_diff"] < 1e-3
    assert error.detail == (
        "rollout/train_rollout_logprob_max_abs_diff = 9.766e-04, expected <= 0.0005 "
        "(ci_kl_checker.train_rollout_logprob_max_abs_diff_threshold)"
    )


def test_two_old_log_probs_of_a_sample_swapped_stop_the_first_step(run):
    """A within-sample permutation of the old log-probs: the signed mean train/ppo_kl stays
    exactly 0 (the two differences are exact negatives), the per-token maximum does not."""
    worker, engine = run
    batch = worker.prepare(0, engine_log_probs(engine, make_samples(-1)))
    old = batch.log_probs[0]
    assert old[0] != old[1]
    for values in (batch.log_probs[0], batch.rollout_log_probs[0]):  # the engine agrees
        values[[0, 1]] = values[[1, 0]]
    worker.log_rollout_data(0, batch)  # engine and trainer agree token by token
    with pytest.raises(KLCheckError) as info:
        worker.train(0, batch)
    error = info.value
    assert error.check == Check.PPO_KL_MAX
    assert error.metrics["train/ppo_kl"] == 0.0
    assert error.metrics["train/ppo_kl_abs_max"] == pytest.approx(abs(float(old[0] - old[1])))


def test_engine_log_probs_shifted_by_one_token_stop_the_run(run):
    worker, engine = run
    samples = engine_log_probs(engine, make_samples(-1))
    for sample in samples:
        sample.rollout_log_probs = sample.rollout_log_probs[1:] + sample.rollout_log_probs[:1]
    batch = worker.prepare(0, samples)
    with pytest.raises(KLCheckError) as info:
        worker.log_rollout_data(0, batch)
    assert info.value.check == Check.TRAIN_ROLLOUT_MISMATCH_MAX
    assert info.value.metrics["rollout/train_rollout_logprob_max_abs_diff"] > 0.1


def test_replay_switched_off_after_rollout_0_stops_the_run(run, monkeypatch):
    worker, engine = run
    batch = worker.prepare(0, engine_log_probs(engine, make_samples(-1)))
    worker.log_rollout_data(0, batch)
    worker.train(0, batch)
    # From rollout 1 on the plugin's forward contexts replay nothing.
    monkeypatch.setattr(replay, "replay_context", lambda *args: contextlib.nullcontext())
    stale = worker.prepare(1, engine_log_probs(engine, make_samples(-1, seed=1)))
    worker.log_rollout_data(1, stale)  # no audit, no scoring forward: nothing to see yet
    with pytest.raises(KLCheckError) as info:
        worker.train(1, stale)
    error = info.value
    assert error.check == Check.REPLAY_AGREEMENT
    assert error.step == "rollout 1, step 0 (accumulated step 2)"
    assert error.metrics["train/replay_agreement"] < 0.5


def test_replay_off_stops_the_audit_at_its_shifted_experts_probe(run, monkeypatch):
    """Each audit under replay also scores the rollout with its experts moved to the next id
    (experts no router picks by itself): with replay off (the certifier's planted fault, which
    records the experts but replays none) that forward follows its own routing, and the audit
    stops before any training step."""
    worker, engine = run
    samples = engine_log_probs(engine, make_samples(-1))
    monkeypatch.setenv(PLANT_ENV, Fault.REPLAY_OFF.value)
    batch = worker.prepare(0, samples)
    with pytest.raises(KLCheckError) as info:
        worker.log_rollout_data(0, batch)
    error = info.value
    assert error.check == Check.SHIFTED_REPLAY
    assert error.metrics["rollout/shifted_replay_agreement"] < 0.1


def test_an_audit_replays_the_shifted_experts_exactly(run, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    worker, engine = run
    batch = worker.prepare(0, engine_log_probs(engine, make_samples(-1)))
    assert worker.log_rollout_data(0, batch)["rollout/shifted_replay_agreement"] == 1.0
    assert any(
        "audit rollout 0 (log_rollout_data): shifted_replay_agreement passed" in r.getMessage()
        for r in caplog.records
    )
    worker.train(0, batch)
    stale = worker.prepare(1, engine_log_probs(engine, make_samples(-1, seed=1)))
    assert stale.shifted_routing is None  # no audit, no probe


def test_recorded_experts_that_are_not_the_trainers_stop_the_audit(dist_env):
    """Replay takes whatever experts were recorded (replay agreement 1.0 here); the audit's
    scoring, before replay, finds that the trainer's routers would pick others: these random
    experts agree about as often as chance (1 / C(8, 2) = 0.036), far under the default floor."""
    with running(backend(), routing_floor=KLCheckerConfig().recorded_routing_agreement_min) as p:
        engine = MegatronWorker(backend(), AlgorithmConfig(), SamplingConfig(), p)
        algorithm = AlgorithmConfig(use_rollout_log_probs=True)
        worker = MegatronWorker(backend(), algorithm, SamplingConfig(), p)
        batch = worker.prepare(0, engine_log_probs(engine, make_samples(-1)))
        with pytest.raises(KLCheckError) as info:
            worker.log_rollout_data(0, batch)
    error = info.value
    assert error.check == Check.RECORDED_ROUTING
    assert error.metrics["rollout/routing_agreement"] < 0.2
    assert error.metrics["rollout/train_rollout_logprob_max_abs_diff"] == 0.0
