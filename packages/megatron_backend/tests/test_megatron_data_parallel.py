"""Two data-parallel ranks (two gloo processes) log what one rank logs on the same data.

The two ranks run under ``collective_check.NcclDeviceCheck``: every process group behaves like
NCCL towards the backend's own collectives (they must hand it tensors on the rank's
accelerator), so the comparison with one rank also shows the values survive that placement.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.multiprocessing as mp

from ember_megatron_backend.metrics import TRAIN_PADDING

pytestmark = pytest.mark.slow

CONFIGS = {
    # GAE with a critic, reference, KL loss, TIS, whitening across ranks, one sample per
    # micro-batch.
    "ppo": (
        {"micro_batch_size": 1},
        {
            "advantage_estimator": "ppo",
            "gamma": 0.9,
            "lambd": 0.8,
            "whiten_advantages": True,
            "use_kl_loss": True,
            "kl_loss_coef": 0.1,
            "use_tis": True,
        },
    ),
    # Group baselines, per-token reduction over a token-budget micro-batching.
    "grpo-token": (
        {"micro_batch_size": None, "max_tokens_per_micro_batch": 30},
        {"loss_reduction": "token", "entropy_coef": 0.01, "use_kl_loss": True, "kl_loss_coef": 0.1},
    ),
    # The sequence-level ratio.
    "gspo": ({}, {"advantage_estimator": "gspo"}),
    # Whitened by definition, over every rank's tokens once (whiten_advantages adds nothing);
    # a KL penalty in the token rewards.
    "reinforce_plus_plus": (
        {},
        {
            "advantage_estimator": "reinforce_plus_plus",
            "whiten_advantages": True,
            "kl_coef": 0.05,
            "gamma": 0.95,
        },
    ),
    "reinforce_plus_plus_baseline": ({}, {"advantage_estimator": "reinforce_plus_plus_baseline"}),
}
REL_TOL, ABS_TOL = 1e-4, 1e-8
"""A 1% error on a metric of size 1e-5 (1e-7) fails, and so does a relative error of 1e-4 on
any metric. Why not tighter: from the second step on, the weights differ by the rounding of
fp32 gradient sums taken in another order (two ranks' halves added, or one rank's whole), and
small differences of log-probs amplify it: train/ppo_kl of size 8e-3 differs by 1.5e-5 relative
(measured on the 2-core AMD EPYC), while every other metric agrees to about 1e-6."""
ROLLOUTS = 2


def _rollout_samples(rollout_id: int, rank: int | None):
    """16 samples (8 groups of 2); with two ranks, rank r holds half of each mini-batch."""
    from megatron_samples import make_samples

    samples = make_samples(num_groups=8, per_group=2, seed=100 + rollout_id, masked=True)
    if rank is None:
        return samples
    # One rank's mini-batches are samples[0:8] and [8:16]; rank r takes a half of each.
    return samples[4 * rank : 4 * rank + 4] + samples[8 + 4 * rank : 12 + 4 * rank]


def _run(rank: int | None) -> dict[str, list]:
    from megatron_samples import algorithm, backend, sampling

    from ember_megatron_backend.worker import MegatronWorker

    results = {}
    for name, (limits, alg) in CONFIGS.items():
        worker = MegatronWorker(backend(**limits), algorithm(**alg), sampling())
        logged = []
        for rollout_id in range(ROLLOUTS):
            batch = worker.prepare(rollout_id, _rollout_samples(rollout_id, rank))
            logged.append(worker.log_rollout_data(rollout_id, batch))
            logged.extend(worker.train(rollout_id, batch))
        results[name] = logged
    return results


def _rank_main(rank: int, rendezvous: str, tests_dir: str, queue) -> None:
    import sys

    sys.path.insert(0, tests_dir)
    from collective_check import NcclDeviceCheck

    from ember_megatron_backend.parallel import destroy_distributed, init_distributed

    torch.set_num_threads(1)
    init_distributed(rank=rank, world_size=2, init_method=rendezvous)
    with NcclDeviceCheck() as check:
        results = _run(rank)
        results["split-group error"] = _split_group_error(rank)
    results["collectives"] = {"accepted": check.accepted, "refused": check.refused}
    queue.put((rank, results))
    destroy_distributed()  # no gloo thread left running when the process exits


def _split_group_error(rank: int) -> str:
    """Both ranks hold samples of prompt group 3: `prepare` must refuse on every rank."""
    from megatron_samples import algorithm, backend, make_samples, sampling

    from ember_megatron_backend.worker import MegatronWorker

    worker = MegatronWorker(backend(), algorithm(), sampling())
    samples = make_samples(num_groups=2, first_group=2 + rank)  # groups 2, 3 and 3, 4
    try:
        worker.prepare(0, samples)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.fixture(scope="module")
def two_ranks(request, tmp_path_factory):
    queue = mp.get_context("spawn").SimpleQueue()
    tests_dir = str(request.path.parent)
    # A file rendezvous: a free TCP port can be taken by another process before rank 0 binds it.
    rendezvous = f"file://{tmp_path_factory.mktemp('two_ranks') / 'rendezvous'}"
    mp.start_processes(
        _rank_main, args=(rendezvous, tests_dir, queue), nprocs=2, start_method="spawn"
    )
    return dict(queue.get() for _ in range(2))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_two_ranks_log_the_same_metrics_as_one(dist_env, two_ranks, name):
    one = _run(None)[name]
    assert two_ranks[0][name] == two_ranks[1][name]  # every rank returns the reduced metrics
    two = two_ranks[0][name]
    assert len(one) == len(two) == ROLLOUTS * 3
    for record_one, record_two in zip(one, two, strict=True):
        assert set(record_one) == set(record_two)
        for key, value in record_one.items():
            if key == TRAIN_PADDING:  # each rank pads its own micro-batches
                continue
            assert math.isclose(record_two[key], value, rel_tol=REL_TOL, abs_tol=ABS_TOL), (
                key,
                record_two[key],
                value,
            )
    keys = set().union(*one)
    assert {"rollout/routing_agreement", "rollout/advantages", "train/grad_norm"} <= keys
    settings = CONFIGS[name][1]
    if settings.get("use_kl_loss"):
        assert "train/kl_loss" in keys
    if settings.get("use_kl_loss") or settings.get("kl_coef"):
        # A maximum over both ranks' tokens (a sum of the two ranks' maxima would differ).
        assert one[3]["rollout/log_probs_ref_max_abs_diff"] > 0  # rollout 1: the actor moved
    if name == "ppo":
        assert {"rollout/values", "train/value_loss", "train/tis"} <= keys


def test_a_prompt_group_split_across_ranks_is_refused(two_ranks):
    for rank in (0, 1):
        assert two_ranks[rank]["split-group error"] == (
            "prompt group 3 has samples on data-parallel ranks 0 and 1; each group must stay on "
            "one rank (group baselines need it)"
        )


def test_every_backend_collective_runs_on_the_device_its_group_accepts(two_ranks):
    """On GPUs every group is NCCL, which refuses CPU tensors; the worker's reductions (flags,
    step plans, loss denominators, whitening, metrics) start on the CPU."""
    for rank in (0, 1):
        report = two_ranks[rank]["collectives"]
        assert report["refused"] == []
        assert {
            "worker.MegatronWorker._all_ranks",
            "batches.plan_steps",
            "worker.MegatronWorker.train",
            "reductions.masked_whiten",
            "metrics.SampleMeans.reduce",
            "metrics.masked_max_abs_diff",
            "metrics.reduce_sums",
        } <= set(report["accepted"])
