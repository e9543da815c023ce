"""Config sections owned by the core, and the typed dict -> dataclass parsing every section uses."""

from __future__ import annotations

import copy
import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

# --------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}

KEY = "key"
"""Field metadata naming a field's config key where it cannot be the attribute name (a Python
keyword such as `async`): `async_: bool = field(default=False, metadata={KEY: "async"})`."""


def config_key(f: dataclasses.Field[Any]) -> str:
    """The key that sets field `f` in a config file and in `--set`."""
    return f.metadata.get(KEY, f.name)


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Convert `value` to the type `hint` names, raising ValueError that names `key`."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, option, key)
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError(errors[0] if errors else f"{key}: {value!r} is not allowed")
    if origin is Literal:
        for option in args:
            if value == option or (isinstance(value, str) and str(option) == value):
                return option
        allowed = ", ".join(repr(a) for a in args)
        raise ValueError(f"{key}: {value!r} is not one of {allowed}")
    if origin in (list, tuple):
        items = value.split(",") if isinstance(value, str) else value
        if isinstance(value, str) and not value.strip():
            items = []
        if not isinstance(items, list | tuple):
            raise ValueError(f"{key}: expected a list, got {value!r}")
        inner = args[0] if args else Any
        converted = [_coerce(v.strip() if isinstance(v, str) else v, inner, key) for v in items]
        return converted if origin is list else tuple(converted)
    if origin is dict or hint is dict:
        if not isinstance(value, Mapping):
            raise ValueError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"{key}: expected a section (mapping), got {value!r}")
        return from_dict(hint, value, prefix=key)
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ValueError(f"{key}: expected true or false, got {value!r}")
    if hint is int:
        if isinstance(value, bool):
            raise ValueError(f"{key}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ValueError(f"{key}: expected an integer, got {value!r}")
    if hint is float:
        if isinstance(value, bool):
            raise ValueError(f"{key}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{key}: expected a number, got {value!r}") from None
    if hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        raise ValueError(f"{key}: expected a string, got {value!r}")
    if isinstance(hint, type) and isinstance(value, hint):
        return value
    raise ValueError(f"{key}: cannot read {value!r} as {hint}")


def from_dict(cls: type, data: Mapping[str, Any], *, prefix: str = "") -> Any:
    """Build dataclass `cls` from a mapping, converting values to the annotated field types.

    Strings are accepted for every scalar type, so `--set a.b=value` overrides work unchanged.

    Args:
        cls: A dataclass type whose fields may themselves be dataclasses (nested sections).
        data: Field values by name; missing fields keep their defaults.
        prefix: Dotted path of this section, used in error messages.

    Raises:
        ValueError: An unknown key (the known ones are listed) or a value of the wrong type; the
            message names the full dotted key.
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"{prefix or 'config'}: expected a section (mapping), got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {config_key(f): f for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise ValueError(f"{dotted}: unknown key; known keys here: {known}")
        name = fields[key].name
        kwargs[name] = _coerce(value, hints[name], dotted)
    try:
        return cls(**kwargs)
    except ValueError as exc:
        if prefix and not str(exc).startswith(prefix):
            raise ValueError(f"{prefix}.{exc}") from None
        raise


def to_dict(section: Any) -> dict[str, Any]:
    """The plain-data form of a (nested) dataclass section, for writing resolved configs.

    Keys are config keys (`config_key`), so `from_dict` reads the result back.
    """
    return _plain(section)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {config_key(f): _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list | tuple):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return copy.deepcopy(value)


def field_docs(cls: type) -> dict[str, str]:
    """Each field's one-line docstring (the string literal right under it), by field name."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, following in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _yaml(value: Any) -> str:
    """A value as a config file or `--set` writes it: true/false, null, strings bare."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else str(value)


def check(condition: bool, key: str, value: Any, expected: str) -> None:
    """Raise the one-line config error `key=value: expected ...` unless `condition` holds.

    Sections call it from `__post_init__`; `from_dict` prefixes the section path to the key.
    """
    if not condition:
        raise ValueError(f"{key}={value!r}: expected {expected}")


# --------------------------------------------------------------------------------------------
# Sections the core owns
# --------------------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class SamplingConfig:
    """How rollouts are sampled (the `rollout` section's sampling keys)."""

    rollout_batch_size: int = 8
    """Prompts per rollout."""
    n_samples_per_prompt: int = 4
    """Responses sampled for each prompt (the group size of GRPO-style estimators)."""
    temperature: float = 1.0
    """Sampling temperature; training divides policy logits by the same value. Every engine's
    `rollout_log_probs` are log softmax(logits / temperature) of the sampled tokens over the whole
    vocabulary."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p. Tokens
    are drawn from the kept set; their log-probs stay those of the unfiltered distribution
    (`temperature`), on every engine."""
    top_k: int = -1
    """Keep only the k most likely tokens; -1 keeps all. Log-probs as for top_p; with
    `engine.kind: sglang`, 1 (greedy there) needs temperature 1."""
    max_response_len: int = 64
    """Most response tokens per sample: the generated ones, and the ones an `ember_generate`
    plugin inserts (a tool's output)."""
    seed: int = 1234
    """Seed of the rollout sampler."""
    async_: bool = field(default=False, metadata={KEY: "async"})
    """One-step-off-policy training: rollout i+1 generates while the trainer trains on rollout i,
    from weights one version old (`rollout/staleness` 1), and `algorithm.use_tis` turns on
    unless set (or unless `algorithm.use_rollout_log_probs` already takes the ratio against the
    sampling policy). The Python field is `async_` (`async` is a keyword). The shorthand of
    `max_staleness` 0 (false) and 1 (true); when `max_staleness` is given, it decides."""
    max_staleness: int | None = None
    """How many weight versions generation may run ahead of training (k). Rollout j is
    generated from the weights trained on rollout j - 1 - k (the initial weights while
    j <= k), so its samples are exactly min(j, k) versions old when trained: 0 generates and
    trains in turn, 1 is the overlapped loop (`async: true`). k > 1 adds staleness, not
    overlap: the manager generates one rollout at a time and, without `partial_rollouts`, a
    push waits for the rollouts ahead, so from the second iteration on one rollout generates
    while the trainer trains, as at k = 1; with `partial_rollouts` the rollouts ahead queue on
    the engines across pushes. Null: 1 with `async: true`, else 0. A rollout restored
    from a checkpoint that is staler than the bound, or audited, is generated again from the
    same prompts (`rollout/regenerated`)."""
    partial_rollouts: bool = False
    """With max_staleness >= 1: new weights reach the engines between decode steps, while the
    rollouts ahead are still generating, instead of after they finish; each sample records
    the weight version of every span of its response (`Sample.weight_versions`), and the
    bound holds for its oldest span. Both engines take weights mid-generation: the embedded
    one between decode steps, SGLang servers paused in place around each update (launched
    without the radix cache; attached ones must run with --disable-radix-cache)."""

    true_on_policy: bool = False
    """The embedded engine and the trainer compute with the same batch-invariant kernels
    (`ember_core.exact`: linear layers, RMSNorm, attention), so the engine samples with exactly
    the log-probs the trainer computes for the same weights: 0 difference, bit for bit, not a
    small one. Needs `engine.kind: hf`, the same dtype on both sides (`engine.hf.dtype`,
    `train.dtype`) and no model parallelism; `engine.hf.pack_linears` and
    `engine.hf.attn_implementation` give way to the mode's kernels. Each side checks at start
    that this machine's matrix products are batch-invariant and refuses to run if not.
    docs/true-on-policy.md has what it costs."""

    def __post_init__(self) -> None:
        check(self.rollout_batch_size >= 1, "rollout_batch_size", self.rollout_batch_size, ">= 1")
        check(
            self.n_samples_per_prompt >= 1,
            "n_samples_per_prompt",
            self.n_samples_per_prompt,
            ">= 1",
        )
        check(
            math.isfinite(self.temperature) and self.temperature > 0,
            "temperature",
            self.temperature,
            "a finite number > 0",
        )
        check(0 < self.top_p <= 1, "top_p", self.top_p, "0 < top_p <= 1")
        check(self.top_k == -1 or self.top_k >= 1, "top_k", self.top_k, "-1 (off) or >= 1")
        check(self.max_response_len >= 1, "max_response_len", self.max_response_len, ">= 1")
        if self.max_staleness is not None:
            check(
                isinstance(self.max_staleness, int)
                and not isinstance(self.max_staleness, bool)
                and self.max_staleness >= 0,
                "max_staleness",
                self.max_staleness,
                "an integer >= 0 (0: rollout and training in turn; 1: overlapped; k: k ahead)",
            )
            self.async_ = self.max_staleness >= 1
        else:
            self.max_staleness = 1 if self.async_ else 0
        check(
            not self.partial_rollouts or self.max_staleness >= 1,
            "partial_rollouts",
            self.partial_rollouts,
            f"false with max_staleness={self.max_staleness} (nothing generates while the "
            "trainer trains, so no weights arrive mid-generation)",
        )


@dataclass(kw_only=True, slots=True)
class AlgorithmConfig:
    """The RL objective: advantage estimator, policy/value losses and their regularisers."""

    advantage_estimator: str = "grpo"
    """Registered estimator: grpo, gspo, reinforce_plus_plus, reinforce_plus_plus_baseline, ppo."""
    normalize_group_std: bool = True
    """GRPO/GSPO: divide group-centred rewards by the group std (+1e-6)."""
    whiten_advantages: bool = False
    """Whiten advantages over all unmasked tokens of the batch after estimation."""
    gamma: float = 1.0
    """Discount for token-level returns (PPO GAE, REINFORCE++)."""
    lambd: float = 1.0
    """GAE lambda (PPO)."""
    eps_clip: float = 0.2
    """PPO clip range below 1 (and above, unless eps_clip_high is set)."""
    eps_clip_high: float | None = None
    """PPO clip range above 1; None uses eps_clip."""
    eps_clip_c: float | None = None
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens; None disables."""
    use_kl_loss: bool = False
    """Add kl_loss_coef * KL(actor || ref) to the loss."""
    kl_loss_coef: float = 0.0
    """Weight of the KL loss."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator of the loss: k1, k2, k3 or low_var_kl."""
    kl_coef: float = 0.0
    """Weight of the per-token KL penalty folded into rewards (REINFORCE++, PPO)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""
    loss_reduction: Literal["sample", "token"] = "sample"
    """sample: mean over each sample's tokens, then over samples; token: mean over all tokens."""
    off_policy_correction: str | None = None
    """A named off-policy correction that sets use_rollout_log_probs, use_tis, tis_mode and
    tis_level together: behaviour_clip (the PPO clip anchored at the engine's log-probs),
    decoupled (the clip anchored at the trainer's scoring forward, each token weighted by
    pi_prox / pi_rollout truncated), tis (token TIS), seq_tis (sequence TIS) or mis (masked
    IS); formulas in docs/learning-stability.md. One of those keys set to a value the
    correction contradicts is refused (false and the defaults cannot be told from unset, so
    they give way). Null (the default): the keys as given."""
    use_rollout_log_probs: bool = False
    """Take the old policy's log-probs of the PPO ratio from the engine (each sample's
    `rollout_log_probs`) instead of a scoring forward of the trainer: one actor forward over the
    rollout less per iteration. Exact where the engine samples in the trainer's dtype from the
    trainer's weights; otherwise the first step's ratio carries the train/rollout mismatch.
    With rollout.top_p < 1 or rollout.top_k > 0 the engine samples from the filtered
    distribution but reports, as the trainer computes, log-probs of the unfiltered one (section
    "Rollout log-probs" of docs/learning-stability.md). Without that forward, rollout/log_probs,
    rollout/entropy and the rollout/ routing metrics are not logged (train/ ones are);
    train/train_rollout_logprob_abs_diff compares the step's own log-probs with the engine's (at
    step 0: the mismatch). CI audits (ci_kl_checker) score some rollouts anyway."""
    use_tis: bool | None = None
    """Importance sampling against the engine's log-probs: multiply the policy loss per token
    by a weight bounded by `tis_mode` from ratio = exp(lp_anchor - lp_rollout), lp_anchor the
    log-probs that anchor the PPO ratio. With the trainer's old log-probs (use_rollout_log_probs
    false) that is the trainer's scoring forward. With use_rollout_log_probs true the engine's
    log-probs are the old policy and lp_anchor is each training forward's own log-probs,
    detached: the weight is then pi_theta / pi_rollout itself, the PPO ratio is 1 and never
    clipped, and the bound on the weight is the trust region (verl's bypass mode); GSPO and
    eps_clip_c are refused there. See docs/learning-stability.md. Null (the
    default) becomes true when `rollout.async` is true and `use_rollout_log_probs` false, and
    false otherwise; `off_policy_correction` sets it."""
    tis_mode: str = "truncate"
    """How the TIS weight is bounded (with use_tis): truncate clamps the ratio to
    [tis_clip_low, tis_clip] (token TIS); mask keeps the ratio inside that band and zeroes the
    token's policy loss outside it (masked IS, MIS), its sample's token count unchanged."""
    tis_level: str = "token"
    """Where the TIS ratio is taken (with use_tis): token weighs each token by its own ratio;
    sequence weighs every token of a sample by the sample's ratio exp(sum over its counted
    tokens of lp_anchor - lp_rollout), bounded by tis_mode as a whole (truncate: clamped;
    mask: the sample's policy loss zeroed outside the band)."""
    tis_clip: float = 2.0
    """Upper bound of the TIS weight (truncate: clamp; mask: tokens above are masked, whole
    samples at the sequence level)."""
    tis_clip_low: float = 0.0
    """Lower bound of the TIS weight (truncate: clamp; mask: tokens below are masked, whole
    samples at the sequence level)."""
    value_clip: float = 0.2
    """Clip range of value predictions around the old values (PPO critic)."""

    def __post_init__(self) -> None:
        from ember_core.algorithms import (
            ADVANTAGE_ESTIMATORS,
            KL_ESTIMATORS,
            TIS_LEVELS,
            TIS_MODES,
        )

        # First, so that every check below sees the flags the named correction means.
        self._apply_off_policy_correction()
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            known = ", ".join(ADVANTAGE_ESTIMATORS.names())
            raise ValueError(
                f"advantage_estimator={self.advantage_estimator!r}: expected one of {known}"
            )
        if self.kl_loss_type not in KL_ESTIMATORS:
            known = ", ".join(KL_ESTIMATORS.names())
            raise ValueError(f"kl_loss_type={self.kl_loss_type!r}: expected one of {known}")
        check(0 < self.gamma <= 1, "gamma", self.gamma, "0 < gamma <= 1")
        check(0 <= self.lambd <= 1, "lambd", self.lambd, "0 <= lambd <= 1")
        check(0 < self.eps_clip < 1, "eps_clip", self.eps_clip, "0 < eps_clip < 1")
        check(
            self.eps_clip_high is None or self.eps_clip_high > 0,
            "eps_clip_high",
            self.eps_clip_high,
            "> 0 or null",
        )
        check(
            self.eps_clip_c is None or self.eps_clip_c > 1,
            "eps_clip_c",
            self.eps_clip_c,
            "> 1 or null (dual clip needs c > 1)",
        )
        for key in ("kl_loss_coef", "kl_coef", "entropy_coef"):
            value = getattr(self, key)
            check(math.isfinite(value) and value >= 0, key, value, "a finite number >= 0")
        check(self.tis_clip > 0, "tis_clip", self.tis_clip, "> 0")
        check(
            0 <= self.tis_clip_low < self.tis_clip,
            "tis_clip_low",
            self.tis_clip_low,
            f"0 <= tis_clip_low < tis_clip={self.tis_clip}",
        )
        check(self.value_clip > 0, "value_clip", self.value_clip, "> 0")
        if self.tis_mode not in TIS_MODES:
            known = ", ".join(TIS_MODES.names())
            raise ValueError(f"tis_mode={self.tis_mode!r}: expected one of {known}")
        if self.tis_level not in TIS_LEVELS:
            known = ", ".join(TIS_LEVELS.names())
            raise ValueError(f"tis_level={self.tis_level!r}: expected one of {known}")
        if self.use_rollout_log_probs and self.use_tis:
            # The weight pi_theta / pi_rollout replaces the PPO ratio there (see use_tis).
            flags = "use_tis=true and use_rollout_log_probs=true"
            fix = "set use_tis=false or use_rollout_log_probs=false"
            if self.off_policy_correction is not None:
                flags = f"off_policy_correction={self.off_policy_correction!r} ({flags})"
                fix = "choose off_policy_correction=decoupled or behaviour_clip"
            if ADVANTAGE_ESTIMATORS.get(self.advantage_estimator).sequence_ratio:
                raise ValueError(
                    f"advantage_estimator={self.advantage_estimator!r} with {flags}: the "
                    f"{self.tis_level} TIS weight would replace its sequence-level ratio; {fix}"
                )
            if self.eps_clip_c is not None:
                raise ValueError(
                    f"eps_clip_c={self.eps_clip_c} with {flags}: the PPO ratio is then 1 and "
                    "the dual clip never acts (tis_clip bounds the weight); set eps_clip_c=null"
                )

    def _apply_off_policy_correction(self) -> None:
        """Set the flags `off_policy_correction` names, refusing one given otherwise.

        A flag counts as given when it differs from the field's default (use_tis: when not
        None), so the resolved config, which holds the correction's own values, reads back
        unchanged.
        """
        from ember_core.algorithms import OFF_POLICY_CORRECTIONS

        name = self.off_policy_correction
        if name is None:
            return
        if name not in OFF_POLICY_CORRECTIONS:
            known = ", ".join(OFF_POLICY_CORRECTIONS.names())
            raise ValueError(f"off_policy_correction={name!r}: expected one of {known}, or null")
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for key, value in OFF_POLICY_CORRECTIONS.get(name).flags().items():
            given = getattr(self, key)
            if given != defaults[key] and given != value:
                raise ValueError(
                    f"off_policy_correction={name!r} sets {key}={_yaml(value)}, but "
                    f"{key}={_yaml(given)} was given; drop {key} (or set it to "
                    f"{_yaml(value)}), or set off_policy_correction=null"
                )
            setattr(self, key, value)


@dataclass(kw_only=True, slots=True)
class CIConfig:
    """CI-only invariants."""

    test: bool = False
    """Turn on CI-mode assertions (for example the exact on-policy checks of ci_kl_checker)."""


@dataclass(kw_only=True, slots=True)
class CoreConfig:
    """The sections the core owns, as they appear at the top level of a run config."""

    rollout: SamplingConfig = field(default_factory=SamplingConfig)
    """Rollout sampling."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """RL objective."""
    plugins: list[str] = field(default_factory=list)
    """Plugins to enable, by entry-point name (installed plugins stay off unless listed)."""
    ci: CIConfig = field(default_factory=CIConfig)
    """CI switches."""

    def __post_init__(self) -> None:
        for name in self.plugins:
            check(bool(name) and name.isidentifier(), "plugins", name, "plugin names")


def resolve_tis(algorithm: AlgorithmConfig, rollout: SamplingConfig) -> None:
    """Settle `algorithm.use_tis` when it was left unset (None): on exactly in `rollout.async`
    mode, whose samples come from weights one version older than the trainer's, unless the old
    log-probs are already the engine's (`use_rollout_log_probs`). Reading a run
    config (`ember.config.load_config`) does this, so the resolved config holds a boolean.
    A named `off_policy_correction` has already set it (`AlgorithmConfig.__post_init__`)."""
    if algorithm.use_tis is None:
        algorithm.use_tis = rollout.async_ and not algorithm.use_rollout_log_probs
