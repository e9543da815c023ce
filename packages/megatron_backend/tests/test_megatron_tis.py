"""TIS and masked IS, per token and per sequence, through the real megatron loss path
(megatron-core on CPU), against a hand computation of each token's weight from the engine's
log-probs."""

from __future__ import annotations

import math

import pytest
import torch
from megatron_samples import algorithm, backend, make_samples, sampling

from ember_megatron_backend.worker import MegatronWorker

LOW, HIGH = 0.5, 2.0


def _shift(j: int) -> float:
    """The engine's log-prob sits this far below the trainer's at response token j: ratios
    exp(shift) from about 0.37 to 2.7, inside and outside [LOW, HIGH]."""
    return 1.0 * math.sin(0.9 * j + 0.3)


def _bound(ratio: float, mode: str) -> float:
    if mode == "truncate":
        return min(max(ratio, LOW), HIGH)
    return ratio if LOW <= ratio <= HIGH else 0.0


def _params(worker: MegatronWorker) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in worker.actor.parameters()])


def _engine_samples():
    """Samples whose engine log-probs are the initial trainer's, shifted by `_shift`, and
    those trainer log-probs."""
    samples = make_samples(masked=True)
    trainer = MegatronWorker(backend(), algorithm(), sampling()).prepare(0, samples).log_probs
    for sample, lp in zip(samples, trainer, strict=True):
        sample.rollout_log_probs = [v - _shift(j) for j, v in enumerate(lp.tolist())]
    return samples, trainer


def _ratios(mask: list[int], level: str) -> list[float]:
    """The unbounded ratio of each response token at the first step: exp(shift) per token, or
    at the sequence level the sample's exp(sum of shift over its counted tokens)."""
    if level == "token":
        return [math.exp(_shift(j)) for j in range(len(mask))]
    total = sum(_shift(j) for j, m in enumerate(mask) if m)
    return [math.exp(total)] * len(mask)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("engine_old", [True, False], ids=["engine-old", "trainer-old"])
def test_one_step_equals_ppo_with_advantages_times_the_hand_weight(
    dist_env, mode, engine_old, level
):
    """At the first step the trainer's weights are the sampler's, so with the engine's
    log-probs as the old policy (weight pi_theta / pi_rollout) and with the trainer's
    (weight pi_old / pi_rollout) the weight is bound(exp(shift)) per token, or at the sequence
    level bound(exp(sum of the sample's shifts)) on each of its tokens. The step must then
    equal a plain on-policy PPO step whose advantages were multiplied by that weight: the same
    metrics, the same update of every parameter."""
    samples, _ = _engine_samples()
    settings = backend(num_steps_per_rollout=1)
    tis = dict(use_tis=True, tis_mode=mode, tis_level=level, tis_clip=HIGH, tis_clip_low=LOW)
    worker = MegatronWorker(
        settings, algorithm(use_rollout_log_probs=engine_old, **tis), sampling()
    )
    batch = worker.prepare(0, samples)
    assert batch.old_from_engine is engine_old
    got = worker.train(0, batch)[0]

    plain = MegatronWorker(settings, algorithm(), sampling())
    ref = plain.prepare(0, samples)
    masks = [s.loss_mask for s in samples]
    ratios = [_ratios(m, level) for m in masks]
    ref.advantages = [
        a * torch.tensor([_bound(r, mode) for r in rs])
        for a, rs in zip(ref.advantages, ratios, strict=True)
    ]
    want = plain.train(0, ref)[0]

    # The hand-computed weight is what the loss used: same loss, gradient and update.
    for key in ("train/loss", "train/pg_loss", "train/grad_norm", "train/entropy_loss"):
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7), key
    # Adam's first step moves each weight by about lr * g / (|g| + eps) = 1e-3; where g is
    # near eps, fp32 rounding of the two losses' sums shows (measured: 18 of 281k weights,
    # at most 3.7e-6 on the 2-core AMD EPYC). 1% of a step:
    assert torch.allclose(_params(worker), _params(plain), rtol=0, atol=1e-5)
    assert got["train/pg_clipfrac"] == 0.0

    # The metrics: the unbounded ratio's mean (per sample, then over samples) and maximum,
    # and the share of tokens outside [LOW, HIGH], over counted tokens.

    def sample_mean(per_token):
        means = [
            sum(v * w for v, w in zip(vals, m, strict=True)) / sum(m)
            for vals, m in zip(per_token, masks, strict=True)
        ]
        return sum(means) / len(means)

    outside = [[float(not LOW <= r <= HIGH) for r in rs] for rs in ratios]
    out_key = {"truncate": "train/tis_clipfrac", "mask": "train/tis_maskfrac"}[mode]
    assert got["train/tis"] == pytest.approx(sample_mean(ratios), rel=1e-5)
    assert got[out_key] == pytest.approx(sample_mean(outside), abs=1e-6)
    assert 0.1 < got[out_key] < 0.9
    top = max(
        r for rs, m in zip(ratios, masks, strict=True) for r, w in zip(rs, m, strict=True) if w
    )
    assert got["train/tis_max"] == pytest.approx(top, rel=1e-5)
    assert top > HIGH
    # ppo_kl is lp_old - lp: 0 against the trainer's own old log-probs at the first step, the
    # engine's -shift when they are the old policy (never identically 0 under the ratio of 1).
    if engine_old:
        shifts = [[-_shift(j) for j in range(len(m))] for m in masks]
        assert got["train/ppo_kl"] == pytest.approx(sample_mean(shifts), rel=1e-4, abs=1e-6)
        assert abs(got["train/ppo_kl"]) > 1e-2
    else:
        assert got["train/ppo_kl"] == 0.0


def test_engine_old_weight_follows_the_current_policy_after_the_first_step(dist_env):
    """With the engine's log-probs as the old policy, later steps weigh each token by the
    current policy over the engine (no scoring forward): once the policy moved, the ratio's
    mean moves away from the first step's, while with the trainer's old log-probs it stays
    the same quantity exp(shift) for every step's tokens."""
    samples, _ = _engine_samples()
    tis = dict(use_tis=True, tis_clip=HIGH, tis_clip_low=LOW)
    engine = MegatronWorker(backend(), algorithm(use_rollout_log_probs=True, **tis), sampling())
    trainer = MegatronWorker(backend(), algorithm(**tis), sampling())
    got = engine.train(0, engine.prepare(0, samples))
    want = trainer.train(0, trainer.prepare(0, samples))
    assert got[0]["train/tis"] == pytest.approx(want[0]["train/tis"], rel=1e-6)
    assert got[1]["train/tis"] != pytest.approx(want[1]["train/tis"], rel=1e-4)
    # Step 1 of the trainer-old run: its own old log-probs, so ppo_kl moves; the engine-old
    # run's is against the engine's log-probs at every step, the first step's included.
    assert want[0]["train/ppo_kl"] == 0.0 and want[1]["train/ppo_kl"] != 0.0
    assert got[0]["train/ppo_kl"] != 0.0 and got[1]["train/ppo_kl"] != got[0]["train/ppo_kl"]
