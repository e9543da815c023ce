"""MegatronWorker: one training rank's actor, reference and critic, scoring and training."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ember_core.algorithms import ADVANTAGE_ESTIMATORS, AdvantageInputs, compute_advantages
from ember_core.certify import Fault, planted, shifted_experts
from ember_core.config import AlgorithmConfig, SamplingConfig
from ember_core.heap import release_free_memory
from ember_core.hookspecs import Phase, Role
from ember_core.plugins import EmberPlugins
from ember_core.quant import QuantSpec
from ember_core.types import Sample
from ember_megatron_backend import checkpoint, comm, pipeline
from ember_megatron_backend.advantages import whiten_across
from ember_megatron_backend.batches import (
    MicroBatch,
    RolloutBatch,
    pack_micro_batch,
    padded_positions,
    plan_layouts,
    plan_steps,
    shuffled_order,
)
from ember_megatron_backend.config import BackendConfig, is_hf_checkpoint
from ember_megatron_backend.forward import log_probs_at, run_model
from ember_megatron_backend.losses import (
    actor_loss,
    actor_metric_keys,
    critic_loss,
    local_denominator,
    policy_head,
    value_head,
)
from ember_megatron_backend.metrics import (
    TRAIN_PADDING,
    VERSIONS_BEHIND_MAX,
    accumulate,
    reduce_sums,
    rollout_metrics,
    routing_means,
)
from ember_megatron_backend.model import build_model
from ember_megatron_backend.optimizer import build_optimizer, wrap_ddp
from ember_megatron_backend.parallel import require_no_context_parallel
from ember_megatron_backend.routing import RoutingRecorder
from ember_megatron_backend.scoring import ScoringPass, score_passes
from ember_megatron_backend.weights import (
    export_hf_checkpoint,
    iter_hf_weights,
    load_hf_checkpoint,
)

__all__ = ["MegatronWorker"]

MICRO_BATCH_GROWTH_MIB = 256
"""Resident growth (MiB) after which a training micro-batch on CPU hands the heap's free pages
back (`ember_core.heap.release_free_memory`): a real model's activations grow it by hundreds of
MiB a micro-batch, a tiny model's by almost nothing."""

logger = logging.getLogger(__name__)


def _describe(sample: Sample) -> str:
    return f"sample {sample.index} (group {sample.group_index})"


