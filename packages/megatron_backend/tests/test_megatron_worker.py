"""MegatronWorker on CPU with real megatron-core: scoring, rollout metrics, training, hooks."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from megatron_samples import EXPERTS, LAYERS, algorithm, backend, make_samples, sampling

from ember_core.hookspecs import Phase, Role, hookimpl
from ember_core.plugins import EmberPlugins
from ember_megatron_backend.worker import MegatronWorker


def _masked_mean(values, mask):
    return sum(v * m for v, m in zip(values, mask, strict=True)) / sum(mask)


@pytest.mark.parametrize("estimator", ["grpo", "gspo", "ppo"])
def test_first_step_is_exactly_on_policy(dist_env, estimator):
    alg = algorithm(advantage_estimator=estimator, use_kl_loss=True, kl_loss_coef=0.1)
    worker = MegatronWorker(backend(), alg, sampling())
    samples = make_samples()
    for rollout_id in range(2):
        batch = worker.prepare(rollout_id, samples)
        rollout = worker.log_rollout_data(rollout_id, batch)
        steps = worker.train(rollout_id, batch)
        first = steps[0]
        assert first["train/ppo_kl"] == 0.0
        assert first["train/pg_clipfrac"] == 0.0
        if rollout_id == 0:  # the reference is the initial actor
            assert rollout["rollout/log_probs"] == rollout["rollout/ref_log_probs"]
            for a, b in zip(batch.log_probs, batch.ref_log_probs, strict=True):
                assert torch.equal(a, b)
            assert first["train/kl_loss"] == 0.0
            assert steps[1]["train/kl_loss"] > 0  # the first step moved the actor
        else:
            assert first["train/kl_loss"] > 0
    assert worker.accumulated_step == 4 and worker.rollout_id == 1


def test_rollout_metrics_are_means_over_samples(dist_env):
    worker = MegatronWorker(backend(), algorithm(), sampling())
    samples = make_samples(masked=True)
    batch = worker.prepare(0, samples)
    metrics = worker.log_rollout_data(0, batch)
    n = len(samples)
    masks = [s.loss_mask for s in samples]
    lp = [t.tolist() for t in batch.log_probs]
    expected = {
        "rollout/rewards": sum(s.reward for s in samples) / n,
        "rollout/response_length": sum(s.response_length for s in samples) / n,
        "rollout/log_probs": sum(_masked_mean(x, m) for x, m in zip(lp, masks, strict=True)) / n,
        "rollout/rollout_log_probs": sum(
            _masked_mean(s.rollout_log_probs, s.loss_mask) for s in samples
        )
        / n,
        "rollout/train_rollout_logprob_abs_diff": sum(
            _masked_mean(
                [abs(a - b) for a, b in zip(x, s.rollout_log_probs, strict=True)], s.loss_mask
            )
            for x, s in zip(lp, samples, strict=True)
        )
        / n,
    }
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, abs=1e-6), key
    assert "rollout/ref_log_probs" not in metrics and "rollout/values" not in metrics
    assert {"rollout/entropy", "rollout/advantages", "rollout/routing_agreement"} <= set(metrics)


@pytest.mark.parametrize("reduction", ["sample", "token"])
def test_gradient_accumulation_matches_one_micro_batch(dist_env, reduction):
    samples = make_samples(masked=True)
    runs = []
    for limits in (
        {"micro_batch_size": None},
        {"micro_batch_size": 1},
        {"micro_batch_size": None, "max_tokens_per_micro_batch": 30},
    ):
        worker = MegatronWorker(backend(**limits), algorithm(loss_reduction=reduction), sampling())
        batch = worker.prepare(0, samples)
        runs.append((batch, worker.train(0, batch)))
    batch, reference = runs[0]
    assert [len(step) for step in runs[1][0].steps] == [4, 4]
    for _, steps in runs[1:]:
        for got, want in zip(steps, reference, strict=True):
            for key, value in want.items():
                # fp32 sums in another order: grad norms (~15) agree to a few ulps of 1e-6.
                assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-5), key
    # Step 0 is on-policy (ratio 1), so pg_loss = mean of -A over the first mini-batch,
    # per sample then over samples ("sample") or over all counted tokens ("token").
    first = range(4)
    masks = [batch.samples[i].loss_mask for i in first]
    adv = [batch.advantages[i].tolist() for i in first]
    if reduction == "sample":
        want = sum(_masked_mean([-a for a in x], m) for x, m in zip(adv, masks, strict=True)) / 4
    else:
        total = sum(
            -a * w for x, m in zip(adv, masks, strict=True) for a, w in zip(x, m, strict=True)
        )
        want = total / sum(sum(m) for m in masks)
    assert reference[0]["train/pg_loss"] == pytest.approx(want, abs=1e-6)


def test_training_on_a_fixed_batch_lowers_the_policy_loss(dist_env):
    worker = MegatronWorker(
        backend(num_steps_per_rollout=1, micro_batch_size=4),
        algorithm(eps_clip=0.5, eps_clip_high=5.0),
        sampling(temperature=1.0),
    )
    samples = make_samples()
    batch = worker.prepare(0, samples)
    losses = [worker.train(0, batch)[0]["train/pg_loss"] for _ in range(12)]
    assert losses[-1] < losses[0] - 0.3, losses
    # The update raises the likelihood of positive-advantage responses and lowers the others.
    after = worker.prepare(1, samples)
    for before_lp, after_lp, adv in zip(
        batch.log_probs, after.log_probs, batch.advantages, strict=True
    ):
        if adv[0] > 0.1:
            assert after_lp.sum() > before_lp.sum()
        elif adv[0] < -0.1:
            assert after_lp.sum() < before_lp.sum()


def test_ppo_critic_value_loss_goes_down(dist_env):
    cfg = backend(num_steps_per_rollout=1, micro_batch_size=4)
    cfg.critic.optimizer = cfg.optimizer
    worker = MegatronWorker(cfg, algorithm(advantage_estimator="ppo", value_clip=0.5), sampling())
    assert worker.critic is not None and worker.ref is None
    samples = make_samples()
    losses = []
    for rollout_id in range(10):
        batch = worker.prepare(rollout_id, samples)
        losses.append(worker.train(rollout_id, batch)[0]["train/value_loss"])
    # GAE with gamma = lambda = 1 and a zero-initialised critic: returns are the reward on every
    # token, so the first loss is 0.5 * reward^2 averaged per sample.
    first = make_samples()
    assert losses[0] == pytest.approx(sum(0.5 * s.reward**2 for s in first) / len(first), abs=1e-6)
    assert losses[-1] < 0.3 * losses[0], losses


def test_critic_values_do_not_depend_on_the_rollout_temperature(dist_env):
    worker = MegatronWorker(backend(), algorithm(advantage_estimator="ppo"), sampling())
    with torch.no_grad():
        worker.critic.module.output_layer.weight.normal_()
    samples = make_samples()
    hot = worker.prepare(0, samples)
    worker.sampling = sampling(temperature=0.4)
    cold = worker.prepare(0, samples)
    for a, b in zip(hot.values, cold.values, strict=True):
        assert torch.equal(a, b)
    assert torch.cat(hot.values).abs().sum() > 0
    assert not torch.equal(torch.cat(hot.log_probs), torch.cat(cold.log_probs))


def _own_experts(worker, samples):
    """The actor's top-k experts per sample, [L - 1, layers, k], from one forward."""
    from megatron.core.transformer.moe.router import TopKRouter

    from ember_core.types import pack_samples
    from ember_megatron_backend.forward import forward_only, router_rows_to_stream

    maps = {}
    routers = [m for m in worker.actor.modules() if isinstance(m, TopKRouter)]
    hooks = [
        r.register_forward_hook(lambda m, a, out: maps.__setitem__(m.layer_number - 1, out[1]))
        for r in routers
    ]
    try:
        forward_only(worker.actor, samples, role="actor", temperature=1.0)
    finally:
        for h in hooks:
            h.remove()
    ids = torch.stack([maps[layer] for layer in range(LAYERS)], dim=1)  # [R, layers, E]
    ids = router_rows_to_stream(ids, pack_samples(samples))  # [T, layers, E]
    topk = ids.float().topk(2, dim=-1).indices.flip(-1)  # same set, another order
    out, start = [], 0
    for s in samples:
        out.append(topk[start : start + s.total_length - 1].to(torch.int32))
        start += s.total_length
    return out


