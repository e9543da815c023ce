"""Pipeline parallelism on CPU: PP = 2 and PP = 2 x EP = 2 log what PP = 1 logs on the same data.

One launch of four gloo processes (imports cost ~10 s per process here) runs every layout in
turn: PP = 2 and PP = 2 x EP = 2 with data parallelism 2, and EP = 2 without pipeline stages
(data parallelism 4), each data-parallel rank holding its share of every mini-batch, under
``collective_check.NcclDeviceCheck`` like the data-parallel test. The PP = 1 reference runs in
the test process itself, one rank with all samples: the worker's data-parallel reduction makes
that the same computation (``test_megatron_data_parallel.py``). Every run starts from one
transformers checkpoint, since a pipeline stage or an expert-parallel rank initialised from the
seed draws other weights than the whole model does. The routing-replay configuration registers
the workspace's r3_routing plugin, as a run that enables it does.
"""

from __future__ import annotations

import contextlib
import types

import pytest
import torch
import torch.multiprocessing as mp
from safetensors import safe_open

from ember_core.hookspecs import hookimpl
from ember_megatron_backend.metrics import TRAIN_PADDING

pytestmark = pytest.mark.slow

WORLD = 4
LAYOUTS = {
    "pp2": {"pipeline_parallel": 2},
    "pp2-ep2": {"pipeline_parallel": 2, "expert_parallel": 2, "expert_tensor_parallel": 1},
    # The equal micro-batch shapes the CPU expert dispatcher needs, without a pipeline.
    "ep2": {"expert_parallel": 2, "expert_tensor_parallel": 1},
}
PIPELINED = ("pp2", "pp2-ep2")
# The single place where presets join the parity runs.
PARITY_PRESETS = ["tiny-moe", "tiny-deepseek-v3"]
CONFIGS = {
    # GRPO with a reference (KL loss), entropy bonus and TIS; two samples per micro-batch.
    "grpo-kl": (
        {"micro_batch_size": 2},
        {"use_kl_loss": True, "kl_loss_coef": 0.1, "entropy_coef": 0.01, "use_tis": True},
    ),
    # PPO: a critic through the pipeline too; per-token reduction over token-budget
    # micro-batches, whose sample counts differ.
    "ppo-tokens": (
        {"micro_batch_size": None, "max_tokens_per_micro_batch": 30},
        {"advantage_estimator": "ppo", "whiten_advantages": True, "loss_reduction": "token"},
    ),
    # Routing replay (the r3_routing plugin) with full activation recompute: each stage's
    # routers replay their own layers, in the forward and in the recompute of the backward.
    "grpo-r3": ({"micro_batch_size": 3}, {}),
}
REPLAYED = "grpo-r3"
ROLLOUTS = 2
EXACT = {
    "rollout/rewards", "rollout/response_length", "rollout/replay_agreement", "train/lr",
    "train/critic_lr", "train/skipped_step", "train/critic_skipped_step", "train/tis_clipfrac",
    "train/value_clipfrac",
}  # fmt: skip
"""Metrics that do not depend on how the layouts round: counts, the schedule, data. Equal."""
EPS = torch.finfo(torch.float32).eps
TOLERANCES = {
    # Means of differences of log-probs: their rounding is that of the log-probs themselves
    # (~6 here), whatever the size of the difference: a few ulps at the log-probs' scale.
    "train/ppo_kl": ("rollout/log_probs", 4 * EPS),
    "train/kl_loss": ("rollout/log_probs", 4 * EPS),
    # A maximum over tokens of such differences: a few ulps of the largest token log-prob.
    "rollout/log_probs_ref_max_abs_diff": ("rollout/log_probs", 16 * EPS),
    "train/ppo_kl_abs_max": ("rollout/log_probs", 16 * EPS),
    # Importance ratios exp(log-prob difference): d(ratio) = ratio * d(difference), so a ratio
    # rounds as the log-probs do (a few ulps at their scale) times the ratio, which TIS and the
    # clipped objective keep near 1. Seen on CI's 2-core machine (ep2, tiny-deepseek-v3): 6 ulps
    # of the log-probs on a TIS maximum of 0.27, which is 24 ulps of the maximum itself.
    "train/tis": ("rollout/log_probs", 16 * EPS),
    "train/tis_max": ("rollout/log_probs", 16 * EPS),
    "train/behaviour_ratio": ("rollout/log_probs", 16 * EPS),
    "train/behaviour_ratio_max": ("rollout/log_probs", 16 * EPS),
    # Sums of advantage-weighted ratios that cancel (advantages normalised per group to unit
    # scale, ratios ~1), and critic values (a dot product of normalised hidden states): their
    # operands are of order one, however small the result.
    "train/pg_loss": (1.0, 16 * EPS),
    "train/loss": (1.0, 16 * EPS),
    "rollout/advantages": (1.0, 16 * EPS),
    "rollout/values": (1.0, 16 * EPS),
    # Gradient norms: each gradient sums over every token of the batch in the backward, and the
    # stages and expert ranks add the squares in other orders.
    "train/grad_norm": (None, 1e-5),
    "train/critic_grad_norm": (None, 1e-5),
}
"""Every other metric: (None, 16 ulps) of its own scale. Scale: the largest |value| that the
PP = 1 run logs for the named metric (None: for the metric itself), or a constant. Measured on a
2-core AMD EPYC (AVX2): every difference stays below a fifth of its tolerance; the differences of
log-prob based metrics sit at one or two ulps of the log-probs."""
WEIGHT_TOLERANCE = 1e-4
"""Trained weights of two layouts: Adam normalises each update by the gradient's own size, so
the rounding differences of rarely touched rows (embeddings of rare tokens) reach ~1e-5 after
the four steps."""
CHECKPOINTED = ("pp2", "tiny-moe", "grpo-kl")
"""The run that also saves after rollout 0 and is resumed from there by a fresh worker."""


