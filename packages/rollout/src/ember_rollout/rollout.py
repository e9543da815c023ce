"""One rollout: prompt groups through the engines, rewards, dynamic filter, samples, metrics."""

from __future__ import annotations

import dataclasses
import logging
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ember_core.config import SamplingConfig
from ember_core.types import Sample, SampleStatus
from ember_rollout.config import GroupSamplingConfig, RewardConfig, RolloutSections
from ember_rollout.data import PromptDataset, PromptEncoder, PromptRecord, load_prompts
from ember_rollout.engine import (
    Engine,
    EngineError,
    GenerateOutput,
    GenerateRequest,
    ModelInfo,
    SamplingParams,
)
from ember_rollout.plugin_generation import (
    GroupClient,
    RequestBatcher,
    check_plugin_samples,
    gather_all,
)
from ember_rollout.rewards import Scorer
from ember_rollout.tokenizer import load_tokenizer, ordinary_stop_ids

if TYPE_CHECKING:
    from ember_core.plugins import EmberPlugins

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RolloutBatch:
    """The samples of one rollout, grouped by prompt, and its `rollout/*` and `perf/*` metrics.

    Group g is `samples[g * n : (g + 1) * n]` with n = n_samples_per_prompt; `sample.index` is
    the position in `samples` and `sample.group_index` is g.
    """

    samples: list[Sample]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class PromptGroup:
    """One prompt and its `n_samples_per_prompt` requests: the unit an engine generates. A group
    never splits across engines, so its members share one prompt prefix in one engine's cache."""

    record: PromptRecord
    prompt_ids: list[int]
    """The encoded prompt."""
    requests: list[GenerateRequest]
    """One request per sample of the group, each with its own seed."""
    index: int
    """Position of the group in its sampling round; its samples are numbered from
    `index * len(requests)` until the rollout renumbers its kept groups."""


class GroupRunner(Protocol):
    """Generates prompt groups into samples: one engine here (`LocalGroups`), or a pool of
    engine actors that spreads whole groups over its engines."""

    @property
    def kind(self) -> str:
        """The engine kind, as the rollout hooks name it (`hf`, `sglang`)."""
        ...

    async def generate_groups(self, groups: Sequence[PromptGroup]) -> list[list[Sample]]:
        """The samples of every group, in group order (each inner list in request order)."""
        ...