def _agreement_setup(plugins=None):
    cfg = backend(num_steps_per_rollout=1, micro_batch_size=None)
    worker = MegatronWorker(cfg, algorithm(), sampling(), plugins)
    samples = make_samples(experts=False)
    own = _own_experts(worker, samples)
    # Corrupt a known number of (position, layer) routings per sample: sample i gets i of
    # them, all in the last layer (so replaying them changes no router's input).
    expected = []
    for i, (s, experts) in enumerate(zip(samples, own, strict=True)):
        experts = experts.clone()
        for p in range(i):
            chosen = set(experts[p, LAYERS - 1].tolist())
            spare = [e for e in range(EXPERTS) if e not in chosen]
            experts[p, LAYERS - 1, 0] = spare[0]
        s.rollout_routed_experts = experts
        expected.append(1 - i / ((s.total_length - 1) * LAYERS))
    return worker, samples, sum(expected) / len(expected)


def test_routing_agreement_counts_matching_top_k_sets(dist_env):
    worker, samples, expected = _agreement_setup()
    metrics = worker.log_rollout_data(0, worker.prepare(0, samples))
    assert metrics["rollout/routing_agreement"] == pytest.approx(expected, abs=1e-12)
    for s in samples:
        s.rollout_routed_experts = None
    assert "rollout/routing_agreement" not in worker.log_rollout_data(0, worker.prepare(0, samples))


