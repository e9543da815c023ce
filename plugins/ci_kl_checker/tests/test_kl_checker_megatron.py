"""The checker on a real MegatronWorker (megatron-core on CPU) whose reference is another
checkpoint than the actor's start: the first update is not on-policy and must fail in CI mode.

The passing cases (a reference copied from the actor, with and without routing replay) run in
`plugins/r3_routing/tests/test_r3_megatron.py`, next to the plugin that changes the forward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pytest

from ember_ci_kl_checker import Check, KLCheckerConfig, KLCheckError
from ember_ci_kl_checker import plugin as checker_plugin
from ember_core.config import AlgorithmConfig, CIConfig, SamplingConfig
from ember_core.plugins import EmberPlugins

torch = pytest.importorskip("torch", reason="drives the Megatron backend on CPU")
pytest.importorskip("ember_megatron_backend", reason="drives the Megatron backend on CPU")

from ember_core.types import Sample  # noqa: E402
from ember_megatron_backend.config import BackendConfig, OptimizerConfig  # noqa: E402
from ember_megatron_backend.parallel import destroy_distributed, init_distributed  # noqa: E402
from ember_megatron_backend.worker import MegatronWorker  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:full scope is deprecated:UserWarning")

LOGGER = "ember_ci_kl_checker.plugin"


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """The parts of a run config the checker reads (and the backend section)."""

    train: BackendConfig
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
def checker():
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


def worker_with(checker: EmberPlugins, train: BackendConfig, *, disable: bool) -> MegatronWorker:
    checker.configure(RunConfig(train=train), {"ci_kl_checker": KLCheckerConfig(disable=disable)})
    algorithm = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.01)
    return MegatronWorker(train, algorithm, SamplingConfig(), checker)


def test_a_reference_from_another_checkpoint_fails_both_checks(checker, other_checkpoint):
    worker = worker_with(checker, backend(ref_load=other_checkpoint), disable=False)
    batch = worker.prepare(0, make_samples())
    with pytest.raises(KLCheckError) as rollout:
        worker.log_rollout_data(0, batch)
    error = rollout.value
    assert error.check == Check.ROLLOUT_REF_LOG_PROBS
    assert error.step == "rollout 0 (log_rollout_data)"
    assert {"rollout/log_probs", "rollout/ref_log_probs", "rollout/rewards"} <= set(error.metrics)
    assert abs(error.metrics["rollout/log_probs"] - error.metrics["rollout/ref_log_probs"]) > 1e-3
    assert repr(error.metrics) in str(error)

    # The train step reports its metrics before the check raises: ppo_kl passes, kl_loss fails.
    with pytest.raises(KLCheckError) as step:
        worker.train(0, batch)
    error = step.value
    assert error.check == Check.KL_LOSS
    assert error.step == "rollout 0, step 0 (accumulated step 0)"
    assert error.metrics["train/ppo_kl"] == 0.0 and error.metrics["train/kl_loss"] > 1e-3
    assert {"train/loss", "train/pg_loss", "train/grad_norm", "train/lr"} <= set(error.metrics)


def test_disable_turns_the_checks_off_with_one_warning(checker, other_checkpoint, caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    worker = worker_with(checker, backend(ref_load=other_checkpoint), disable=True)
    batch = worker.prepare(0, make_samples())
    rollout = worker.log_rollout_data(0, batch)
    (step,) = worker.train(0, batch)
    assert abs(rollout["rollout/log_probs"] - rollout["rollout/ref_log_probs"]) > 1e-3
    assert step["train/kl_loss"] > 1e-3
    records = [r for r in caplog.records if r.name == LOGGER]
    assert [(r.levelno, r.getMessage()) for r in records] == [
        (
            logging.WARNING,
            "ci_kl_checker: disabled by ci_kl_checker.disable=true; no on-policy KL check runs",
        )
    ]
