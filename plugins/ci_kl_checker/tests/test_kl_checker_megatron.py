"""The checker on a real MegatronWorker (megatron-core on CPU): each injected fault stops the run
in CI mode with the check's message. The faults: a reference that is not the weights it should
start from (the actor's, or its own `train.ref_load`), an actor/reference difference that
cancels in the means, old log-probs that are not the actor's
(a non-zero first-step ppo_kl), and engine log-probs farther from the trainer's than the ceiling.

The passing cases (a reference copied from the actor, with and without routing replay) run in
`plugins/r3_routing/tests/test_r3_megatron.py`, next to the plugin that changes the forward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pytest
import torch

from ember_ci_kl_checker import Check, KLCheckerConfig, KLCheckError
from ember_ci_kl_checker import plugin as checker_plugin
from ember_core.certify import PLANT_ENV, Fault
from ember_core.config import AlgorithmConfig, CIConfig, SamplingConfig
from ember_core.plugins import EmberPlugins
from ember_core.types import Sample
from ember_megatron_backend.config import BackendConfig, OptimizerConfig
from ember_megatron_backend.parallel import destroy_distributed, init_distributed
from ember_megatron_backend.worker import MegatronWorker

pytestmark = pytest.mark.filterwarnings("ignore:full scope is deprecated:UserWarning")

LOGGER = "ember_ci_kl_checker.plugin"


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """The parts of a run config the checker reads (and the backend section)."""

    train: BackendConfig
    algorithm: AlgorithmConfig = field(
        default_factory=lambda: AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.01)
    )
    plugins: list[str] = field(default_factory=lambda: ["ci_kl_checker"])
    ci: CIConfig = field(default_factory=lambda: CIConfig(test=True))


@pytest.fixture(scope="session")
def dist_env():
    """torch.distributed (gloo, one process) and megatron-core's parallel state, kept for the
    session like the backend tests' fixture (megatron-core's state is process-global)."""
    torch.set_num_threads(2)
    init_distributed()
    yield
    destroy_distributed()


def backend(**changes) -> BackendConfig:
    return BackendConfig(
        model="tiny-moe",
        model_overrides={"num_layers": 2, "init_method_std": 0.1},
        optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.0),
        **changes,
    )


@pytest.fixture(scope="module")
def other_checkpoint(dist_env, tmp_path_factory):
    """A transformers checkpoint of the same shape, from another seed."""
    other = MegatronWorker(backend(seed=7), AlgorithmConfig(), SamplingConfig())
    return str(other.export_hf(tmp_path_factory.mktemp("other")))


@pytest.fixture
def checker(dist_env):
    """A facade with the checker registered (workers need the distributed state too)."""
    plugins = EmberPlugins()
    plugins.register(checker_plugin, "ci_kl_checker")
    try:
        yield plugins
    finally:
        plugins.unregister("ci_kl_checker")
        checker_plugin._checker = None


def make_samples(count: int = 4) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    samples = []
    for k in range(count):
        length = int(torch.randint(8, 14, (1,), generator=g))
        samples.append(
            Sample(
                tokens=torch.randint(0, 256, (length,), generator=g).tolist(),
                response_length=4,
                index=k,
                group_index=k // 2,
                reward=float(k % 2),
            )
        )
    return samples


def worker_with(
    checker: EmberPlugins,
    train: BackendConfig,
    *,
    disable: bool,
    engine_old: bool = False,
    **section,
) -> MegatronWorker:
    config = RunConfig(train=train)
    config.algorithm.use_rollout_log_probs = engine_old
    checker.configure(config, {"ci_kl_checker": KLCheckerConfig(disable=disable, **section)})
    return MegatronWorker(train, config.algorithm, SamplingConfig(), checker)


def wrong_reference(monkeypatch) -> None:
    """The reference the worker builds next has its weights scaled by 1.01 (the certifier's
    planted fault: the run's reference only, not one a check builds again from its source)."""
    monkeypatch.setenv(PLANT_ENV, Fault.REFERENCE.value)


def test_a_wrong_reference_fails_both_checks(checker, monkeypatch):
    wrong_reference(monkeypatch)
    worker = worker_with(checker, backend(), disable=False)
    batch = worker.prepare(0, make_samples())
    with pytest.raises(KLCheckError) as rollout:
        worker.log_rollout_data(0, batch)
    error = rollout.value
    assert error.check == Check.ROLLOUT_REF_LOG_PROBS
    assert error.step == "rollout 0 (log_rollout_data)"
    assert {"rollout/log_probs", "rollout/ref_log_probs", "rollout/rewards"} <= set(error.metrics)
    assert error.metrics["rollout/log_probs_ref_max_abs_diff"] > 1e-3
    assert "|rollout/log_probs_ref_max_abs_diff| = " in str(error)
    assert repr(error.metrics) in str(error)

    # The train step reports its metrics before the check raises: ppo_kl passes, kl_loss fails.
    with pytest.raises(KLCheckError) as step:
        worker.train(0, batch)
    error = step.value
    assert error.check == Check.KL_LOSS
    assert error.step == "rollout 0, step 0 (accumulated step 0)"
    assert error.metrics["train/ppo_kl"] == 0.0 and error.metrics["train/kl_loss"] > 1e-5
    assert {"train/loss", "train/pg_loss", "train/grad_norm", "train/lr"} <= set(error.metrics)


def test_a_reference_from_a_checkpoint_of_its_own_is_checked_against_that_checkpoint(
    checker, other_checkpoint, monkeypatch
):
    """An SFT model as reference: the actor differs from it at rollout 0, which passes; the
    reference must be the model train.ref_load holds, built a second time to compare."""
    worker = worker_with(checker, backend(ref_load=other_checkpoint), disable=False)
    batch = worker.prepare(0, make_samples())
    rollout = worker.log_rollout_data(0, batch)
    assert rollout["rollout/log_probs_ref_max_abs_diff"] > 1e-3
    assert rollout["rollout/ref_rebuilt_log_probs_max_abs_diff"] == 0.0
    (step,) = worker.train(0, batch)
    assert step["train/ppo_kl"] == 0.0 and step["train/kl_loss"] > 1e-3

    checker_plugin._checker = None
    wrong_reference(monkeypatch)
    worker = worker_with(checker, backend(ref_load=other_checkpoint), disable=False)
    batch = worker.prepare(0, make_samples())
    with pytest.raises(KLCheckError) as info:
        worker.log_rollout_data(0, batch)
    assert info.value.check == Check.ROLLOUT_REF_REBUILT_LOG_PROBS
    assert info.value.metrics["rollout/ref_rebuilt_log_probs_max_abs_diff"] > 1e-3


def test_disable_turns_the_checks_off_with_one_warning(checker, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    wrong_reference(monkeypatch)
    worker = worker_with(checker, backend(), disable=True)
    batch = worker.prepare(0, make_samples())
    rollout = worker.log_rollout_data(0, batch)
    (step,) = worker.train(0, batch)
    assert rollout["rollout/log_probs_ref_max_abs_diff"] > 1e-3
    assert step["train/kl_loss"] > 1e-8
    records = [r for r in caplog.records if r.name == LOGGER]
    assert [(r.levelno, r.getMessage()) for r in records] == [
        (
            logging.WARNING,
            "ci_kl_checker: disabled by ci_kl_checker.disable=true; none of its checks runs",
        )
    ]


def test_a_per_token_difference_that_cancels_in_the_means_stops_the_run(checker):
    worker = worker_with(checker, backend(), disable=False)  # the reference copies the actor
    batch = worker.prepare(0, make_samples())
    assert all(torch.equal(a, r) for a, r in zip(batch.log_probs, batch.ref_log_probs, strict=True))
    # +d and -d on two counted tokens of one sample. Both changes are exact in fp32 (d is a
    # binary fraction), so every mean is unchanged and only the maximum sees them.
    d = 2.0**-10
    before = batch.ref_log_probs[1].clone()
    batch.ref_log_probs[1][0] += d
    batch.ref_log_probs[1][1] -= d
    assert (batch.ref_log_probs[1] - before).tolist()[:2] == [d, -d]
    with pytest.raises(KLCheckError) as info:
        worker.log_rollout_data(0, batch)
    error = info.value
    assert error.check == Check.ROLLOUT_REF_LOG_PROBS
    assert error.metrics["rollout/log_probs"] == error.metrics["rollout/ref_log_probs"]
    assert error.metrics["rollout/log_probs_ref_max_abs_diff"] == d
    assert "|rollout/log_probs_ref_max_abs_diff| = 9.766e-04, expected < 1e-08" in str(error)


def test_old_log_probs_that_are_not_the_actors_fail_the_first_step_ppo_kl(checker):
    worker = worker_with(checker, backend(), disable=False)
    batch = worker.prepare(0, make_samples())
    worker.log_rollout_data(0, batch)  # exactly on-policy so far
    for old in batch.log_probs:
        old -= 0.01
    with pytest.raises(KLCheckError) as info:
        worker.train(0, batch)
    error = info.value
    assert error.check == Check.PPO_KL
    assert error.step == "rollout 0, step 0 (accumulated step 0)"
    assert error.metrics["train/ppo_kl"] == pytest.approx(-0.01, abs=1e-6)
    assert "|train/ppo_kl| = 1.000e-02, expected < 1e-08" in str(error)


def with_engine_log_probs(worker: MegatronWorker, offset: float) -> list[Sample]:
    """Samples whose engine log-probs are the trainer's own, shifted by `offset`."""
    samples = make_samples()
    for sample, log_probs in zip(samples, worker.prepare(0, samples).log_probs, strict=True):
        sample.rollout_log_probs = (log_probs + offset).tolist()
    return samples


def test_engine_log_probs_beyond_the_ceiling_stop_the_run(checker):
    worker = worker_with(checker, backend(), disable=False)
    close = worker.prepare(0, with_engine_log_probs(worker, 0.05))
    rollout = worker.log_rollout_data(0, close)
    assert rollout["rollout/train_rollout_logprob_abs_diff"] == pytest.approx(0.05, abs=1e-6)
    far = worker.prepare(0, with_engine_log_probs(worker, -2.5))
    with pytest.raises(KLCheckError) as info:
        worker.log_rollout_data(0, far)
    error = info.value
    # The per-token maximum is checked first (2.0 where the engine's dtype is not known).
    assert error.check == Check.TRAIN_ROLLOUT_MISMATCH_MAX
    assert error.step == "rollout 0 (log_rollout_data)"
    assert error.detail == (
        "rollout/train_rollout_logprob_max_abs_diff = 2.500e+00, expected <= 2 "
        "(ci_kl_checker.train_rollout_logprob_max_abs_diff_threshold)"
    )
    # A mean over slime's 0.1 with every token inside the maximum's bar fails the mean.
    middling = worker.prepare(0, with_engine_log_probs(worker, -0.25))
    with pytest.raises(KLCheckError) as info:
        worker.log_rollout_data(0, middling)
    assert info.value.check == Check.TRAIN_ROLLOUT_MISMATCH
    # Each step's own mean is bounded too (slime's check of the train/ metric).
    with pytest.raises(KLCheckError) as info:
        worker.train(0, far)
    assert info.value.check == Check.TRAIN_ROLLOUT_MISMATCH
    assert info.value.metrics["train/train_rollout_logprob_abs_diff"] == pytest.approx(2.5)
    assert info.value.metrics["train/ppo_kl"] == 0.0 and info.value.metrics["train/kl_loss"] == 0.0


@pytest.mark.parametrize("offset", [0.05, -0.25])
def test_engine_old_log_probs_train_within_the_ceiling_and_stop_beyond_it(checker, offset):
    """With `use_rollout_log_probs`, outside audits (rollout 1 here), the first step's ratio is
    taken against the engine's log-probs: its ppo_kl is their offset, which no longer fails;
    the ceiling still does."""
    scorer = MegatronWorker(backend(), AlgorithmConfig(), SamplingConfig())  # same weights
    samples = with_engine_log_probs(scorer, offset)
    worker = worker_with(checker, backend(), disable=False, engine_old=True)
    batch = worker.prepare(1, samples)
    rollout = worker.log_rollout_data(1, batch)
    assert "rollout/log_probs" not in rollout and "rollout/rollout_log_probs" in rollout
    if offset > 0:
        steps = worker.train(1, batch)
        assert steps[0]["train/ppo_kl"] == pytest.approx(offset, abs=1e-6)
        assert steps[0]["train/train_rollout_logprob_abs_diff"] == pytest.approx(offset, abs=1e-6)
        assert steps[0]["train/kl_loss"] == 0.0  # the reference forward still runs
        return
    with pytest.raises(KLCheckError) as info:
        worker.train(1, batch)
    assert info.value.check == Check.TRAIN_ROLLOUT_MISMATCH
    assert info.value.step == "rollout 1, step 0 (accumulated step 0)"
    assert info.value.metrics["train/ppo_kl"] == pytest.approx(offset, abs=1e-6)


REBUILT = "rollout/ref_rebuilt_log_probs_max_abs_diff"


@pytest.mark.slow
def test_a_resumed_run_checks_the_checkpoints_reference_at_its_first_audit(checker, tmp_path):
    """Rollouts 0 and 1 trained and saved; rollout 2 is an audit (interval 2). The run that
    goes on in its process compares nothing new there; a run resumed from the checkpoint, in a
    fresh process (a fresh checker), compares the checkpoint's reference with one rebuilt from
    its source, and trains exactly as the uninterrupted run does."""
    worker = worker_with(checker, backend(), disable=False, audit_interval=2)
    for rollout_id in (0, 1):
        batch = worker.prepare(rollout_id, make_samples())
        worker.log_rollout_data(rollout_id, batch)
        worker.train(rollout_id, batch)
    worker.save_checkpoint(tmp_path)
    batch = worker.prepare(2, make_samples())
    want = worker.log_rollout_data(2, batch), worker.train(2, batch)
    assert REBUILT not in want[0]

    checker_plugin._checker = None
    resumed = worker_with(checker, backend(), disable=False, audit_interval=2)
    resumed.load_checkpoint(tmp_path)
    batch = resumed.prepare(2, make_samples())
    rollout = resumed.log_rollout_data(2, batch)
    assert rollout.pop(REBUILT) == 0.0
    # Training moved the actor: the reference can only be checked against its source now.
    assert rollout["rollout/log_probs_ref_max_abs_diff"] > 1e-4
    assert (rollout, resumed.train(2, batch)) == want

    # A checkpoint whose reference is not the run's (here: the trained actor's weights).
    checker_plugin._checker = None
    wrong = worker_with(checker, backend(), disable=False, audit_interval=2)
    wrong.load_checkpoint(tmp_path)
    wrong.ref.load_state_dict(wrong.actor.module.state_dict())
    batch = wrong.prepare(2, make_samples())
    with pytest.raises(KLCheckError) as info:
        wrong.log_rollout_data(2, batch)
    assert info.value.check == Check.RESUMED_REF_LOG_PROBS
    assert info.value.metrics[REBUILT] > 1e-4
