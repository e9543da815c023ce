"""Advantage estimators (GRPO, GSPO, REINFORCE++, REINFORCE++-baseline, PPO/GAE) by name."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ember_core.algorithms.losses import KL_ESTIMATORS, approx_kl
from ember_core.algorithms.reductions import masked_whiten
from ember_core.algorithms.registry import Registry

GROUP_STD_EPS = 1e-6
"""Added to the group std before dividing (GRPO)."""


@dataclass(kw_only=True, slots=True)
class AdvantageInputs:
    """Everything an advantage estimator may read, for one rollout batch of B samples.

    Per-token inputs are per-sample lists of [R_i] tensors over the response tokens.
    Validated on construction: bad values raise ValueError naming the field.
    """

    rewards: Tensor
    """Scalar reward per sample [B]; converted to float32, must be finite."""
    response_lengths: Sequence[int]
    """R_i, the number of response tokens of sample i."""
    loss_masks: list[Tensor] | None = None
    """Per-sample masks [R_i] (nonzero = token is trained on); None means all ones."""
    n_samples_per_prompt: int = 1
    """Group size when `group_ids` is None: samples [k*n, (k+1)*n) answer prompt k."""
    group_ids: Sequence[int] | Tensor | None = None
    """Optional prompt id of each sample [B], for groups that are not consecutive blocks."""
    log_probs: list[Tensor] | None = None
    """Old-policy log-probs per sample [R_i]; needed when kl_coef > 0."""
    ref_log_probs: list[Tensor] | None = None
    """Reference log-probs per sample [R_i]; needed when kl_coef > 0."""
    values: list[Tensor] | None = None
    """Critic values per sample [R_i]; needed by "ppo"."""
    gamma: float = 1.0
    """Discount factor in [0, 1]."""
    lambd: float = 1.0
    """GAE lambda in [0, 1]."""
    kl_coef: float = 0.0
    """Weight of the per-token KL penalty in the token rewards (>= 0)."""
    kl_kind: str = "k1"
    """KL estimator of the penalty, a name registered in `KL_ESTIMATORS`."""
    normalize_std: bool = True
    """GRPO/GSPO: divide by the group std (+1e-6); False keeps only mean-centring."""

    def __post_init__(self) -> None:
        rewards_B = torch.as_tensor(self.rewards).detach().to(torch.float32)
        if rewards_B.dim() != 1:
            raise ValueError(
                f"rewards must be a 1-D tensor [B], got shape {tuple(rewards_B.shape)}"
            )
        bad = (~torch.isfinite(rewards_B)).nonzero().flatten()
        if bad.numel():
            i = int(bad[0])
            raise ValueError(f"rewards[{i}] = {float(rewards_B[i])} is not finite")
        self.rewards = rewards_B
        batch = rewards_B.numel()
        self.response_lengths = [int(n) for n in self.response_lengths]
        if len(self.response_lengths) != batch:
            raise ValueError(
                f"response_lengths has {len(self.response_lengths)} entries but rewards has {batch}"
            )
        for i, n in enumerate(self.response_lengths):
            if n < 0:
                raise ValueError(f"response_lengths[{i}] must be >= 0, got {n}")
        if self.loss_masks is None:
            self.loss_masks = [
                torch.ones(n, device=rewards_B.device) for n in self.response_lengths
            ]
        for name in ("loss_masks", "log_probs", "ref_log_probs", "values"):
            self._check_per_token(name)
        if self.group_ids is None:
            n = self.n_samples_per_prompt
            if not (isinstance(n, int) and n >= 1 and batch % n == 0):
                raise ValueError(
                    f"n_samples_per_prompt must be an int >= 1 dividing the batch size {batch}, "
                    f"got {n!r}"
                )
        elif len(self.group_ids) != batch:
            raise ValueError(f"group_ids has {len(self.group_ids)} entries but rewards has {batch}")
        for name in ("gamma", "lambd"):
            value = getattr(self, name)
            if not 0 <= value <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {value!r}")
        if not (math.isfinite(self.kl_coef) and self.kl_coef >= 0):
            raise ValueError(f"kl_coef must be a finite number >= 0, got {self.kl_coef!r}")
        KL_ESTIMATORS.get(self.kl_kind)
        if self.kl_coef > 0 and (self.log_probs is None or self.ref_log_probs is None):
            raise ValueError(f"kl_coef={self.kl_coef} needs log_probs and ref_log_probs")

    def _check_per_token(self, name: str) -> None:
        tensors = getattr(self, name)
        if tensors is None:
            return
        if len(tensors) != len(self.response_lengths):
            raise ValueError(
                f"{name} has {len(tensors)} samples but rewards has {len(self.response_lengths)}"
            )
        for i, (tensor, n) in enumerate(zip(tensors, self.response_lengths, strict=True)):
            if tuple(tensor.shape) != (n,):
                raise ValueError(
                    f"{name}[{i}] has shape {tuple(tensor.shape)} but response_lengths[{i}] = {n}"
                )

    def group_index(self) -> Tensor:
        """Dense group index per sample [B], values in [0, number of groups)."""
        device = self.rewards.device
        if self.group_ids is None:
            return torch.arange(self.rewards.numel(), device=device) // self.n_samples_per_prompt
        ids = torch.as_tensor(self.group_ids, device=device).reshape(-1)
        return torch.unique(ids, return_inverse=True)[1]


AdvantageFn = Callable[[AdvantageInputs], tuple[list[Tensor], list[Tensor]]]


@dataclass(frozen=True, slots=True)
class AdvantageEstimator:
    """A registered estimator and what the trainer must do around it."""

    name: str
    fn: AdvantageFn
    """Maps the inputs to per-sample `(advantages, returns)`, [R_i] float32 each."""
    uses_critic: bool = False
    """Needs critic `values` (and a critic to train on the returns)."""
    sequence_ratio: bool = False
    """The policy loss clips the sequence-level ratio (`gspo_policy_loss`)."""
    whitens: bool = False
    """The estimator's advantages are its `fn`'s, whitened over every counted token of the
    whole batch (REINFORCE++). `fn` leaves them unwhitened, and `compute_advantages` whitens
    once, with a whitening function that may reduce over data-parallel ranks."""

    def __call__(
        self,
        inputs: AdvantageInputs,
        *,
        whiten: bool = False,
        whiten_fn: Callable[[list[Tensor], list[Tensor]], list[Tensor]] | None = None,
    ) -> tuple[list[Tensor], list[Tensor]]:
        """`fn`'s advantages, whitened once when asked (`whiten`) or when the estimator whitens
        by definition; see `compute_advantages`."""
        advantages, returns = self.fn(inputs)
        if whiten or self.whitens:
            assert inputs.loss_masks is not None
            advantages = (whiten_fn or whiten_advantages)(advantages, inputs.loss_masks)
        return advantages, returns


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")
"""Advantage estimators by name."""


def register_advantage_estimator(
    name: str,
    *aliases: str,
    uses_critic: bool = False,
    sequence_ratio: bool = False,
    whitens: bool = False,
) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator registering an `AdvantageFn` in `ADVANTAGE_ESTIMATORS` under `name`.

    Args:
        name: Registered name (what a run config says).
        *aliases: Further names for the same estimator.
        uses_critic: See `AdvantageEstimator.uses_critic`.
        sequence_ratio: See `AdvantageEstimator.sequence_ratio`.
        whitens: See `AdvantageEstimator.whitens` (`fn` returns unwhitened advantages).
    """

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        estimator = AdvantageEstimator(
            name=name,
            fn=fn,
            uses_critic=uses_critic,
            sequence_ratio=sequence_ratio,
            whitens=whitens,
        )
        ADVANTAGE_ESTIMATORS.add(name, estimator, *aliases)
        return fn

    return decorator