class MegatronWorker:
    """One training rank: builds the models and runs the backend half of an RL iteration.

    Construct it in a process where ``init_distributed()`` has run (one worker per rank; the
    driver holds each in a Ray actor) and call every method on every rank: they are collective.
    Per rollout: ``prepare`` -> ``log_rollout_data`` -> ``train`` -> ``hf_weights``.

    Data parallelism: each rank receives its own share of the rollout, whole prompt groups
    (group-normalising estimators need the whole group; ``prepare`` checks that no group spans
    two ranks). Mini-batch k of a step is the union over ranks of each rank's k-th slice, and
    losses are scaled by the global number of samples (or counted tokens) of that mini-batch,
    so a data-parallel run computes what one rank computes on the same mini-batches.

    Pipeline parallelism: the ranks of one pipeline group (the stages of a model replica) receive
    the same samples; every pass runs megatron-core's 1F1B schedule (``pipeline``), the last
    stage computes heads, losses and metrics, and every rank returns the same results.
    """

    def __init__(
        self,
        config: BackendConfig,
        algorithm: AlgorithmConfig,
        sampling: SamplingConfig,
        plugins: EmberPlugins | None = None,
        *,
        with_ref: bool | None = None,
        with_critic: bool | None = None,
        quantization: QuantSpec | None = None,
        qat_scale_dtype: torch.dtype | None = None,
    ) -> None:
        """Build the actor, and the reference and critic when needed.

        Args:
            config: The `train` section.
            algorithm: The RL objective.
            sampling: Rollout sampling (its temperature scales policy logits).
            plugins: The run's plugins (their model-config and forward hooks run here).
            with_ref: Build a reference; default: when the KL loss or KL reward penalty needs
                one or `ref_load` is set.
            with_critic: Build a critic; default: when the advantage estimator uses one.
            quantization: The engine's quantization (`engine.quantization`): with `train.qat`
                the actor and the reference multiply with the weights it serves
                (`ember_megatron_backend.qat`); without, it changes nothing here.
            qat_scale_dtype: The dtype the engine serves in, to which INT4 scales are rounded
                under `train.qat`; default: the parameters' dtype.

        Raises:
            RuntimeError: if ``init_distributed()`` has not run.
            ValueError: if the configuration asks for a model it disables, or `train.qat`
                without `quantization` (and what `qat.fake_quantize_model` refuses).
        """
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            raise RuntimeError("call ember_megatron_backend.parallel.init_distributed() first")
        require_no_context_parallel()
        self.pipelined = pipeline.is_pipelined()
        """Layers split into pipeline stages: every pass runs megatron-core's schedule."""
        self.config, self.algorithm, self.sampling = config, algorithm, sampling
        if config.qat and quantization is None:
            raise ValueError(
                "train.qat=true needs engine.quantization (the scheme the engine serves, whose "
                "weights the trainer multiplies with): set it, or train.qat=false"
            )
        self.quantization = quantization if config.qat else None
        """The engine's quantization the actor and reference fake-quantize to (`train.qat`)."""
        self.qat_scale_dtype = qat_scale_dtype or config.torch_dtype
        self.plugins = plugins if plugins is not None else EmberPlugins()
        self.estimator = ADVANTAGE_ESTIMATORS.get(algorithm.advantage_estimator)
        needs_ref = algorithm.use_kl_loss or algorithm.kl_coef > 0
        self.with_ref = (needs_ref or config.ref_load is not None) if with_ref is None else with_ref
        if needs_ref and not self.with_ref:
            raise ValueError("use_kl_loss / kl_coef > 0 need a reference model (with_ref=False)")
        self.with_critic = self.estimator.uses_critic if with_critic is None else with_critic
        if self.estimator.uses_critic and not self.with_critic:
            raise ValueError(
                f"advantage_estimator={algorithm.advantage_estimator!r} needs a critic "
                "(with_critic=False)"
            )
        self.model_config = config.model_config()
        self.rollout_id = -1
        """The last rollout trained on (-1 before the first)."""
        self.accumulated_step = 0
        """Optimizer steps taken over the whole run (survives checkpoints)."""

        actor = self._build(Role.ACTOR)
        if config.hf_load is not None:
            load_hf_checkpoint(actor, config.hf_load, self.model_config)
        self.actor = wrap_ddp(actor)
        self.actor_optimizer = build_optimizer(self.actor, config.optimizer)
        self.routing = RoutingRecorder(self.actor)

        self.ref = None
        if self.with_ref:
            self.ref = self._build_reference(initial_actor=self.actor.module)
            # `ember certify --plant reference` tests its check: the run's reference only, not
            # the second one a check builds from its source to compare it with.
            if planted(Fault.REFERENCE):
                with torch.no_grad():
                    for param in self.ref.parameters():
                        param.mul_(1.01)

        self.critic = self.critic_optimizer = None
        if self.with_critic:
            critic = self._build(Role.CRITIC)
            trunk = config.critic.hf_load or config.hf_load
            if trunk is not None:
                load_hf_checkpoint(critic, trunk, self.model_config)
            self.critic = wrap_ddp(critic)
            self.critic_optimizer = build_optimizer(self.critic, config.critic.optimizer)

    def _build_reference(self, initial_actor: Any = None) -> Any:
        """A frozen reference from its source: `train.ref_load` (a transformers or Ember
        checkpoint), else the actor's initial weights, copied from `initial_actor` when given
        and otherwise built again (the seeded initialisation, then `train.hf_load`)."""
        config = self.config
        ref = self._build(Role.REF)
        if config.ref_load is None:
            if initial_actor is not None:
                ref.load_state_dict(initial_actor.state_dict())
            elif config.hf_load is not None:
                load_hf_checkpoint(ref, config.hf_load, self.model_config)
        elif is_hf_checkpoint(config.ref_load):
            load_hf_checkpoint(ref, config.ref_load, self.model_config)
        else:
            checkpoint.load_model_weights(
                ref, config.ref_load, role=Role.ACTOR.value, expect=self._layout()
            )
        ref.requires_grad_(False)
        ref.eval()
        return ref

    def _weights_changed(self) -> None:
        """Under `rollout.true_on_policy`: drop the packed copies of the weights
        (`exact.packed_weight`), which the optimizer's writes need not announce (megatron-core's
        write through `.data`): called where a pass may follow a change, at the start of
        `prepare`, `trace_layers` and `train` and after every optimizer step."""
        if self.sampling.true_on_policy:
            from ember_core import exact

            exact.forget_packed()

    def _build(self, role: Role) -> Any:
        model = build_model(
            self.model_config,
            critic=role == Role.CRITIC,
            dtype=self.config.torch_dtype,
            seed=self.config.seed,
            adjust_config=lambda tc: self.plugins.model_config(role, tc),
        )
        if self.sampling.true_on_policy and role != Role.CRITIC:
            from ember_core import exact
            from ember_megatron_backend.true_on_policy import exact_megatron, linear_shapes

            exact_megatron(model)
            parameter = next(model.parameters())
            exact.check_linear(linear_shapes(model), parameter.dtype, parameter.device)
        if self.quantization is not None and role != Role.CRITIC:
            from ember_megatron_backend.qat import fake_quantize_model

            fake_quantize_model(model, self.model_config, self.quantization, self.qat_scale_dtype)
        return model

    @staticmethod
    def _parallel_layout() -> dict[str, int]:
        from megatron.core import parallel_state as ps

        return {
            "tensor_parallel": ps.get_tensor_model_parallel_world_size(),
            "pipeline_parallel": ps.get_pipeline_model_parallel_world_size(),
            "expert_parallel": ps.get_expert_model_parallel_world_size(),
            "expert_tensor_parallel": ps.get_expert_tensor_parallel_world_size(),
            "context_parallel": ps.get_context_parallel_world_size(),
        }

    def _layout(self) -> dict[str, Any]:
        """What a checkpoint must share with this run to load into it."""
        return {
            "parallel": self._parallel_layout(),
            # The init scale only matters for fresh weights.
            "model": dataclasses.asdict(self.model_config.replace(init_method_std=1.0)),
            "dtype": self.config.dtype,
        }

    # -- scoring -----------------------------------------------------------------------------

    def prepare(self, rollout_id: int, samples: Sequence[Sample]) -> RolloutBatch:
        """Score this rank's share of a rollout: ref / old actor log-probs, values, advantages.

        Args:
            rollout_id: The rollout.
            samples: This rank's samples: whole prompt groups (``Sample.group_index``), each
                scored (``reward`` set). The driver splits the rollout across data-parallel
                ranks; the split also decides each rank's mini-batches (``RolloutBatch.steps``).

        Raises:
            ValueError: naming the sample for an inconsistent or unscored sample, a group split
                across ranks, or TIS without rollout log-probs.
        """
        self._weights_changed()
        from megatron.core import parallel_state as ps

        # What generation freed (in one process, the engine's decoding) goes back first.
        release_free_memory()
        samples = list(samples)
        if not samples:
            raise ValueError("prepare(): this rank received no samples")
        for sample in samples:
            sample.validate()
            if sample.reward is None:
                raise ValueError(f"{_describe(sample)}: reward is None; score samples first")
        if self.pipelined:
            pipeline.check_same_samples(samples)
        dp_group = ps.get_data_parallel_group()
        self._check_groups(samples, dp_group)
        has_rollout_lp, has_experts, stale = self._all_ranks(
            [
                all(s.rollout_log_probs is not None for s in samples),
                any(s.rollout_routed_experts is not None for s in samples),
                any(self._older_than_trainer(s) for s in samples),
            ],
            dp_group,
        )
        needs = [k for k in ("use_tis", "use_rollout_log_probs") if getattr(self.algorithm, k)]
        if needs and not has_rollout_lp:
            missing = next((s for s in samples if s.rollout_log_probs is None), None)
            where = _describe(missing) if missing is not None else "a sample on another rank"
            raise ValueError(
                f"algorithm.{needs[0]} needs rollout_log_probs on every sample; {where} has none"
            )
        # The engine's log-probs stand in for the old policy's: no actor forward here, except
        # at an audit iteration, where the trainer scores the rollout itself to be compared
        # (the loss still takes the engine's: `losses.actor_loss`).
        audit = self.plugins.audit_rollout(rollout_id)
        if audit and stale:
            raise RuntimeError(
                f"audit of rollout {rollout_id}: samples were generated from weights older than "
                f"the trainer's (version {self.rollout_id}); the driver must let no rollout "
                "generate ahead into an audit iteration, nor train an audited rollout dumped "
                "from other weights (ember.config.check_dump_audit refuses one)"
            )
        score_actor = not self.algorithm.use_rollout_log_probs or audit
        steps, layouts = self._plan(rollout_id, samples)
        routing = None
        if has_experts and score_actor:
            routing = torch.zeros(len(samples), 4, dtype=torch.float64)
        passes: list[ScoringPass] = []
        if self.ref is not None:
            passes.append(ScoringPass("ref", self.ref, Role.REF, Phase.LOG_PROB))
            # A check-only second reference forward with the rollout's routing replayed, when a
            # plugin asks (the CI checker does at rollout 0 under routing replay).
            if self.plugins.replayed_reference_forward(rollout_id):
                passes.append(ScoringPass("replayed_ref", self.ref, Role.REF, Phase.REPLAY_CHECK))
            # A check-only forward of a reference built again from its source, when a plugin
            # asks (the CI checker does at the first audit after a resume). Building draws from
            # the CPU generator: the run's stream is put back afterwards.
            if self.plugins.rebuilt_reference_forward(rollout_id):
                with torch.random.fork_rng(devices=[]):
                    rebuilt = self._build_reference()
                passes.append(ScoringPass("rebuilt_ref", rebuilt, Role.REF, Phase.LOG_PROB))
        if score_actor:
            passes.append(ScoringPass("actor", self.actor, Role.ACTOR, Phase.LOG_PROB, routing))
        if self.critic is not None:
            passes.append(ScoringPass("critic", self.critic, Role.CRITIC, Phase.LOG_PROB))
        plan = [mb for step in steps for mb in step]
        flat = [layout for step in layouts for layout in step] if layouts else [None] * len(plan)
        scored = score_passes(
            samples,
            plan,
            flat,
            passes,
            plugins=self.plugins,
            recorder=self.routing,
            # 1.0 only where `ember certify --plant temperature` tests its check.
            temperature=1.0 if planted(Fault.TEMPERATURE) else self.sampling.temperature,
        )
        log_probs = scored["actor"].log_probs if "actor" in scored else None
        entropy = scored["actor"].entropy if "actor" in scored else None
        ref_log_probs = scored["ref"].log_probs if "ref" in scored else None
        replayed_ref = scored["replayed_ref"].log_probs if "replayed_ref" in scored else None
        rebuilt_ref = scored["rebuilt_ref"].log_probs if "rebuilt_ref" in scored else None
        values = scored["critic"].values if "critic" in scored else None
        shifted_routing = None
        if routing is not None and audit:
            # One check-only forward replaying experts no router picks by itself: where the
            # trainer's own routing agrees with the engine's anyway (float32), replaying the
            # engine's experts cannot tell replay from none.
            shifted_routing = torch.zeros_like(routing)
            probe = ScoringPass("shifted", self.actor, Role.ACTOR, Phase.LOG_PROB, shifted_routing)
            score_passes(
                shifted_experts(samples, self.model_config.num_experts),
                plan,
                flat,
                [probe],
                plugins=self.plugins,
                recorder=self.routing,
                temperature=self.sampling.temperature,
            )
        for counts in (routing, shifted_routing):
            if counts is not None and self.pipelined:
                # Each stage counted its own layers' routings.
                comm.all_reduce(counts, group=ps.get_pipeline_model_parallel_group())

        masks = [torch.tensor(s.effective_loss_mask(), dtype=torch.float32) for s in samples]
        rollout_lp = None
        if has_rollout_lp:
            rollout_lp = [torch.tensor(s.rollout_log_probs, dtype=torch.float32) for s in samples]
        if not score_actor:
            log_probs = rollout_lp
        # The objective's old policy, at an audit too (whose scoring is for the checks only).
        old_log_probs = rollout_lp if self.algorithm.use_rollout_log_probs else log_probs
        advantages, returns = compute_advantages(
            self.algorithm.advantage_estimator,
            AdvantageInputs(
                rewards=torch.tensor([float(s.reward) for s in samples]),
                response_lengths=[s.response_length for s in samples],
                loss_masks=masks,
                group_ids=[s.group_index for s in samples],
                log_probs=old_log_probs,
                ref_log_probs=ref_log_probs,
                values=values,
                gamma=self.algorithm.gamma,
                lambd=self.algorithm.lambd,
                kl_coef=self.algorithm.kl_coef,
                kl_kind=self.algorithm.kl_loss_type,
                normalize_std=self.algorithm.normalize_group_std,
            ),
            # Once, over every rank's counted tokens: what one rank holding the whole rollout
            # computes (REINFORCE++ whitens by definition, whiten_advantages on request).
            whiten=self.algorithm.whiten_advantages,
            whiten_fn=functools.partial(whiten_across, group=dp_group),
        )
        return RolloutBatch(
            rollout_id=rollout_id,
            samples=samples,
            steps=steps,
            loss_masks=masks,
            log_probs=log_probs,
            entropy=entropy,
            advantages=advantages,
            returns=returns,
            ref_log_probs=ref_log_probs,
            ref_replayed_log_probs=replayed_ref,
            ref_rebuilt_log_probs=rebuilt_ref,
            values=values,
            rollout_log_probs=rollout_lp,
            layouts=layouts,
            routing=routing,
            shifted_routing=shifted_routing,
            has_experts=has_experts,
            audit=audit,
            stale=stale,
        )

    def _check_groups(self, samples: list[Sample], group: Any) -> None:
        if dist.get_world_size(group) == 1:
            return
        mine = sorted({s.group_index for s in samples})
        everyone: list[Any] = [None] * dist.get_world_size(group)
        comm.all_gather_object(everyone, mine, group=group)
        owner: dict[int, int] = {}
        for rank, groups in enumerate(everyone):
            for g in groups:
                if g in owner:
                    raise ValueError(
                        f"prompt group {g} has samples on data-parallel ranks {owner[g]} and "
                        f"{rank}; each group must stay on one rank (group baselines need it)"
                    )
                owner[g] = rank

    def _older_than_trainer(self, sample: Sample) -> bool:
        """Whether `sample` came from weights older than the trainer's (its integer
        `weight_version` below the last rollout trained on; -1: the initial weights). A sample
        without an integer version counts as current."""
        return self._versions_behind(sample) > 0

    def _versions_behind(self, sample: Sample) -> int:
        """How many updates the trainer's weights are ahead of those that began `sample` (its
        integer `weight_version`, the oldest of its spans); 0 for a sample without one."""
        try:
            return self.rollout_id - int(sample.weight_version)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return 0

    @staticmethod
    def _all_ranks(flags: list[bool], group: Any) -> list[bool]:
        """Per flag: true on every rank (index 0) / on any rank (others)."""
        values = torch.tensor([int(not flags[0])] + [int(f) for f in flags[1:]])
        if dist.get_world_size(group) > 1:
            comm.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
        return [not bool(values[0])] + [bool(v) for v in values[1:]]

    def log_probs_at(self, samples: Sequence[Sample], ids: Sequence[Tensor]) -> list[Tensor]:
        """The actor's log-probs of token ids `ids[i]` ([R_i, k]) at each response position of
        sample i and of the other ids together ([R_i, k + 1]), from the full vocabulary at the
        rollout temperature, the plugins' forward context around each forward (routing replay
        among them): `forward.log_probs_at`."""

        def context(mb: Any) -> Any:
            return self.plugins.forward_context(Role.ACTOR, Phase.LOG_PROB, mb)

        return log_probs_at(
            self.actor, samples, ids, temperature=self.sampling.temperature, context=context
        )

    def _plan(
        self, rollout_id: int, samples: Sequence[Sample]
    ) -> tuple[list[list[list[int]]], list[list[Any]] | None]:
        """The optimizer steps' micro-batches of `samples` (sample indices) and their padded
        layouts, as `prepare` scores and `train` trains them (collective over data parallel)."""
        from megatron.core import parallel_state as ps

        dp_group = ps.get_data_parallel_group()
        steps = plan_steps(
            samples,
            self.config.num_steps_per_rollout,
            micro_batch_size=self.config.micro_batch_size,
            max_tokens_per_micro_batch=self.config.max_tokens_per_micro_batch,
            group=dp_group,
            strict_counts=ps.get_expert_model_parallel_world_size() > 1,
            order=(
                shuffled_order(len(samples), self.config.seed, rollout_id)
                if self.config.shuffle_mini_batches
                else None
            ),
            by_length=self.config.micro_batches_by_length,
        )
        return steps, plan_layouts(self.actor, samples, steps, dp_group)

    def trace_layers(
        self, rollout_id: int, samples: Sequence[Sample], keep: int
    ) -> tuple[list[dict[tuple[int, str], Tensor]], list[Tensor]]:
        """The old-log-prob forward of rollout `rollout_id`'s `samples`, micro-batch by
        micro-batch as `prepare` runs it, at the rollout temperature, inside the plugins'
        forward context (routing replay among them), with every layer's ops recorded for the
        first `keep` samples: `layer_trace.trace_forward`. One rank without pipeline stages.

        Returns:
            The traces of the first `keep` samples, and every sample's log-probs (those
            `prepare` computes, bit for bit).
        """
        from ember_megatron_backend.layer_trace import trace_forward

        self._weights_changed()
        if dist.get_world_size() > 1:
            raise ValueError(
                "the layer trace runs on one training rank (train.parallel: every size 1)"
            )
        steps, layouts = self._plan(rollout_id, samples)
        plan = [mb for step in steps for mb in step]
        flat = [layout for step in layouts for layout in step] if layouts else [None] * len(plan)

        def context(mb: Any) -> Any:
            return self.plugins.forward_context(Role.ACTOR, Phase.LOG_PROB, mb)

        return trace_forward(
            self.actor,
            samples,
            temperature=self.sampling.temperature,
            context=context,
            plan=list(zip(plan, flat, strict=True)),
            keep=keep,
        )

    def log_rollout_data(self, rollout_id: int, batch: RolloutBatch) -> dict[str, float]:
        """The rollout/* metrics of `batch`, means over the samples of all data-parallel ranks
        (every rank returns the same dict); then the plugins' ``after_log_rollout_data``."""
        from megatron.core import parallel_state as ps

        group = ps.get_data_parallel_group()
        metrics = rollout_metrics(batch, group)
        # The versions as the trainer reads them from the samples, for the checks (the driver
        # logs its own staleness metrics from the same versions).
        behind = torch.tensor(float(max(map(self._versions_behind, batch.samples))))
        if dist.get_world_size(group) > 1:
            comm.all_reduce(behind, op=dist.ReduceOp.MAX, group=group)
        metrics[VERSIONS_BEHIND_MAX] = behind.item()
        # The share of each training forward's positions that are padding (of the step plan).
        positions = torch.tensor(padded_positions(batch.samples, batch.steps, batch.layouts))
        if dist.get_world_size(group) > 1:
            comm.all_reduce(positions, group=group)
        processed, tokens = positions.tolist()
        metrics[TRAIN_PADDING] = 1.0 - tokens / processed if processed else 0.0
        self.plugins.after_log_rollout_data(rollout_id, metrics)
        return metrics

    # -- training ----------------------------------------------------------------------------

    def train(self, rollout_id: int, batch: RolloutBatch) -> list[dict[str, float]]:
        """`num_steps_per_rollout` optimizer steps on `batch`, one per mini-batch.

        Each step accumulates gradients over its micro-batches. A micro-batch's loss (ember-
        core's mean over it) is weighted by its share of the step's global denominator (samples
        or counted tokens over all data-parallel ranks), times the data-parallel size that
        megatron-core's gradient averaging divides by. Metrics are weighted the same way and
        summed over ranks, so they are means over the whole mini-batch.

        Returns:
            Per step, the train/* metrics (identical on every rank), also passed to the plugins'
            ``after_train_step``.
        """
        from megatron.core import parallel_state as ps

        self._weights_changed()
        dp_group = ps.get_data_parallel_group()
        dp_size = ps.get_data_parallel_world_size(with_context_parallel=True)
        reduction = self.algorithm.loss_reduction
        local = torch.tensor(
            [sum(local_denominator(batch, mb, reduction) for mb in step) for step in batch.steps],
            dtype=torch.float64,
        )
        if dist.get_world_size(dp_group) > 1:
            comm.all_reduce(local, group=dp_group)
        totals = local.clamp_min(1.0)
        keys = actor_metric_keys(self.algorithm, batch)
        if self.critic is not None:
            keys += ["value_loss", "value_clipfrac"]
        roles = {Role.ACTOR: self.actor}
        if self.critic is not None:
            roles[Role.CRITIC] = self.critic
        for model in roles.values():
            model.train()
        results = []
        for step_id in range(len(batch.steps)):
            sums = {key: torch.zeros((), dtype=torch.float64) for key in keys}
            self.actor_optimizer.zero_grad()
            if self.critic_optimizer is not None:
                self.critic_optimizer.zero_grad()
            counts = None
            if batch.has_experts:  # on every stage alike: the stages add their counts up
                counts = torch.zeros(len(batch.samples), 4, dtype=torch.float64)
            self._train_step(roles, batch, step_id, float(totals[step_id]), dp_size, sums, counts)
            metrics = reduce_sums({f"train/{k}": v for k, v in sums.items()}, dp_group)
            if self.pipelined:
                # The last stage computed them; the other stages add zeros.
                metrics = reduce_sums(metrics, ps.get_pipeline_model_parallel_group())
            if counts is not None:
                if self.pipelined:  # each stage counted its own layers' routings
                    comm.all_reduce(counts, group=ps.get_pipeline_model_parallel_group())
                step_samples = [i for mb in batch.steps[step_id] for i in mb]
                metrics.update(routing_means(counts, step_samples, dp_group))
            result = self.actor_optimizer.step(self.accumulated_step)
            self._weights_changed()
            metrics["train/grad_norm"], metrics["train/lr"] = result.grad_norm, result.lr
            metrics["train/skipped_step"] = float(result.skipped)
            if self.critic_optimizer is not None:
                result = self.critic_optimizer.step(self.accumulated_step)
                metrics["train/critic_grad_norm"] = result.grad_norm
                metrics["train/critic_lr"] = result.lr
                metrics["train/critic_skipped_step"] = float(result.skipped)
            self.plugins.after_train_step(rollout_id, step_id, self.accumulated_step, metrics)
            self.accumulated_step += 1
            results.append(metrics)
        self.rollout_id = rollout_id
        return results

    def _train_step(
        self,
        roles: dict[Role, Any],
        batch: RolloutBatch,
        step_id: int,
        total: float,
        dp_size: int,
        sums: dict[str, Tensor],
        routing: Tensor | None = None,
    ) -> None:
        """Forwards and backwards of step `step_id`'s micro-batches for each role's model:
        gradients into the DDP buffers, metrics (weighted by each micro-batch's share
        `d_m / total`) into `sums`, and with `routing` ([B, 4] counts) the actor's routing
        against the rollout's experts in each training forward (``RoutingRecorder.record``).

        Each forward, with its loss, runs inside the plugins' `forward_context(role,
        Phase.TRAIN, mb)` and each backward inside `forward_context(role, Phase.BACKWARD, mb)`.
        Without pipeline parallelism each micro-batch goes through every role in turn; with it,
        each role runs its micro-batches through megatron-core's schedule (1F1B), which computes
        the loss on the last stage.
        """
        step = batch.steps[step_id]
        layouts = batch.layouts[step_id] if batch.layouts is not None else [None] * len(step)

        def pack(model: Any, k: int) -> MicroBatch:
            return pack_micro_batch(model, batch.samples, step[k], layouts[k])

        def loss(role: Role, mb: MicroBatch, rows: Tensor) -> Tensor:
            """The micro-batch's loss from the output rows, weighted for the step's mean."""
            if role == Role.ACTOR:
                head = policy_head(rows, mb, self.sampling.temperature)
                value, metrics = actor_loss(
                    head, mb, batch, self.algorithm, sequence_ratio=self.estimator.sequence_ratio
                )
            else:
                value, metrics = critic_loss(value_head(rows, mb), mb, batch, self.algorithm)
            weight = local_denominator(batch, mb.indices, self.algorithm.loss_reduction) / total
            accumulate(sums, metrics, weight)
            return value * (weight * dp_size)

        def forward(role: Role, mb: MicroBatch) -> Any:
            stack = contextlib.ExitStack()
            stack.enter_context(self.plugins.forward_context(role, Phase.TRAIN, mb))
            if role == Role.ACTOR and routing is not None and self.routing.active:
                # Under routing replay the experts the forward used are the replayed ones:
                # counted against the rollout's they give train/replay_agreement, 1.0 exactly.
                stack.enter_context(self.routing.record(mb, routing))
            return stack

        def backward(role: Role, mb: MicroBatch) -> Any:
            return self.plugins.forward_context(role, Phase.BACKWARD, mb)

        # On CPU the heap's free pages go back after a micro-batch (`release_free_memory`) that
        # grew the process by `MICRO_BATCH_GROWTH_MIB`: its activations, before the next one's.
        # On a GPU they were never the heap's.
        on_cpu = next(self.actor.parameters()).device.type == "cpu"
        if self.pipelined:
            # The schedule sets the load-balancing loss's 1 / micro-batches scale itself.
            for role, model in roles.items():
                pipeline.train_step(
                    model,
                    [pack(model, k) for k in range(len(step))],
                    loss=functools.partial(loss, role),
                    forward_context=functools.partial(forward, role),
                    backward_context=functools.partial(backward, role),
                )
                if on_cpu:
                    release_free_memory(MICRO_BATCH_GROWTH_MIB)
            return
        for k in range(len(step)):
            for role, model in roles.items():
                mb = pack(model, k)
                with forward(role, mb):
                    value = loss(role, mb, run_model(model, mb.packed, mb.layout, window=mb.window))
                if self.model_config.moe_aux_loss_coeff > 0:
                    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

                    # The load-balancing loss averages over micro-batches (and ranks via DDP).
                    scale = torch.tensor(1.0 / len(step), device=value.device)
                    MoEAuxLossAutoScaler.set_loss_scale(scale)
                with backward(role, mb):
                    value.backward()
            if on_cpu:
                release_free_memory(MICRO_BATCH_GROWTH_MIB)

    # -- weights and checkpoints -------------------------------------------------------------

    def hf_weights(self, *, dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
        """The actor's weights under transformers names, gathered over TP/EP, and under pipeline
        parallelism from every stage, stage by stage, on every rank (collective: every rank
        consumes the iterator in step). See ``weights.iter_hf_weights``."""
        named = iter_hf_weights(self.actor, self.model_config, dtype=dtype)
        return pipeline.iter_all_stages(named) if self.pipelined else named

    def export_hf(
        self,
        path: str | Path,
        *,
        dtype: torch.dtype | None = None,
        quantization: QuantSpec | None = None,
        quantization_config: Mapping[str, Any] | None = None,
    ) -> Path | None:
        """Write the actor as a transformers checkpoint (collective; rank 0 writes), quantized
        as an engine serves it under `quantization` (see ``weights.export_hf_checkpoint``)."""
        return export_hf_checkpoint(
            self.actor,
            self.model_config,
            path,
            dtype=dtype,
            quantization=quantization,
            quantization_config=quantization_config,
        )

    def _roles(self) -> tuple[dict[str, Any], dict[str, Any]]:
        models: dict[str, Any] = {Role.ACTOR.value: self.actor}
        optimizers: dict[str, Any] = {Role.ACTOR.value: self.actor_optimizer}
        if self.ref is not None:
            models[Role.REF.value] = self.ref
        if self.critic is not None:
            models[Role.CRITIC.value] = self.critic
            optimizers[Role.CRITIC.value] = self.critic_optimizer
        return models, optimizers

    def save_checkpoint(
        self, path: str | Path, *, host_view: Callable[[Any], Any] | None = None
    ) -> Path:
        """Save models, optimizers, RNG and counters under checkpoint root `path` (collective;
        atomic; see ``ember_megatron_backend.checkpoint``). Returns the checkpoint directory.

        Args:
            path: The checkpoint root.
            host_view: For a worker offloaded to host memory, `TrainerOffload.host_view`:
                the checkpoint is written from the host copies, nothing reloaded.
        """
        models, optimizers = self._roles()
        meta = {
            "rollout_id": self.rollout_id,
            "accumulated_step": self.accumulated_step,
            "roles": sorted(models),
            **self._layout(),
        }
        return checkpoint.save_checkpoint(
            path,
            tag=checkpoint.checkpoint_tag(self.accumulated_step),
            models=models,
            optimizers=optimizers,
            meta=meta,
            host_view=host_view,
        )

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore a checkpoint saved by `save_checkpoint` (a root or one checkpoint
        directory), including the step counters.

        Raises:
            FileNotFoundError, ValueError: naming the path for a missing, partial, corrupt or
                mismatched checkpoint.
        """
        models, optimizers = self._roles()
        meta = checkpoint.load_checkpoint(
            path, models=models, optimizers=optimizers, expect=self._layout()
        )
        self.rollout_id = int(meta["rollout_id"])
        self.accumulated_step = int(meta["accumulated_step"])