def _samples(preset: str, rollout_id: int, dp: tuple[int, int] | None):
    """16 samples (8 groups of 2) with routed experts of the preset's shape; with `dp` = (rank,
    size), the rank's share of each of the two mini-batches (whole groups)."""
    from megatron_samples import make_samples

    from ember_megatron_backend.model import ModelConfig

    cfg = ModelConfig.preset(preset)
    samples = make_samples(num_groups=8, per_group=2, seed=100 + rollout_id, experts=False)
    g = torch.Generator().manual_seed(rollout_id)
    dense = set(getattr(cfg, "dense_layers", ()))
    for s in samples:
        ids = torch.rand(s.total_length - 1, cfg.num_layers, cfg.num_experts, generator=g)
        experts = ids.argsort(dim=-1)[..., : cfg.moe_router_topk].to(torch.int32)
        experts[:, sorted(dense)] = 0
        s.rollout_routed_experts = experts
    if dp is None:
        return samples
    rank, size = dp
    share = 8 // size
    return [
        s for first in (0, 8) for s in samples[first + rank * share : first + (rank + 1) * share]
    ]


class _Recompute:
    """Full activation recompute, one layer per checkpoint (a ``model_config`` hook)."""

    @hookimpl
    def ember_model_config(self, role, model_config) -> None:
        model_config.recompute_granularity = "full"
        model_config.recompute_method = "uniform"
        model_config.recompute_num_layers = 1


@contextlib.contextmanager
def _worker(preset: str, config: str, hf_dir: str):
    """A worker for `config`, with routing replay and recompute registered for `REPLAYED`."""
    from megatron_samples import algorithm, backend, sampling

    from ember_core.plugins import EmberPlugins
    from ember_megatron_backend.config import OptimizerConfig
    from ember_megatron_backend.worker import MegatronWorker

    limits, alg = CONFIGS[config]
    # Adam divides by sqrt(v) + eps: at the default eps = 1e-8 a parameter whose gradient is
    # near zero turns the layouts' fp32 rounding differences (~1e-10 in a gradient) into
    # update differences of up to lr * 1e-2; eps = 1e-6 keeps that below the tolerance.
    optimizer = OptimizerConfig(lr=1e-3, weight_decay=0.0, adam_eps=1e-6)
    settings = dict(limits, model=preset, model_overrides={}, hf_load=hf_dir, optimizer=optimizer)
    train = backend(**settings)
    plugins = EmberPlugins()
    if config != REPLAYED:
        yield MegatronWorker(train, algorithm(**alg), sampling(), plugins)
        return
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from ember_r3_routing import plugin as r3_plugin

    plugins.register(r3_plugin, "r3_routing")
    plugins.register(_Recompute(), "recompute")
    try:
        plugins.check_pending()
        plugins.configure(types.SimpleNamespace(train=train, plugins=["r3_routing"]), {})
        yield MegatronWorker(train, algorithm(**alg), sampling(), plugins)
    finally:
        plugins.unregister("recompute")
        plugins.unregister("r3_routing")
        r3_plugin._config = None
        RouterReplay.clear_global_router_replay_instances()