class LocalGroups:
    """Generates groups on one engine in this process and turns its answers into samples.

    Each sample records its response's spans by weight version as the engine reported them
    (`meta_info.weight_versions`, checked: a malformed one is an `EngineError` naming the
    request) and, as `weight_version`, the first span's version (or `meta_info.weight_version`
    from an engine that reports no spans): the oldest weights that generated it. Plugins see
    every sample with the engine's meta info (`ember_process_sample`). When an enabled plugin
    implements `ember_generate`, each group goes to it (all groups at once, their engine calls
    batched together); its samples are checked and then treated like the built-in ones.
    """

    def __init__(self, engine: Engine, tokenizer: Any, plugins: EmberPlugins | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.plugins = plugins

    @property
    def kind(self) -> str:
        return self.engine.kind

    async def generate_groups(self, groups: Sequence[PromptGroup]) -> list[list[Sample]]:
        if self.plugins is not None and self.plugins.has_generate():
            batcher = RequestBatcher(self.engine)
            return await gather_all(self._plugin_group(batcher, group) for group in groups)
        requests = [r for group in groups for r in group.requests]
        outputs = await self.engine.generate(requests)
        if len(outputs) != len(requests):
            raise EngineError(
                f"engine returned {len(outputs)} outputs for {len(requests)} requests"
            )
        answers = iter(outputs)
        samples = []
        for group in groups:
            n = len(group.requests)
            samples.append(
                [
                    self._sample(group, request, next(answers), group.index * n + j)
                    for j, request in enumerate(group.requests)
                ]
            )
        return samples

    async def _plugin_group(self, batcher: RequestBatcher, group: PromptGroup) -> list[Sample]:
        """One group through `ember_generate`, or the built-in generation if no plugin takes
        it."""
        assert self.plugins is not None
        n = len(group.requests)
        client = GroupClient(batcher, group, self.tokenizer)
        wanted = group.requests[0].wants_routed_experts
        samples = await self.plugins.generate(
            client=client,
            record=group.record,
            prompt_ids=list(group.prompt_ids),
            sampling=client.settings,
            routed_experts=wanted,
        )
        if samples is None:
            outputs = await gather_all(batcher.submit(r) for r in group.requests)
            return [
                self._sample(group, request, output, group.index * n + j)
                for j, (request, output) in enumerate(zip(group.requests, outputs, strict=True))
            ]
        samples = check_plugin_samples(
            samples, group, routed_experts=wanted, info=self.engine.model_info
        )
        record = group.record
        for j, sample in enumerate(samples):
            sample.index, sample.group_index = group.index * n + j, group.index
            sample.prompt, sample.label = record.prompt, record.label
            if not sample.response:
                sample.response = self.tokenizer.decode(
                    sample.tokens[sample.prompt_length :], skip_special_tokens=True
                )
            if sample.weight_versions is None:
                sample.weight_versions = client.weight_versions(
                    j, sample.tokens, sample.prompt_length
                )
            if sample.weight_version is None:
                spans = sample.weight_versions
                sample.weight_version = spans[0][1] if spans else client.first_version[j]
            sample.metadata = {
                **record.metadata,
                "source": record.source,
                "engine_calls": client.calls[j],
                **sample.metadata,
            }
            sample.validate()
            self.plugins.process_sample(sample, client.last_meta[j], self.engine.kind)
        return samples

    def _sample(
        self, group: PromptGroup, request: GenerateRequest, output: GenerateOutput, index: int
    ) -> Sample:
        if not output.output_ids:
            raise EngineError(
                f"{request.name}: the engine returned no tokens ({output.finish_reason})"
            )
        record = group.record
        spans, version = output.versions(request.name)
        sample = Sample(
            tokens=list(group.prompt_ids) + list(output.output_ids),
            response_length=len(output.output_ids),
            index=index,
            group_index=group.index,
            prompt=record.prompt,
            response=self.tokenizer.decode(output.output_ids, skip_special_tokens=True),
            label=record.label,
            rollout_log_probs=list(output.output_log_probs),
            rollout_routed_experts=output.routed_experts,
            status=output.status,
            weight_version=version,
            weight_versions=spans,
            metadata={
                **record.metadata,
                "source": record.source,
                "finish_reason": output.finish_reason,
            },
        )
        if self.plugins is not None:
            self.plugins.process_sample(sample, output.meta_info, self.engine.kind)
        return sample


def request_seed(seed: int | str, rollout_id: int, round_id: int, group: int, sample: int) -> int:
    """A sampler seed for one request, fixed by the run seed and the request's position."""
    return random.Random(f"{seed}/{rollout_id}/{round_id}/{group}/{sample}").getrandbits(63)


GENERATION_METADATA = ("source", "finish_reason", "engine_calls")
"""Sample metadata keys the generation adds beside the prompt record's own."""


def prompts_of(samples: Sequence[Sample]) -> list[tuple[PromptRecord, list[int]]]:
    """The prompts of a rollout's groups, in group order, as `RolloutGenerator.generate` takes
    them to generate the same groups again: each group's record (prompt, label, the record's
    metadata and source, from its first sample) and encoded prompt (the tokens before the
    response)."""
    first: dict[int, Sample] = {}
    for sample in samples:
        first.setdefault(sample.group_index, sample)
    prompts = []
    for _, sample in sorted(first.items()):
        metadata = {k: v for k, v in sample.metadata.items() if k not in GENERATION_METADATA}
        record = PromptRecord(
            prompt=sample.prompt,
            label=sample.label,
            metadata=metadata,
            source=str(sample.metadata.get("source", "")),
        )
        prompts.append((record, list(sample.tokens[: sample.prompt_length])))
    return prompts


def _has_signal(group: list[Sample]) -> bool:
    rewards = [s.reward for s in group]
    return max(rewards) > min(rewards)  # type: ignore[type-var]


class RolloutGenerator:
    """Produces rollout batches: `rollout_batch_size` prompts x `n_samples_per_prompt` samples.

    It owns the prompt stream, the scorer and the dynamic filter; a `GroupRunner` generates the
    groups (one local engine, or a pool of engines). With `dynamic_filter`, groups whose rewards
    are all equal (no learning signal for group baselines) are dropped and more prompts are
    generated, `over_sampling_batch_size` per round, until the batch is full or `max_rounds`
    ran. Groups with an aborted sample are always dropped and replaced the same way.
    """

    def __init__(
        self,
        *,
        runner: GroupRunner,
        tokenizer: Any,
        dataset: PromptDataset,
        encoder: PromptEncoder,
        sampling: SamplingConfig,
        scorer: Scorer,
        group_sampling: GroupSamplingConfig | None = None,
        plugins: EmberPlugins | None = None,
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.dataset = dataset
        self.encoder = encoder
        self.sampling = sampling
        self.scorer = scorer
        self.group_sampling = group_sampling or GroupSamplingConfig()
        self.plugins = plugins

    @classmethod
    def from_config(
        cls,
        *,
        sampling: SamplingConfig,
        sections: RolloutSections,
        engine: Engine | None = None,
        runner: GroupRunner | None = None,
        model_info: ModelInfo | None = None,
        plugins: EmberPlugins | None = None,
    ) -> RolloutGenerator:
        """Build the data pipeline and scorer from config, around a started engine or a runner.

        Args:
            sampling: The `rollout` section.
            sections: The rollout package's sections (engine, data, reward, group_sampling).
            engine: A started engine in this process; groups are generated on it.
            runner: What generates groups instead of `engine` (for example a pool of engines).
            model_info: The served model's shape when `runner` is given (with `engine`, the
                engine's own); it sets the default `data.max_prompt_len`.
            plugins: Enabled plugins (request fields, and per-sample hooks for `engine`).
        """
        if (engine is None) == (runner is None):
            raise TypeError("RolloutGenerator.from_config: pass exactly one of engine, runner")
        data = sections.data
        tokenizer_path = data.tokenizer_path
        if tokenizer_path is None and sections.engine.kind == "hf":
            tokenizer_path = sections.engine.hf.model_path
        elif tokenizer_path is None and sections.engine.kind == "sglang":
            tokenizer_path = sections.engine.sglang.model_path
        tokenizer = load_tokenizer(tokenizer_path)
        if engine is not None:
            runner = LocalGroups(engine, tokenizer, plugins)
            model_info = engine.model_info
        assert runner is not None
        if model_info is not None and (
            ordinary := ordinary_stop_ids(model_info.eos_token_ids, tokenizer)
        ):
            logger.warning(
                "the served model stops at token ids %s, which the tokenizer has as ordinary "
                "text (special ids: %s): responses end there. Set eos_token_id in the model "
                "directory's config.json and generation_config.json to the tokenizer's EOS (%s)",
                ordinary,
                sorted(tokenizer.all_special_ids),
                tokenizer.eos_token_id,
            )
        max_prompt_len = data.max_prompt_len
        if max_prompt_len is None and model_info is not None:
            max_prompt_len = max(model_info.context_len - sampling.max_response_len, 1)
        encoder = PromptEncoder(
            tokenizer,
            apply_chat_template=data.apply_chat_template,
            max_prompt_len=max_prompt_len,
            overlong_prompt=data.overlong_prompt,
        )
        dataset = PromptDataset(load_prompts(data), shuffle=data.shuffle, seed=data.seed)
        return cls(
            runner=runner,
            tokenizer=tokenizer,
            dataset=dataset,
            encoder=encoder,
            sampling=sampling,
            scorer=Scorer(sections.reward if sections.reward else RewardConfig()),
            group_sampling=sections.group_sampling,
            plugins=plugins,
        )

    def state_dict(self) -> dict[str, Any]:
        """Where the prompt stream stands, for resuming; request seeds derive from rollout ids."""
        return {"dataset": self.dataset.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state["dataset"])

    # -- one rollout ---------------------------------------------------------------------------

    async def generate(
        self,
        rollout_id: int,
        prompts: Sequence[tuple[PromptRecord, list[int]]] | None = None,
    ) -> RolloutBatch:
        """Generate, score and filter one rollout batch.

        Args:
            rollout_id: The rollout (request seeds derive from it).
            prompts: The first sampling round's prompts instead of the stream's next ones
                (`prompts_of` a rollout generated again); the stream moves only for more
                rounds the dynamic filter asks for.
        """
        started = time.perf_counter()
        cfg, sampling = self.group_sampling, self.sampling
        need = sampling.rollout_batch_size
        per_round = (cfg.over_sampling_batch_size or need) if cfg.dynamic_filter else need
        truncated0, dropped0 = self.encoder.truncated, self.encoder.dropped
        kept: list[list[Sample]] = []
        filtered: list[list[Sample]] = []
        counts = {"aborted": 0, "zero_std": 0, "groups": 0, "tokens": 0, "prompt_tokens": 0}
        gen_time = 0.0
        rounds = 0
        while len(kept) < need and rounds < cfg.max_rounds:
            wanted = per_round if cfg.dynamic_filter else need - len(kept)
            asked = list(prompts) if prompts and not rounds else self._next_prompts(wanted)
            t0 = time.perf_counter()
            groups = await self._generate_groups(asked, rollout_id, rounds)
            gen_time += time.perf_counter() - t0
            await self.scorer.score_groups(groups)
            for group in groups:
                counts["groups"] += 1
                counts["tokens"] += sum(s.response_length for s in group)
                counts["prompt_tokens"] += sum(s.total_length - s.response_length for s in group)
                if any(s.status == SampleStatus.ABORTED for s in group):
                    counts["aborted"] += 1
                    continue
                signal = _has_signal(group)
                counts["zero_std"] += not signal
                if cfg.dynamic_filter and not signal:
                    filtered.append(group)
                else:
                    kept.append(group)
            rounds += 1
        unused = max(len(kept) - need, 0)
        kept = kept[:need]
        backfilled = 0
        if len(kept) < need:
            short = f"{len(kept)} of {need} groups kept after {rounds} rounds"
            if cfg.on_shortfall == "error":
                raise RuntimeError(
                    f"rollout {rollout_id}: {short} (group_sampling.on_shortfall=error)"
                )
            if cfg.on_shortfall == "backfill":
                backfilled = min(need - len(kept), len(filtered))
                kept += filtered[len(filtered) - backfilled :]
            logger.warning("rollout %d: %s; %d backfilled", rollout_id, short, backfilled)
        samples = []
        for g, group in enumerate(kept):
            for sample in group:
                sample.index, sample.group_index = len(samples), g
                samples.append(sample)
        metrics = self._metrics(samples, counts, filtered, backfilled, unused, rounds)
        metrics["rollout/prompts_truncated"] = float(self.encoder.truncated - truncated0)
        metrics["rollout/prompts_dropped"] = float(self.encoder.dropped - dropped0)
        metrics["perf/rollout_time_s"] = time.perf_counter() - started
        metrics["perf/rollout_tokens_per_s"] = counts["tokens"] / gen_time if gen_time else 0.0
        # The work of every sample generated, filtered ones too (the roofline's generation).
        metrics["perf/rollout_gen_time"] = gen_time
        metrics["perf/rollout_gen_tokens"] = float(counts["tokens"])
        metrics["perf/rollout_prompt_tokens"] = float(counts["prompt_tokens"])
        return RolloutBatch(samples=samples, metrics=metrics)

    def _next_prompts(self, count: int) -> list[tuple[PromptRecord, list[int]]]:
        """`count` encodable prompts; ones dropped for length are replaced by the next ones."""
        out: list[tuple[PromptRecord, list[int]]] = []
        skipped = 0
        while len(out) < count:
            for record in self.dataset.next(count - len(out)):
                ids = self.encoder.encode(record)
                if ids is None:
                    skipped += 1
                else:
                    out.append((record, ids))
            if skipped > 10 * len(self.dataset):
                raise ValueError("every prompt is longer than max_prompt_len; nothing to generate")
        return out

    async def _generate_groups(
        self, prompts: list[tuple[PromptRecord, list[int]]], rollout_id: int, round_id: int
    ) -> list[list[Sample]]:
        groups = self.prompt_groups(prompts, rollout_id, round_id)
        generated = await self.runner.generate_groups(groups)
        if len(generated) != len(groups) or any(
            len(samples) != len(group.requests)
            for samples, group in zip(generated, groups, strict=False)
        ):
            raise EngineError(
                f"rollout {rollout_id} round {round_id}: asked for {len(groups)} groups of "
                f"{self.sampling.n_samples_per_prompt}, got sizes {[len(g) for g in generated]}"
            )
        return generated

    # -- evaluation ----------------------------------------------------------------------------

    async def evaluate(
        self,
        name: str,
        records: Sequence[PromptRecord],
        *,
        rollout_id: int,
        temperature: float,
        samples_per_prompt: int,
    ) -> dict[str, float]:
        """Generate `samples_per_prompt` responses to each of `records` at `temperature`, score
        them with the run's reward, and return the `eval/<name>/*` metrics.

        Metrics: `reward` (mean over samples), `response_length` (mean), `truncated_ratio`,
        `samples` (how many were generated), and with several samples per prompt `pass@<n>`:
        the fraction of prompts with at least one sample whose reward reaches 1.0 (full credit
        of the built-in rewards). Requests get seeds of their own (by set name and rollout),
        apart from the training rollouts'; no dynamic filter, no prompt-stream position moves.

        Raises:
            ValueError: No prompt of the set fits `data.max_prompt_len`.
        """
        prompts = [(r, ids) for r in records if (ids := self.encoder.encode(r)) is not None]
        if not prompts:
            raise ValueError(f"eval set {name!r}: no prompt fits data.max_prompt_len")
        sampling = dataclasses.replace(
            self.sampling, temperature=temperature, n_samples_per_prompt=samples_per_prompt
        )
        groups = self.prompt_groups(
            prompts, rollout_id, 0, sampling=sampling, stream=f"eval {name}"
        )
        generated = await self.runner.generate_groups(groups)
        if [len(g) for g in generated] != [samples_per_prompt] * len(groups):
            raise EngineError(
                f"eval {name!r} at rollout {rollout_id}: asked for {len(groups)} groups of "
                f"{samples_per_prompt}, got sizes {[len(g) for g in generated]}"
            )
        await self.scorer.score_groups(generated)
        samples = [s for group in generated for s in group]
        prefix = f"eval/{name}"
        metrics = {
            f"{prefix}/reward": statistics.fmean(float(s.reward) for s in samples),
            f"{prefix}/response_length": statistics.fmean(s.response_length for s in samples),
            f"{prefix}/truncated_ratio": statistics.fmean(
                float(s.status == SampleStatus.TRUNCATED) for s in samples
            ),
            f"{prefix}/samples": float(len(samples)),
        }
        if samples_per_prompt > 1:
            passed = [any(float(s.reward) >= 1.0 for s in group) for group in generated]
            metrics[f"{prefix}/pass@{samples_per_prompt}"] = statistics.fmean(passed)
        return metrics

    def prompt_groups(
        self,
        prompts: list[tuple[PromptRecord, list[int]]],
        rollout_id: int,
        round_id: int,
        *,
        sampling: SamplingConfig | None = None,
        stream: str = "rollout",
    ) -> list[PromptGroup]:
        """The requests of one sampling round, one group per prompt, each with its own seed.

        Args:
            sampling: Sampling settings instead of the run's (evaluation).
            stream: Names the requests and, unless "rollout", separates their seeds from the
                training rollouts'.
        """
        sampling = sampling or self.sampling
        n = sampling.n_samples_per_prompt
        seed = sampling.seed if stream == "rollout" else f"{sampling.seed}/{stream}"
        fields = self.plugins.rollout_request_fields(self.runner.kind) if self.plugins else {}
        stop = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        groups = []
        for g, (record, ids) in enumerate(prompts):
            requests = [
                GenerateRequest(
                    input_ids=ids,
                    sampling=SamplingParams(
                        max_new_tokens=sampling.max_response_len,
                        temperature=sampling.temperature,
                        top_p=sampling.top_p,
                        top_k=sampling.top_k,
                        stop_token_ids=stop,
                        seed=request_seed(seed, rollout_id, round_id, g, j),
                    ),
                    fields=dict(fields),
                    name=f"{stream} {rollout_id} round {round_id} sample {g * n + j} (group {g})",
                )
                for j in range(n)
            ]
            groups.append(PromptGroup(record=record, prompt_ids=ids, requests=requests, index=g))
        return groups

    @staticmethod
    def _metrics(
        samples: list[Sample],
        counts: dict[str, int],
        filtered: list[list[Sample]],
        backfilled: int,
        unused: int,
        rounds: int,
    ) -> dict[str, float]:
        lengths = [s.response_length for s in samples] or [0]
        rewards = [float(s.reward) for s in samples if s.reward is not None] or [0.0]
        total = max(len(samples), 1)
        return {
            "rollout/rewards": statistics.fmean(rewards),
            "rollout/rewards_std": statistics.pstdev(rewards),
            "rollout/response_len_mean": statistics.fmean(lengths),
            "rollout/prompt_len_mean": statistics.fmean(
                [s.total_length - s.response_length for s in samples] or [0]
            ),
            "rollout/response_len_max": float(max(lengths)),
            "rollout/response_len_min": float(min(lengths)),
            "rollout/loss_tokens_mean": statistics.fmean(
                [sum(s.effective_loss_mask()) for s in samples] or [0]
            ),
            "rollout/truncated_ratio": sum(s.status == SampleStatus.TRUNCATED for s in samples)
            / total,
            "rollout/zero_std_ratio": counts["zero_std"] / max(counts["groups"], 1),
            "rollout/dropped_groups": float(len(filtered) - backfilled),
            "rollout/aborted_groups": float(counts["aborted"]),
            "rollout/backfilled_groups": float(backfilled),
            "rollout/unused_groups": float(unused),
            "rollout/sampling_rounds": float(rounds),
            "rollout/num_samples": float(len(samples)),
            "rollout/reward_timeouts": float(
                sum(bool(s.metadata.get("reward_timeout")) for s in samples)
            ),
        }