class ReplayPlugin:
    """Replays each sample's rollout experts in the actor's log-prob forward (like R3 does)."""

    @hookimpl
    def ember_model_config(self, role, model_config):
        model_config.moe_enable_routing_replay = role == Role.ACTOR

    @hookimpl
    def ember_forward_context(self, role, phase, batch):
        if role != Role.ACTOR or phase != Phase.LOG_PROB:
            return None
        return self._replay(batch)

    @contextlib.contextmanager
    def _replay(self, batch):
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        rows = []
        for s in batch.samples:
            rows += [s.rollout_routed_experts, torch.zeros(1, LAYERS, 2, dtype=torch.int32)]
        rows = torch.cat(rows).long()  # stream order
        if batch.token_index is not None:  # the routers' own row order
            rows = rows[batch.token_index.clamp(min=0)]
        routers = [m for m in batch.model.modules() if isinstance(m, TopKRouter)]
        for r in routers:
            r.router_replay.set_target_indices(rows[:, r.layer_number - 1])
            r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        try:
            yield
        finally:
            for r in routers:
                r.router_replay.clear_indices()
                r.router_replay.clear_router_replay_action()


def test_routing_agreement_is_measured_without_replay(dist_env):
    plugins = EmberPlugins()
    plugins.register(ReplayPlugin(), "replay")
    worker, samples, expected = _agreement_setup(plugins)
    batch = worker.prepare(0, samples)
    metrics = worker.log_rollout_data(0, batch)
    assert metrics["rollout/routing_agreement"] == pytest.approx(expected, abs=1e-12)
    assert metrics["rollout/replay_agreement"] == 1.0  # the experts used were the rollout's
    plugins.unregister("replay")
    plain = worker.prepare(0, samples)  # the replayed forward really used other experts
    assert not torch.equal(torch.cat(batch.log_probs), torch.cat(plain.log_probs))