def compute_advantages(
    estimator: str,
    inputs: AdvantageInputs,
    *,
    whiten: bool = False,
    whiten_fn: Callable[[list[Tensor], list[Tensor]], list[Tensor]] | None = None,
) -> tuple[list[Tensor], list[Tensor]]:
    """Runs the estimator registered as `estimator`, optionally whitening the advantages.

    Advantages are whitened at most once: when asked (`whiten`) or when the estimator whitens
    by definition (`AdvantageEstimator.whitens`: the REINFORCE++ variants).

    Args:
        estimator: A name registered in `ADVANTAGE_ESTIMATORS`.
        inputs: The batch.
        whiten: Whiten the advantages over the batch's masked tokens afterwards.
        whiten_fn: `(advantages, loss_masks) -> advantages`, the whitening to use (a trainer
            with data-parallel ranks passes one that reduces over all ranks' tokens); default
            `whiten_advantages`, over this batch alone.

    Returns:
        `(advantages, returns)`: per-sample lists of [R_i] float32 tensors, detached.

    Raises:
        ValueError: Unknown estimator (the message lists the known ones) or inputs the
            estimator needs are missing.
    """
    return ADVANTAGE_ESTIMATORS.get(estimator)(inputs, whiten=whiten, whiten_fn=whiten_fn)


