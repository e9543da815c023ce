"""The named off-policy corrections through the backend's loss (`actor_policy_loss`,
`actor_loss`) on hand-made tensors, against per-token loops written out here."""

from __future__ import annotations

import math

import pytest
import torch

from ember_core.config import AlgorithmConfig
from ember_core.heads import HeadOutput
from ember_core.types import Sample
from ember_megatron_backend.batches import MicroBatch, RolloutBatch
from ember_megatron_backend.losses import actor_loss, actor_metric_keys, actor_policy_loss

LOW, HIGH = 0.5, 2.0
EPS, EPS_HIGH = 0.2, 0.28

# Four samples of 3, 1, 4 and 2 response tokens; sample 0's middle token is not counted.
LENGTHS = [3, 1, 4, 2]
MASK = [1, 0, 1, 1, 1, 1, 1, 1, 1, 1]
ROLLOUT = [-1.0, -0.7, -2.0, -0.5, -1.2, -0.9, -1.5, -0.3, -0.8, -1.1]
# The trainer's scoring forward minus the engine, and this forward minus the scoring forward.
# The uncounted token's 9.0 would push sample 0's sequence ratio out of the band if summed.
OLD_MINUS_ROLLOUT = [0.1, 9.0, -0.9, 0.8, 0.05, -0.2, 0.3, 0.0, -0.3, -0.2]
NEW_MINUS_OLD = [0.3, 0.0, -0.1, 0.1, -0.4, 0.2, 0.0, 0.25, -0.3, -0.2]
ADVANTAGES = [1.0, 1.0, 1.0, -1.0, -0.5, 0.5, 1.5, -1.0, 2.0, 2.0]
OLD = [r + d for r, d in zip(ROLLOUT, OLD_MINUS_ROLLOUT, strict=True)]
NEW = [o + d for o, d in zip(OLD, NEW_MINUS_OLD, strict=True)]
SAMPLE = [i for i, n in enumerate(LENGTHS) for _ in range(n)]
"""The sample of each token."""

NAMES = ["behaviour_clip", "decoupled", "tis", "seq_tis", "mis"]


def algorithm(name: str, **changes) -> AlgorithmConfig:
    return AlgorithmConfig(
        off_policy_correction=name,
        eps_clip=EPS,
        eps_clip_high=EPS_HIGH,
        tis_clip=HIGH,
        tis_clip_low=LOW,
        **changes,
    )


# ----------------------------------------------------------------------------- by hand


def ppo(ratio: float, a: float) -> tuple[float, float, bool]:
    """PPO's loss, its derivative in lp (dratio/dlp = ratio) and whether the clip was taken."""
    unclipped = -ratio * a
    clipped = -min(max(ratio, 1 - EPS), 1 + EPS_HIGH) * a
    if clipped > unclipped:
        return clipped, 0.0, True
    return unclipped, -ratio * a, False


def bounded(q: float, mode: str) -> tuple[float, bool]:
    """The weight from ratio q, and whether q lay outside [LOW, HIGH]."""
    outside = not LOW <= q <= HIGH
    if mode == "truncate":
        return min(max(q, LOW), HIGH), outside
    return (0.0 if outside else q), outside


def sequence_ratios(log_ratio: list[float]) -> list[float]:
    """Per token: exp of its sample's log-ratio summed over the sample's counted tokens."""
    sums = [0.0] * len(LENGTHS)
    for j, x in enumerate(log_ratio):
        if MASK[j]:
            sums[SAMPLE[j]] += x
    return [math.exp(sums[SAMPLE[j]]) for j in range(len(log_ratio))]


def hand(name: str) -> dict[str, list[float]]:
    """Per token: loss, its derivative in this forward's lp, the unbounded IS ratio (None
    without one), out-of-band flag and PPO clip flag, as the correction's formula says."""
    rows = {"loss": [], "grad": [], "ratio": [], "outside": [], "clipped": []}
    seq = sequence_ratios([n - r for n, r in zip(NEW, ROLLOUT, strict=True)])
    for j, a in enumerate(ADVANTAGES):
        if name == "behaviour_clip":  # PPO clip anchored at the engine, no weight
            loss, grad, clipped = ppo(math.exp(NEW[j] - ROLLOUT[j]), a)
            q, w, outside = None, 1.0, False
        elif name == "decoupled":  # PPO clip anchored at the scoring forward, times w(prox/rollout)
            loss, grad, clipped = ppo(math.exp(NEW[j] - OLD[j]), a)
            q = math.exp(OLD[j] - ROLLOUT[j])
            w, outside = bounded(q, "truncate")
        else:  # ratio 1 (anchored at the forward itself): -w * A in value and gradient
            loss, grad, clipped = -a, -a, False
            q = seq[j] if name == "seq_tis" else math.exp(NEW[j] - ROLLOUT[j])
            w, outside = bounded(q, "mask" if name == "mis" else "truncate")
        rows["loss"].append(w * loss)
        rows["grad"].append(w * grad)
        rows["ratio"].append(q)
        rows["outside"].append(float(outside))
        rows["clipped"].append(float(clipped))
    return rows