class RecordingPlugin:
    def __init__(self):
        self.built, self.passes, self.steps, self.rollouts = [], [], [], []

    @hookimpl
    def ember_model_config(self, role, model_config):
        self.built.append((role, model_config.num_layers))

    @hookimpl
    def ember_forward_context(self, role, phase, batch):
        self.passes.append((role, phase, tuple(batch.indices), batch.packed.num_tokens))

    @hookimpl
    def ember_after_train_step(self, rollout_id, step_id, accumulated_step_id, metrics):
        self.steps.append((rollout_id, step_id, accumulated_step_id, sorted(metrics)))

    @hookimpl
    def ember_after_log_rollout_data(self, rollout_id, metrics):
        self.rollouts.append((rollout_id, metrics["rollout/rewards"]))


def test_hooks_see_every_pass_and_step(dist_env):
    plugins, recorder = EmberPlugins(), RecordingPlugin()
    plugins.register(recorder, "recorder")
    alg = algorithm(advantage_estimator="ppo", use_kl_loss=True, kl_loss_coef=0.1)
    worker = MegatronWorker(backend(), alg, sampling(), plugins)
    assert recorder.built == [(Role.ACTOR, LAYERS), (Role.REF, LAYERS), (Role.CRITIC, LAYERS)]
    samples = make_samples()
    for rollout_id in (0, 1):
        batch = worker.prepare(rollout_id, samples)
        worker.log_rollout_data(rollout_id, batch)
        worker.train(rollout_id, batch)
    micro = [(0, 1), (2, 3), (4, 5), (6, 7)]
    scoring = [
        (role, Phase.LOG_PROB, mb) for mb in micro for role in (Role.REF, Role.ACTOR, Role.CRITIC)
    ]
    training = [
        (role, phase, mb)
        for mb in micro
        for role in (Role.ACTOR, Role.CRITIC)
        for phase in (Phase.TRAIN, Phase.BACKWARD)
    ]
    assert [p[:3] for p in recorder.passes] == 2 * (scoring + training)
    assert all(p[3] == sum(samples[i].total_length for i in p[2]) for p in recorder.passes)
    assert [s[:3] for s in recorder.steps] == [(0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)]
    keys = recorder.steps[0][3]
    for key in ("train/loss", "train/pg_loss", "train/pg_clipfrac", "train/ppo_kl",
                "train/kl_loss", "train/entropy_loss", "train/grad_norm", "train/lr",
                "train/value_loss", "train/value_clipfrac"):  # fmt: skip
        assert key in keys
    assert [r[0] for r in recorder.rollouts] == [0, 1]