def whiten_advantages(
    advantages: list[Tensor], loss_masks: list[Tensor], shift_mean: bool = True
) -> list[Tensor]:
    """Whitens per-sample advantages jointly over all masked tokens of the batch.

    Args:
        advantages: Per-sample advantages [R_i].
        loss_masks: Per-sample masks [R_i].
        shift_mean: See `masked_whiten`.

    Returns:
        Per-sample whitened advantages [R_i].
    """
    if not advantages:
        return []
    lengths = [a.numel() for a in advantages]
    flat_T = masked_whiten(torch.cat(advantages), torch.cat(loss_masks), shift_mean=shift_mean)
    return list(flat_T.split(lengths))


# ----------------------------------------------------------------------------- helpers


def _group_centered(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """Group-mean-centred rewards [B] and the unbiased group std of each sample [B].

    A group whose rewards are all equal (including a group of one sample) is centred to
    exactly 0: computing the mean in floating point can leave a residue of ~1e-9 that the
    std (also ~1e-9) would blow up. The unbiased std of a one-sample group is taken as 0.
    """
    rewards_B = inputs.rewards
    group_B = inputs.group_index()
    num_groups = int(group_B.max()) + 1 if group_B.numel() else 0
    zeros_G = rewards_B.new_zeros(num_groups)
    count_G = zeros_G.index_add(0, group_B, torch.ones_like(rewards_B))
    mean_G = zeros_G.index_add(0, group_B, rewards_B) / count_G
    centered_B = rewards_B - mean_G[group_B]
    low_G = zeros_G.scatter_reduce(0, group_B, rewards_B, "amin", include_self=False)
    high_G = zeros_G.scatter_reduce(0, group_B, rewards_B, "amax", include_self=False)
    constant_B = (low_G == high_G)[group_B]
    centered_B = torch.where(constant_B, torch.zeros_like(centered_B), centered_B)
    var_G = zeros_G.index_add(0, group_B, centered_B.square()) / (count_G - 1).clamp_min(1)
    return centered_B, var_G.sqrt()[group_B]


def _broadcast(per_sample_B: Tensor, lengths: Sequence[int]) -> list[Tensor]:
    return [per_sample_B[i].expand(n).clone() for i, n in enumerate(lengths)]


def _token_rewards(inputs: AdvantageInputs, scores_B: Tensor) -> list[Tensor]:
    """Per-token rewards: -kl_coef * kl on every counted token, plus the sample's score on
    its last counted token (the last token if none counts)."""
    masks = inputs.loss_masks
    assert masks is not None
    token_rewards = []
    for i, (mask, n) in enumerate(zip(masks, inputs.response_lengths, strict=True)):
        counted = mask.to(scores_B.device).bool()
        if inputs.kl_coef > 0:
            assert inputs.log_probs is not None and inputs.ref_log_probs is not None
            kl = approx_kl(inputs.log_probs[i], inputs.ref_log_probs[i], inputs.kl_kind)
            kl = kl.detach().to(scores_B.device)
            rewards = torch.where(counted, -inputs.kl_coef * kl, torch.zeros_like(kl))
        else:
            rewards = scores_B.new_zeros(n)
        if n:
            positions = counted.nonzero().flatten()
            last = int(positions[-1]) if positions.numel() else n - 1
            rewards[last] += scores_B[i]
        token_rewards.append(rewards)
    return token_rewards


def _pad(tensors: list[Tensor], device: torch.device) -> Tensor:
    """Right-pads per-sample [R_i] tensors with zeros into [B, max R_i]."""
    width = max((t.numel() for t in tensors), default=0)
    out_BR = torch.zeros(len(tensors), width, device=device)
    for i, t in enumerate(tensors):
        out_BR[i, : t.numel()] = t.detach().to(device=device, dtype=torch.float32)
    return out_BR


def _unpad(padded_BR: Tensor, lengths: Sequence[int]) -> list[Tensor]:
    return [padded_BR[i, :n].clone() for i, n in enumerate(lengths)]


def _discounted_returns(
    token_rewards: list[Tensor], gamma: float, lengths: Sequence[int], masks: list[Tensor]
) -> list[Tensor]:
    """G_t = r_t + gamma * G_{t'} over the counted tokens, t' the next counted token (G = 0
    after the last). Tokens the model did not generate (loss mask 0: a tool's output) are not
    steps: they are not discounted over, and carry the next counted token's return. Zero
    right-padding (mask 0) leaves each G_t exact."""
    device = token_rewards[0].device if token_rewards else torch.device("cpu")
    rewards_BR = _pad(token_rewards, device)
    counted_BR = _pad(masks, device) > 0
    returns_BR = torch.zeros_like(rewards_BR)
    running_B = rewards_BR.new_zeros(rewards_BR.shape[0])
    for t in reversed(range(rewards_BR.shape[1])):
        step_B = rewards_BR[:, t] + gamma * running_B
        running_B = torch.where(counted_BR[:, t], step_B, running_B)
        returns_BR[:, t] = running_B
    return _unpad(returns_BR, lengths)


# ----------------------------------------------------------------------------- estimators


@register_advantage_estimator("grpo")
def grpo_advantages(inputs: AdvantageInputs) -> tuple[list[Tensor], list[Tensor]]:
    """GRPO: A_i = (r_i - mean_g) / (std_g + 1e-6) on every token of sample i.

    mean_g and std_g are over the sample's group (same prompt); std is the unbiased one
    (torch.std's default, as verl and slime use). With `normalize_std=False`,
    A_i = r_i - mean_g (Dr. GRPO). A group whose rewards are all equal gets exactly 0,
    and so does a group of one sample (n_samples_per_prompt = 1: its own mean is the
    baseline and its std is undefined, taken as 0), never NaN. No KL term: GRPO puts KL
    in the loss. Returns equal the advantages.
    """
    centered_B, std_B = _group_centered(inputs)
    scores_B = centered_B / (std_B + GROUP_STD_EPS) if inputs.normalize_std else centered_B
    advantages = _broadcast(scores_B, inputs.response_lengths)
    return advantages, [a.clone() for a in advantages]


register_advantage_estimator("gspo", sequence_ratio=True)(grpo_advantages)


def _discounted_return_advantages(
    inputs: AdvantageInputs, scores_B: Tensor
) -> tuple[list[Tensor], list[Tensor]]:
    """Discounted token-level returns of `scores_B` (plus any KL penalty), as advantages
    (unwhitened) and returns: the REINFORCE++ variants, which differ only in the scores."""
    assert inputs.loss_masks is not None
    returns = _discounted_returns(
        _token_rewards(inputs, scores_B), inputs.gamma, inputs.response_lengths, inputs.loss_masks
    )
    return [r.clone() for r in returns], returns


def _reinforce_plus_plus_returns(inputs: AdvantageInputs) -> tuple[list[Tensor], list[Tensor]]:
    """REINFORCE++'s discounted returns of the rewards themselves."""
    return _discounted_return_advantages(inputs, inputs.rewards)


def _reinforce_plus_plus_baseline_returns(
    inputs: AdvantageInputs,
) -> tuple[list[Tensor], list[Tensor]]:
    """REINFORCE++-baseline's discounted returns of the group-centred rewards."""
    return _discounted_return_advantages(inputs, _group_centered(inputs)[0])


register_advantage_estimator("reinforce_plus_plus", whitens=True)(_reinforce_plus_plus_returns)
register_advantage_estimator("reinforce_plus_plus_baseline", whitens=True)(
    _reinforce_plus_plus_baseline_returns
)


def reinforce_plus_plus_advantages(
    inputs: AdvantageInputs,
) -> tuple[list[Tensor], list[Tensor]]:
    """REINFORCE++ (arXiv 2501.03262): whitened discounted token-level returns.

    Token rewards: -kl_coef * KL(lp, lp_ref) (kind `kl_kind`) on each counted token, plus
    the sample's reward on its last counted token. Returns G_t = r_t + gamma * G_{t+1}
    over all response tokens; advantages are the returns whitened over every counted
    token of the batch (unbiased variance, see `masked_whiten`).

    Returns:
        `(advantages, returns)` with the returns before whitening.
    """
    return ADVANTAGE_ESTIMATORS.get("reinforce_plus_plus")(inputs)


def reinforce_plus_plus_baseline_advantages(
    inputs: AdvantageInputs,
) -> tuple[list[Tensor], list[Tensor]]:
    """REINFORCE++-baseline: REINFORCE++ on group-mean-centred rewards.

    The sample's reward is replaced by r_i - mean_g (its group's mean as the baseline, no
    std division); the rest is `reinforce_plus_plus`: optional KL penalty per token,
    discounted returns, whitening over the batch. With kl_coef = 0 and gamma = 1 every
    token of sample i carries r_i - mean_g before whitening.

    Returns:
        `(advantages, returns)` with the returns before whitening.
    """
    return ADVANTAGE_ESTIMATORS.get("reinforce_plus_plus_baseline")(inputs)


@register_advantage_estimator("ppo", "gae", uses_critic=True)
def gae_advantages(inputs: AdvantageInputs) -> tuple[list[Tensor], list[Tensor]]:
    """PPO with generalised advantage estimation (arXiv 1506.02438).

    Token rewards as in `reinforce_plus_plus` (reward on the last counted token, KL
    penalty per token). Over the counted tokens, t' the next counted one and V = 0 after the
    last: delta_t = r_t + gamma * V_{t'} - V_t, A_t = delta_t + gamma * lambd * A_{t'},
    returns = A + V. Tokens with loss mask 0 (a tool's output in a multi-turn sample) are
    skipped: their values, which no value loss trains, bootstrap nothing, and they carry the
    next counted token's advantage (no loss reads it). Not whitened unless asked
    (`compute_advantages(whiten=True)`).

    Raises:
        ValueError: `values` is missing.
    """
    if inputs.values is None:
        raise ValueError("values is required by the 'ppo' advantage estimator")
    device = inputs.rewards.device
    assert inputs.loss_masks is not None
    rewards_BR = _pad(_token_rewards(inputs, inputs.rewards), device)
    values_BR = _pad(inputs.values, device)
    counted_BR = _pad(inputs.loss_masks, device) > 0
    advantages_BR = torch.zeros_like(rewards_BR)
    next_value_B = rewards_BR.new_zeros(rewards_BR.shape[0])
    running_B = torch.zeros_like(next_value_B)
    for t in reversed(range(rewards_BR.shape[1])):
        delta_B = rewards_BR[:, t] + inputs.gamma * next_value_B - values_BR[:, t]
        step_B = delta_B + inputs.gamma * inputs.lambd * running_B
        # A token the model did not generate is no step: the critic is never trained there,
        # so its value must not bootstrap the counted token before it (as verl does).
        running_B = torch.where(counted_BR[:, t], step_B, running_B)
        next_value_B = torch.where(counted_BR[:, t], values_BR[:, t], next_value_B)
        advantages_BR[:, t] = running_B
    returns_BR = advantages_BR + values_BR
    lengths = inputs.response_lengths
    return _unpad(advantages_BR, lengths), _unpad(returns_BR, lengths)