def sample_mean(per_token: list[float]) -> float:
    """Mean over each sample's counted tokens, then over the samples."""
    sums, counts = [0.0] * len(LENGTHS), [0] * len(LENGTHS)
    for j, v in enumerate(per_token):
        if MASK[j]:
            sums[SAMPLE[j]] += v
            counts[SAMPLE[j]] += 1
    return sum(s / max(c, 1) for s, c in zip(sums, counts, strict=True)) / len(LENGTHS)


def token_mean(per_token: list[float]) -> float:
    return sum(v for v, m in zip(per_token, MASK, strict=True) if m) / sum(MASK)


def hand_gradient(name: str, reduction: str) -> list[float]:
    """The reduced loss's gradient in each token's log-prob: its per-token derivative times its
    share of the reduction (1 / (samples x the sample's counted tokens), or 1 / counted
    tokens); none at the uncounted token."""
    counts = [sum(MASK[j] for j in range(len(MASK)) if SAMPLE[j] == i) for i in range(4)]
    shares = [
        m / (len(LENGTHS) * counts[SAMPLE[j]]) if reduction == "sample" else m / sum(MASK)
        for j, m in enumerate(MASK)
    ]
    return [g * s for g, s in zip(hand(name)["grad"], shares, strict=True)]


# ----------------------------------------------------------------------------- batches