def test_engine_log_probs_as_old_log_probs_skip_the_actor_forward(dist_env):
    """`use_rollout_log_probs`: no actor scoring forward; training then runs exactly as a scored
    run whose engine returned the trainer's own log-probs (the ratio is taken against them)."""
    samples = make_samples()
    scored = MegatronWorker(backend(), algorithm(), sampling())
    reference = scored.prepare(0, samples)
    for sample, log_probs in zip(samples, reference.log_probs, strict=True):
        sample.rollout_log_probs = log_probs.tolist()
    reference = scored.prepare(0, samples)
    want = scored.train(0, reference)

    plugins, recorder = EmberPlugins(), RecordingPlugin()
    plugins.register(recorder, "recorder")
    worker = MegatronWorker(backend(), algorithm(use_rollout_log_probs=True), sampling(), plugins)
    batch = worker.prepare(0, samples)
    assert not [p for p in recorder.passes if p[1] == Phase.LOG_PROB]
    assert batch.old_from_engine and batch.log_probs is batch.rollout_log_probs
    assert batch.entropy is None
    rollout = worker.log_rollout_data(0, batch)
    assert "rollout/log_probs" not in rollout and "rollout/entropy" not in rollout
    assert "rollout/train_rollout_logprob_abs_diff" not in rollout
    assert rollout["rollout/rollout_log_probs"] == pytest.approx(
        scored.log_rollout_data(0, reference)["rollout/log_probs"], abs=1e-6
    )
    got = worker.train(0, batch)
    mismatch = "train/train_rollout_logprob_abs_diff"
    for step, (mine, theirs) in enumerate(zip(got, want, strict=True)):
        assert mine.keys() == theirs.keys()
        for key, value in theirs.items():
            if key != mismatch or step == 0:
                assert mine[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (step, key)
    assert got[0]["train/ppo_kl"] == 0.0  # the engine's log-probs were the trainer's own
    # Later steps: this step's log-probs against the engine's, so the update shows.
    assert got[1][mismatch] > 1e-4 and want[1][mismatch] == 0.0
    samples[5].rollout_log_probs = None
    with pytest.raises(ValueError, match=r"use_rollout_log_probs.*sample 5 \(group 2\)"):
        worker.prepare(1, samples)


def test_uncounted_tokens_never_reach_a_loss_even_as_nan(dist_env):
    """A token with loss mask 0 (a tool's output in a multi-turn sample) may carry NaN engine
    log-probs: losses, metrics and weights stay finite, and equal a run with other values."""
    runs = []
    for filler in (math.nan, -1.0):
        samples = make_samples(masked=True)  # each sample's first response token uncounted
        for sample in samples:
            sample.rollout_log_probs[0] = filler
        alg = algorithm(use_rollout_log_probs=True, use_kl_loss=True, kl_loss_coef=0.1)
        worker = MegatronWorker(backend(), alg, sampling())
        batch = worker.prepare(0, samples)
        rollout = worker.log_rollout_data(0, batch)
        steps = worker.train(0, batch)
        weights = torch.cat([p.detach().flatten() for p in worker.actor.parameters()])
        runs.append((rollout, steps, weights))
    (rollout, steps, weights), (rollout_ok, steps_ok, weights_ok) = runs
    assert all(math.isfinite(v) for step in steps for v in step.values())
    assert bool(weights.isfinite().all()) and torch.equal(weights, weights_ok)
    assert rollout == rollout_ok and steps == steps_ok


def test_bad_batches_name_the_sample(dist_env):
    worker = MegatronWorker(backend(), algorithm(use_tis=True), sampling())
    samples = make_samples()
    samples[3].reward = None
    with pytest.raises(ValueError, match=r"sample 3 \(group 1\): reward is None"):
        worker.prepare(0, samples)
    samples = make_samples()
    samples[5].rollout_log_probs = None
    with pytest.raises(ValueError, match=r"use_tis.*sample 5 \(group 2\)"):
        worker.prepare(0, samples)
    samples = make_samples()
    samples[2].response_length = 40
    with pytest.raises(ValueError, match=r"sample 2 \(group 1\)"):
        worker.prepare(0, samples)
    samples = make_samples()
    samples[4].rollout_routed_experts = samples[4].rollout_routed_experts[:, :3]
    with pytest.raises(ValueError, match=r"sample 4 \(group 2\).*has 3 layers but the actor has 4"):
        worker.prepare(0, samples)
    samples = make_samples()
    samples[6].rollout_routed_experts[2, 1, 0] = EXPERTS
    with pytest.raises(ValueError, match=r"sample 6 \(group 3\).*outside \[0, 8\)"):
        worker.prepare(0, samples)
    with pytest.raises(ValueError, match="num_steps_per_rollout=2"):
        worker.prepare(0, make_samples()[:1])
    with pytest.raises(ValueError, match="needs a critic"):
        MegatronWorker(
            backend(), algorithm(advantage_estimator="ppo"), sampling(), with_critic=False
        )


class AuditEveryRollout:
    """Asks for an audit at every rollout, as the CI checker does at rollout 0."""

    @hookimpl
    def ember_audit_rollout(self, rollout_id):
        return True


@pytest.mark.parametrize("correction", ["tis", "behaviour_clip"])
def test_an_audit_scores_for_the_checks_and_trains_as_between_audits(dist_env, correction):
    """Under the engine's log-probs as the old policy, an audited rollout is scored by the actor
    (its log-probs, far from the engine's here, go to the metrics), yet its advantages (KL in
    the reward reads the old log-probs) and its training are those of the same rollout
    unaudited: the same losses and the same weights after both steps."""
    samples = make_samples(experts=False)
    alg = dict(
        off_policy_correction=correction, advantage_estimator="reinforce_plus_plus", kl_coef=0.1
    )
    plain = MegatronWorker(backend(), algorithm(**alg), sampling())
    plugins = EmberPlugins()
    plugins.register(AuditEveryRollout(), "audit")
    audited = MegatronWorker(backend(), algorithm(**alg), sampling(), plugins)
    between, audit = plain.prepare(0, samples), audited.prepare(0, samples)
    assert not between.audit and audit.audit and not audit.old_from_engine
    pairs = zip(audit.log_probs, audit.rollout_log_probs, strict=True)
    assert max((a - b).abs().max() for a, b in pairs) > 0.5
    for a, b in zip(between.advantages, audit.advantages, strict=True):
        assert torch.equal(a, b)
    want, got = plain.train(0, between), audited.train(0, audit)
    for key in ("train/loss", "train/pg_loss", "train/kl_loss", "train/grad_norm"):
        assert [s[key] for s in got] == [s[key] for s in want], key
    # The audit's ppo_kl compares with its own scoring: exactly 0 at the first step.
    assert got[0]["train/ppo_kl"] == 0.0 and abs(want[0]["train/ppo_kl"]) > 0.1
    mine, theirs = audited.actor.module.state_dict(), plain.actor.module.state_dict()
    for name, value in theirs.items():
        if torch.is_tensor(value):
            assert torch.equal(mine[name], value), name


def test_shuffled_mini_batches_train_as_the_samples_dealt_in_that_order(dist_env):
    """`shuffle_mini_batches` deals the rank's samples into steps in a seeded random order; the
    update equals the unshuffled worker's on the samples handed over in that order."""
    from ember_megatron_backend.batches import plan_steps, shuffled_order

    samples = make_samples(num_groups=4, per_group=4)
    order = shuffled_order(len(samples), 1234, 0)
    assert sorted(order) == list(range(16)) and order != list(range(16))
    assert order == shuffled_order(16, 1234, 0) != shuffled_order(16, 1234, 1)
    runs = []
    for shuffle, given in ((True, samples), (False, [samples[i] for i in order])):
        worker = MegatronWorker(
            backend(seed=1234, shuffle_mini_batches=shuffle, micro_batch_size=None),
            algorithm(loss_reduction="token"),
            sampling(),
        )
        batch = worker.prepare(0, given)
        runs.append((worker, batch, worker.train(0, batch)))
    (shuffled, batch, steps), (plain, plain_batch, plain_steps) = runs
    step_samples = [[batch.samples[i].index for mb in step for i in mb] for step in batch.steps]
    assert step_samples == [[samples[i].index for i in part] for part in (order[:8], order[8:])]
    # Arrival order would give each step two whole groups; the shuffle mixes them.
    groups = [{samples[i].group_index for i in part} for part in (order[:8], order[8:])]
    assert any(len(g) > 2 for g in groups)
    unshuffled = plan_steps(samples, 2, micro_batch_size=None, max_tokens_per_micro_batch=None)
    assert unshuffled == [[list(range(8))], [list(range(8, 16))]]
    for got, want in zip(steps, plain_steps, strict=True):
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    # Packed in another order, the sums round differently; Adam's update of a weight whose
    # gradient is near 0 amplifies that (its first step moves a weight by about lr whatever
    # the gradient's size): almost every weight agrees to 2e-5, and one here and there by up
    # to lr a step (one of 8192 by 3.1e-5 on a 2-core AMD EPYC family 23).
    steps_lr = 2 * backend().optimizer.lr
    for a, b in zip(shuffled.actor.parameters(), plain.actor.parameters(), strict=True):
        gap = (a - b).abs()
        assert gap.max() <= steps_lr and (gap > 2e-5).float().mean() <= 1e-3, gap.max()


def test_plan_steps_takes_a_permutation_only(dist_env):
    from ember_megatron_backend.batches import plan_steps

    samples = make_samples()
    with pytest.raises(ValueError, match="expected a permutation"):
        plan_steps(samples, 2, micro_batch_size=1, max_tokens_per_micro_batch=None,
                   order=[0, 0, 1, 2, 3, 4, 5, 6])  # fmt: skip
    steps = plan_steps(samples, 2, micro_batch_size=2, max_tokens_per_micro_batch=None,
                       order=[7, 6, 5, 4, 3, 2, 1, 0])  # fmt: skip
    assert sorted(i for mb in steps[0] for i in mb) == [4, 5, 6, 7]
    assert all(len(mb) == 2 for step in steps for mb in step)


def test_micro_batches_by_length_pad_less_and_train_the_same_update(dist_env):
    """`micro_batches_by_length` regroups each step's samples into micro-batches of like length:
    the same samples per step, less padding (`rollout/train_padding`), the same update up to the
    order of the sums."""
    from ember_megatron_backend.batches import padded_positions, plan_steps
    from ember_megatron_backend.metrics import TRAIN_PADDING

    samples = make_samples(num_groups=4, per_group=4)
    lengths = [s.total_length for s in samples]
    plain = plan_steps(samples, 2, micro_batch_size=2, max_tokens_per_micro_batch=None)
    grouped = plan_steps(samples, 2, micro_batch_size=2, max_tokens_per_micro_batch=None,
                         by_length=True)  # fmt: skip
    for a, b in zip(plain, grouped, strict=True):
        assert sorted(i for mb in a for i in mb) == sorted(i for mb in b for i in mb)
    flat = [i for step in grouped for mb in step for i in mb]
    for step in grouped:  # longest first within each step
        order = [lengths[i] for mb in step for i in mb]
        assert order == sorted(order, reverse=True)
    assert len(flat) == 16 and all(len(mb) == 2 for step in grouped for mb in step)
    (wasted, counted), (less, same) = (padded_positions(samples, p) for p in (plain, grouped))
    assert counted == same == sum(lengths) and same < less < wasted

    runs = []
    for by_length in (False, True):
        worker = MegatronWorker(
            backend(seed=1234, micro_batch_size=2, micro_batches_by_length=by_length),
            algorithm(loss_reduction="token"),
            sampling(),
        )
        batch = worker.prepare(0, samples)
        metrics = worker.log_rollout_data(0, batch)
        runs.append((worker, metrics, worker.train(0, batch)))
    (plain_worker, plain_metrics, plain_steps), (worker, metrics, steps) = runs
    assert plain_metrics[TRAIN_PADDING] == pytest.approx(1 - counted / wasted)
    assert metrics[TRAIN_PADDING] == pytest.approx(1 - counted / less)
    for got, want in zip(steps, plain_steps, strict=True):
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    # Adam's update of a weight whose gradient is near 0 is near +-lr whatever its size: there
    # the other order of the sums moves a few weights by up to a few % of lr (1e-3).
    moved = total = 0
    for a, b in zip(worker.actor.parameters(), plain_worker.actor.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=5e-5)
        moved += int(((a - b).abs() > 1e-6).sum())
        total += a.numel()
    assert moved < 1e-3 * total