def _run(worker, preset: str, dp, *, save_to=None, first: int = 0) -> list:
    """Rollouts `first`.. of `worker`: rollout then train metrics of each; saves a checkpoint
    after the first rollout when asked."""
    logged = []
    for rollout_id in range(first, ROLLOUTS):
        batch = worker.prepare(rollout_id, _samples(preset, rollout_id, dp))
        logged.append(worker.log_rollout_data(rollout_id, batch))
        logged.extend(worker.train(rollout_id, batch))
        if save_to is not None and rollout_id == first:
            worker.save_checkpoint(save_to)
    return logged


def _weights_check(worker, export_dir) -> dict:
    """Every rank's weight stream for the engines against the export (which rank 0 wrote)."""
    from ember_megatron_backend import comm
    from ember_megatron_backend.weight_sync import is_weight_sender

    streamed = dict(worker.hf_weights())
    comm.barrier()
    with safe_open(str(export_dir / "model.safetensors"), framework="pt") as exported:
        names = set(exported.keys())
        equal = names == set(streamed) and all(
            torch.equal(streamed[k], exported.get_tensor(k)) for k in names
        )
    return {"names": sorted(streamed), "equal_to_export": equal, "sender": is_weight_sender()}


def _layout_runs(layout: str, hf_dirs: dict, work, results: dict) -> None:
    from megatron.core import parallel_state as ps

    from ember_megatron_backend.forward import forward_only

    dp = (ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
    results[(layout, "dp")] = dp
    for preset in PARITY_PRESETS:
        for config in CONFIGS:
            key = (layout, preset, config)
            checkpointed = key == CHECKPOINTED
            save_to = work / "checkpoint" if checkpointed else None
            with _worker(preset, config, hf_dirs[preset]) as worker:
                if config == "grpo-kl":
                    worker.export_hf(work / f"export-initial-{layout}-{preset}")
                results[key] = _run(worker, preset, dp, save_to=save_to)
                if config != "grpo-kl":
                    continue
                export = work / f"export-{layout}-{preset}"
                worker.export_hf(export)
                results[(*key, "weights")] = _weights_check(worker, export)
                # The public forward_only (through the schedule under PP): the reference's.
                samples = _samples(preset, 0, dp)
                out = forward_only(
                    worker.ref, samples, role="ref", temperature=0.8, micro_batch_size=3
                )
                results[(*key, "forward_only")] = [t.tolist() for t in out.log_probs]
            if checkpointed:
                with _worker(preset, config, hf_dirs[preset]) as resumed:
                    resumed.load_checkpoint(save_to)
                    counters = (resumed.rollout_id, resumed.accumulated_step)
                    logged = _run(resumed, preset, dp, first=1)
                    results[(*key, "resumed")] = (counters, logged)
                    resumed.export_hf(work / "export-resumed")


def _split_pipeline_error(hf_dir: str) -> str:
    """The two stages of a replica get different samples: `prepare` must refuse on each."""
    from megatron.core import parallel_state as ps

    samples = _samples("tiny-moe", 0, (ps.get_data_parallel_rank(), 2))
    if ps.get_pipeline_model_parallel_rank() == 1:
        samples = samples[:2]
    with _worker("tiny-moe", "grpo-kl", hf_dir) as worker:
        try:
            worker.prepare(0, samples)
        except ValueError as exc:
            return str(exc)
    return "no error"


def _rank_main(rank: int, rendezvous: str, tests_dir: str, work, hf_dirs, queue) -> None:
    import sys

    sys.path.insert(0, tests_dir)
    from collective_check import NcclDeviceCheck
    from megatron.core import parallel_state as ps

    from ember_megatron_backend.parallel import (
        ParallelConfig,
        destroy_distributed,
        init_distributed,
    )

    torch.set_num_threads(1)
    results: dict = {}
    with NcclDeviceCheck() as check:
        for layout, sizes in LAYOUTS.items():
            init_distributed(
                ParallelConfig(**sizes), rank=rank, world_size=WORLD, init_method=rendezvous
            )
            accepted, refused = len(check.accepted), len(check.refused)
            _layout_runs(layout, hf_dirs, work, results)
            if layout == "pp2":
                results["split error"] = _split_pipeline_error(hf_dirs["tiny-moe"])
            results[(layout, "collectives")] = {
                "refused": sorted(set(check.refused[refused:])),
                "accepted": sorted(set(check.accepted[accepted:])),
            }
            ps.destroy_model_parallel()  # keep the process group for the next layout
    queue.put((rank, results))
    destroy_distributed()


def _reference(dist_env, hf_dirs: dict, work) -> dict:
    """PP = 1, one rank with every sample, from the same checkpoints."""
    results = {}
    for preset in PARITY_PRESETS:
        for config in CONFIGS:
            with _worker(preset, config, hf_dirs[preset]) as worker:
                results[(preset, config)] = _run(worker, preset, None)
                if config == "grpo-kl":
                    worker.export_hf(work / f"export-pp1-{preset}")
    return results


@pytest.fixture(scope="module")
def pipeline_runs(dist_env, request, tmp_path_factory):
    from ember_megatron_backend.worker import MegatronWorker

    work = tmp_path_factory.mktemp("pipeline")
    hf_dirs = {}
    for preset in PARITY_PRESETS:
        from megatron_samples import algorithm, backend, sampling

        # Weights far enough from uniform that the losses move within a few steps.
        seed = backend(model=preset, model_overrides={"init_method_std": 0.1})
        hf_dirs[preset] = str(work / f"hf-{preset}")
        MegatronWorker(seed, algorithm(), sampling()).export_hf(hf_dirs[preset])
    queue = mp.get_context("spawn").SimpleQueue()
    rendezvous = f"file://{work / 'rendezvous'}"
    args = (rendezvous, str(request.path.parent), work, hf_dirs, queue)
    ranks_done = mp.start_processes(
        _rank_main, args=args, nprocs=WORLD, start_method="spawn", join=False
    )
    ranks = dict(queue.get() for _ in range(WORLD))  # before joining: the results are large
    while not ranks_done.join():
        pass
    return work, ranks, _reference(dist_env, hf_dirs, work)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("preset", PARITY_PRESETS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipeline_logs_what_one_stage_logs(pipeline_runs, layout, preset, config):
    _, ranks, reference = pipeline_runs
    runs = [ranks[r][(layout, preset, config)] for r in range(WORLD)]
    for other in runs[1:]:
        assert other == runs[0]  # identical on every rank: the driver reads rank 0
    one = reference[(preset, config)]
    assert len(runs[0]) == len(one) == ROLLOUTS * 3
    largest: dict[str, float] = {}
    for record in one:
        for key, value in record.items():
            largest[key] = max(largest.get(key, 0.0), abs(value))
    for record_one, record_pp in zip(one, runs[0], strict=True):
        assert set(record_one) == set(record_pp)
        for key, value in record_one.items():
            if key == TRAIN_PADDING:  # the layout's own: its micro-batches' shapes
                continue
            if key in EXACT:
                assert record_pp[key] == value, (key, record_pp[key], value)
                continue
            scale, rel = TOLERANCES.get(key, (None, 16 * EPS))
            scale = largest[scale or key] if not isinstance(scale, float) else scale
            assert abs(record_pp[key] - value) <= rel * scale, (key, record_pp[key], value)
    keys = set().union(*one)
    assert {"rollout/routing_agreement", "train/grad_norm", "train/pg_loss"} <= keys
    own = {"grpo-kl": "train/kl_loss", "ppo-tokens": "train/value_loss"}
    assert own.get(config, "rollout/replay_agreement") in keys
    # The runs moved: the second rollout scores a trained actor.
    assert one[3]["rollout/log_probs"] != one[0]["rollout/log_probs"]
    # Each rollout's first step trains on the weights that scored it: the pipeline's old
    # log-probs are its training forward's (the last stage's results reached every rank).
    assert runs[0][1]["train/ppo_kl"] == runs[0][4]["train/ppo_kl"] == 0.0
    if config == REPLAYED:
        # Every stage replayed the rollout's experts on its own layers.
        assert runs[0][0]["rollout/replay_agreement"] == runs[0][3]["rollout/replay_agreement"]
        assert runs[0][0]["rollout/replay_agreement"] == 1.0
        assert runs[0][0]["rollout/routing_agreement"] < 0.5


def test_every_backend_collective_runs_on_the_device_its_group_accepts(pipeline_runs):
    _, ranks, _ = pipeline_runs
    for rank in range(WORLD):
        for layout in LAYOUTS:
            report = ranks[rank][(layout, "collectives")]
            assert report["refused"] == []
            assert "metrics.reduce_sums" in report["accepted"]
            if layout in PIPELINED:
                assert "pipeline._from_last_stage" in report["accepted"]
            if "ep2" in layout:
                assert "batches.agree_layouts" in report["accepted"]


def test_checkpoint_from_pp2_resumes_bit_exactly(pipeline_runs):
    work, ranks, _ = pipeline_runs
    for rank in range(WORLD):
        original = ranks[rank][CHECKPOINTED]
        counters, resumed = ranks[rank][(*CHECKPOINTED, "resumed")]
        assert counters == (0, 2)  # after rollout 0: two optimizer steps
        assert resumed == original[3:]  # rollout 1, scored and trained again
    layout, preset, _ = CHECKPOINTED
    with (
        safe_open(str(work / f"export-{layout}-{preset}" / "model.safetensors"), "pt") as a,
        safe_open(str(work / "export-resumed" / "model.safetensors"), "pt") as b,
    ):
        assert set(a.keys()) == set(b.keys())
        assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())


@pytest.mark.parametrize("preset", PARITY_PRESETS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_hf_export_and_weight_push_cover_every_stage(pipeline_runs, layout, preset):
    from ember_megatron_backend.model import ModelConfig
    from ember_megatron_backend.weights import hf_shapes

    work, ranks, _ = pipeline_runs
    expected = hf_shapes(ModelConfig.preset(preset))
    pairs = {
        # The checkpoint every run loaded, exported again before training: bit-exact.
        0.0: (work / f"hf-{preset}", work / f"export-initial-{layout}-{preset}"),
        # After the same training under PP = 1 and this layout.
        WEIGHT_TOLERANCE: (work / f"export-pp1-{preset}", work / f"export-{layout}-{preset}"),
    }
    for tolerance, (one_dir, pp_dir) in pairs.items():
        with (
            safe_open(str(one_dir / "model.safetensors"), "pt") as one,
            safe_open(str(pp_dir / "model.safetensors"), "pt") as pp,
        ):
            assert set(pp.keys()) == set(one.keys()) == set(expected)
            for key in one.keys():
                a, b = one.get_tensor(key), pp.get_tensor(key)
                assert a.shape == b.shape == expected[key], key
                assert (a - b).abs().max() <= tolerance, (key, pp_dir.name)
    senders = []
    for rank in range(WORLD):
        report = ranks[rank][(layout, preset, "grpo-kl", "weights")]
        assert report["names"] == sorted(expected)  # every layer reaches every rank
        assert report["equal_to_export"]
        senders.append(report["sender"])
    assert senders == [True, False, False, False]


def test_forward_only_returns_the_last_stage_results_everywhere(pipeline_runs):
    _, ranks, _ = pipeline_runs
    for layout in PIPELINED:
        by_dp: dict[int, list] = {}
        for rank in range(WORLD):
            log_probs = ranks[rank][(layout, "tiny-moe", "grpo-kl", "forward_only")]
            dp_rank, _ = ranks[rank][(layout, "dp")]
            assert len(log_probs) == 8  # the rank's samples
            by_dp.setdefault(dp_rank, []).append(log_probs)
        # Both stages of a replica return what its last stage computed.
        assert sorted(by_dp) == [0, 1]
        assert all(stages[0] == stages[1] for stages in by_dp.values())
        assert by_dp[0][0] != by_dp[1][0]


def test_stages_with_different_samples_are_refused(pipeline_runs):
    _, ranks, _ = pipeline_runs
    for rank in range(WORLD):
        assert ranks[rank]["split error"].startswith(
            "the pipeline stages of one model replica received different samples"
        )