def t(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def split(values: list[float]) -> list[torch.Tensor]:
    return list(t(values).split(LENGTHS))


def batch_for(config: AlgorithmConfig, *, audit: bool = False) -> tuple[RolloutBatch, MicroBatch]:
    """The rank's batch as `MegatronWorker.prepare` leaves it: with the engine's log-probs as
    the old policy, `log_probs` is the engine's list itself, except at an audit, where the
    trainer scored the rollout itself (OLD). The uncounted token carries NaN in every given
    tensor (a tool's output), which must not reach the loss."""

    def given(values: list[float]) -> list[torch.Tensor]:
        return split([math.nan if not m else v for v, m in zip(values, MASK, strict=True)])

    samples = [
        Sample(tokens=list(range(n + 2)), response_length=n, index=i, group_index=i)
        for i, n in enumerate(LENGTHS)
    ]
    rollout = given(ROLLOUT)
    batch = RolloutBatch(
        rollout_id=0,
        samples=samples,
        steps=[[list(range(len(samples)))]],
        loss_masks=split([float(m) for m in MASK]),
        log_probs=rollout if config.use_rollout_log_probs and not audit else given(OLD),
        entropy=None,
        advantages=given(ADVANTAGES),
        returns=given(ADVANTAGES),
        rollout_log_probs=rollout,
        audit=audit,
    )
    mb = MicroBatch(model=None, samples=samples, indices=list(range(len(samples))), packed=None)
    return batch, mb


def counted(values: torch.Tensor) -> list[float]:
    return [float(v) for v, m in zip(values, MASK, strict=True) if m]


def only_counted(values: list[float]) -> list[float]:
    return [v for v, m in zip(values, MASK, strict=True) if m]


# ----------------------------------------------------------------------------- tests


def test_the_hand_data_covers_both_sides_of_every_bound():
    for name in NAMES:
        rows = hand(name)
        if name != "behaviour_clip":
            outside = only_counted(rows["outside"])
            assert 0 < sum(outside) < len(outside), name
        if name in ("behaviour_clip", "decoupled"):
            clipped = only_counted(rows["clipped"])
            assert 0 < sum(clipped) < len(clipped), name
    # The sequence level has a sample above the band and one below.
    ratios = {SAMPLE[j]: q for j, q in enumerate(hand("seq_tis")["ratio"])}
    assert ratios[1] > HIGH and ratios[3] < LOW and LOW < ratios[0] < HIGH


@pytest.mark.parametrize("name", NAMES)
def test_per_token_loss_of_each_correction(name):
    config = algorithm(name)
    engine_old = config.use_rollout_log_probs
    loss, metrics = actor_policy_loss(
        t(NEW).requires_grad_(),
        t(ROLLOUT) if engine_old else t(OLD),
        t(ROLLOUT),
        t(ADVANTAGES),
        t([float(m) for m in MASK]),
        LENGTHS,
        config,
        sequence_ratio=False,
        old_from_engine=engine_old,
    )
    rows = hand(name)
    # float32 tensors against float64 loops: a few ulps of values near 1.
    tol = dict(rel=1e-5, abs=1e-6)
    assert counted(loss.detach()) == pytest.approx(only_counted(rows["loss"]), **tol)
    assert counted(metrics["pg_clipfrac"]) == only_counted(rows["clipped"])
    if config.use_tis:
        assert counted(metrics["tis"]) == pytest.approx(only_counted(rows["ratio"]), **tol)
        out = "tis_maskfrac" if name == "mis" else "tis_clipfrac"
        assert counted(metrics[out]) == only_counted(rows["outside"])
    else:
        assert "tis" not in metrics


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("reduction", ["sample", "token"])
def test_reduced_loss_gradient_and_metrics_of_actor_loss(name, reduction):
    config = algorithm(name, loss_reduction=reduction)
    batch, mb = batch_for(config)
    leaf = t(NEW).requires_grad_()
    head = HeadOutput(log_probs=list(leaf.split(LENGTHS)), entropy=split([0.7] * len(MASK)))
    loss, metrics = actor_loss(head, mb, batch, config, sequence_ratio=False)
    rows = hand(name)
    mean = sample_mean if reduction == "sample" else token_mean
    tol = dict(rel=1e-5, abs=1e-6)
    assert loss.item() == pytest.approx(mean(rows["loss"]), **tol)
    assert metrics["pg_loss"].item() == pytest.approx(mean(rows["loss"]), **tol)
    assert metrics["pg_clipfrac"].item() == pytest.approx(mean(rows["clipped"]), **tol)

    loss.backward()
    assert leaf.grad.tolist() == pytest.approx(hand_gradient(name, reduction), **tol)
    assert not torch.isnan(leaf.grad).any()

    assert metrics["entropy_loss"].item() == pytest.approx(0.7)
    assert set(metrics) == set(actor_metric_keys(config, batch))
    # The largest |lp_old - lp| of one counted token, lp_old the batch's old log-probs.
    old = ROLLOUT if config.use_rollout_log_probs else OLD
    gaps = only_counted([abs(o - n) for o, n in zip(old, NEW, strict=True)])
    assert metrics["ppo_kl_abs_max"].item() == pytest.approx(max(gaps), **tol)
    if config.use_tis:
        ratios = only_counted(rows["ratio"])
        out = "tis_maskfrac" if name == "mis" else "tis_clipfrac"
        assert metrics["tis"].item() == pytest.approx(mean(rows["ratio"]), **tol)
        assert metrics["tis_max"].item() == pytest.approx(max(ratios), **tol)
        assert metrics[out].item() == pytest.approx(mean(rows["outside"]), **tol)
    else:
        # No weight: the behaviour ratio pi_theta / pi_rollout is still reported.
        behaviour = [math.exp(n - r) for n, r in zip(NEW, ROLLOUT, strict=True)]
        assert metrics["behaviour_ratio"].item() == pytest.approx(mean(behaviour), **tol)
        assert metrics["behaviour_ratio_max"].item() == pytest.approx(
            max(only_counted(behaviour)), **tol
        )


@pytest.mark.parametrize("reduction", ["sample", "token"])
def test_sequence_level_metrics_are_the_samples_ratios(reduction):
    """Sequence TIS: train/tis is the mean of the samples' unbounded ratios (per sample, or
    weighed by counted tokens), tis_max the largest sample's, and the clip fraction the share
    of samples (or of counted tokens) whose sample left the band."""
    config = algorithm("seq_tis", loss_reduction=reduction)
    batch, mb = batch_for(config)
    head = HeadOutput(log_probs=split(NEW), entropy=None)
    _, metrics = actor_loss(head, mb, batch, config, sequence_ratio=False)
    ratio = {}
    for i in range(len(LENGTHS)):
        total = sum(NEW[j] - ROLLOUT[j] for j in range(len(MASK)) if SAMPLE[j] == i and MASK[j])
        ratio[i] = math.exp(total)
    counts = [sum(MASK[j] for j in range(len(MASK)) if SAMPLE[j] == i) for i in range(4)]
    outside = {i: float(not LOW <= q <= HIGH) for i, q in ratio.items()}
    if reduction == "sample":
        tis = sum(ratio.values()) / 4
        clipfrac = sum(outside.values()) / 4
    else:
        tis = sum(ratio[i] * counts[i] for i in ratio) / sum(counts)
        clipfrac = sum(outside[i] * counts[i] for i in ratio) / sum(counts)
    assert metrics["tis"].item() == pytest.approx(tis, rel=1e-5)
    assert metrics["tis_max"].item() == pytest.approx(max(ratio.values()), rel=1e-5)
    assert metrics["tis_clipfrac"].item() == pytest.approx(clipfrac, rel=1e-6)
    assert 0 < clipfrac < 1


ENGINE_OLD = [name for name in NAMES if name != "decoupled"]


@pytest.mark.parametrize("name", ENGINE_OLD)
@pytest.mark.parametrize("reduction", ["sample", "token"])
def test_an_audit_trains_the_objective_the_run_trains_between_audits(name, reduction):
    """At an audit the trainer scores the rollout itself (its log-probs, OLD, become the
    batch's `log_probs`) for the checks, but the loss stays the configured one, anchored at the
    engine's log-probs: from identical tensors, the same loss and the same gradient in every
    token's log-prob as between audits, and both the hand formula's."""
    config = algorithm(name, loss_reduction=reduction)
    losses, grads = [], []
    for audit in (False, True):
        batch, mb = batch_for(config, audit=audit)
        assert batch.old_from_engine is not audit
        leaf = t(NEW).requires_grad_()
        head = HeadOutput(log_probs=list(leaf.split(LENGTHS)), entropy=None)
        loss, _ = actor_loss(head, mb, batch, config, sequence_ratio=False)
        loss.backward()
        losses.append(loss.detach())
        grads.append(leaf.grad)
    between, at_audit = grads
    assert torch.equal(losses[0], losses[1]), (losses, name)
    assert torch.equal(between, at_audit), (between.tolist(), at_audit.tolist())
    tol = dict(rel=1e-5, abs=1e-6)
    assert at_audit.tolist() == pytest.approx(hand_gradient(name, reduction), **tol)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("audit", [False, True], ids=["between-audits", "audit"])
def test_ppo_kl_is_the_old_log_probs_minus_this_forwards(name, audit):
    """train/ppo_kl = mean(lp_old - lp) over counted tokens, lp_old the batch's old log-probs:
    the engine's under the engine-anchored corrections between audits (so the ratio-1
    corrections `tis`, `seq_tis` and `mis` still report how far the policy is from the
    sampler), the trainer's scoring forward under `decoupled` and at every audit (where the
    checker requires it to be exactly 0 at the first step)."""
    config = algorithm(name)
    batch, mb = batch_for(config, audit=audit)
    head = HeadOutput(log_probs=split(NEW), entropy=None)
    _, metrics = actor_loss(head, mb, batch, config, sequence_ratio=False)
    old = ROLLOUT if config.use_rollout_log_probs and not audit else OLD
    expected = sample_mean([o - n for o, n in zip(old, NEW, strict=True)])
    assert abs(expected) > 5e-3
    assert metrics["ppo_kl"].item() == pytest.approx(expected, rel=1e-5, abs=1e-7)


def test_gspo_with_decoupled_tis_weighs_each_token_of_the_sequence_ratio_loss():
    """GSPO's sequence ratio under `decoupled`: each token's loss is PPO of its sample's
    ratio exp(mean over the sample's counted tokens of lp - lp_prox), times that token's own
    weight trunc(exp(lp_prox - lp_rollout))."""
    config = algorithm("decoupled", advantage_estimator="gspo")
    loss, metrics = actor_policy_loss(
        t(NEW).requires_grad_(),
        t(OLD),
        t(ROLLOUT),
        t(ADVANTAGES),
        t([float(m) for m in MASK]),
        LENGTHS,
        config,
        sequence_ratio=True,
        old_from_engine=False,
    )
    means = {}
    for i in range(len(LENGTHS)):
        diffs = [NEW[j] - OLD[j] for j in range(len(MASK)) if SAMPLE[j] == i and MASK[j]]
        means[i] = sum(diffs) / len(diffs)
    expected, weights = [], []
    for j, a in enumerate(ADVANTAGES):
        w, _ = bounded(math.exp(OLD[j] - ROLLOUT[j]), "truncate")
        weights.append(w)
        expected.append(ppo(math.exp(means[SAMPLE[j]]), a)[0] * w)
    assert len({round(w, 6) for w in only_counted(weights)}) > 2  # the weight varies per token
    assert counted(loss.detach()) == pytest.approx(only_counted(expected), rel=1e-5, abs=1e-6)
    assert counted(metrics["tis"]) == pytest.approx(
        only_counted([math.exp(o - r) for o, r in zip(OLD, ROLLOUT, strict=True)]), rel=1e-5
    )
