"""The hooks an Ember plugin can implement, grouped by the stage of a run that calls them.

A plugin is a module (found through the `ember` entry-point group) whose functions are marked
with `ember_core.hookimpl` and named like the specs below. Every hook is called through the
typed facade in `ember_core.plugins`, never through `pm.hook` directly. A hookimpl may declare
any subset of a spec's arguments.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import pluggy

from ember_core.types import Sample

if TYPE_CHECKING:
    import torch

    from ember_core.plugins import EmberPlugins

NAME = "ember"
"""The plugin system's name: PluginManager project name, hook markers, entry-point group."""

hookspec = pluggy.HookspecMarker(NAME)
hookimpl = pluggy.HookimplMarker(NAME)


class Role(enum.StrEnum):
    """Which model a forward pass runs."""

    ACTOR = "actor"
    REF = "ref"
    CRITIC = "critic"


class Phase(enum.StrEnum):
    """Why a forward pass runs."""

    LOG_PROB = "log_prob"
    """Forward-only scoring of a rollout batch (old/ref log-probs, old values)."""
    TRAIN = "train"
    """The forward of a training step, whose graph backward will use."""
    BACKWARD = "backward"
    """The backward of a training step, including any activation recompute it triggers."""
    REPLAY_CHECK = "replay_check"
    """A check-only forward of the reference that routes every MoE layer as the rollout engine
    did (CI mode, rollout 0, on request of `ember_replayed_reference_forward`). Its log-probs
    feed no loss; they are compared with the actor's old log-probs."""


@dataclass(frozen=True, slots=True)
class ConfigSection:
    """A plugin's own config section: top-level key `name`, parsed into dataclass `cls`."""

    name: str
    cls: type


class ExemptionScope(enum.StrEnum):
    """What kind of actor/reference difference a `KLExemption` excuses."""

    ROUTING = "routing"
    """Only which experts the MoE layers pick: a reference forward that replays the rollout's
    routing must agree with the actor exactly again."""
    ANY = "any"
    """Any difference: no extra forward can restore an exact comparison."""


@dataclass(frozen=True, slots=True)
class KLExemption:
    """A plugin's statement that the initial actor/reference KL is not expected to be zero."""

    plugin: str
    reason: str
    scope: ExemptionScope = ExemptionScope.ANY
    """What the exemption excuses; ROUTING lets a checker compare a routing-replayed reference
    forward with the actor instead of standing down."""


@dataclass(frozen=True, slots=True)
class GenerateSettings:
    """How `ember_generate` samples one prompt group: the run's rollout settings (or an
    evaluation's temperature and samples per prompt)."""

    n: int
    """Samples to return: the group's size (`rollout.n_samples_per_prompt`, or
    `run.eval_samples_per_prompt` in an evaluation)."""
    max_new_tokens: int
    """`rollout.max_response_len`: the most response tokens one sample may hold, the ones the
    plugin inserts (tool output) included."""
    temperature: float
    """Sampling temperature; the engine's log-probs are taken after dividing by it."""
    top_p: float
    """Nucleus sampling threshold (1.0: off)."""
    top_k: int
    """Top-k filter (-1: off)."""
    stop_token_ids: tuple[int, ...]
    """Tokens that end a response (the tokenizer's EOS): what the built-in generation stops at."""


class Completion(Protocol):
    """One engine answer, as `EngineClient.generate` returns it."""

    output_ids: list[int]
    """Generated token ids (a stop token that ended generation included)."""
    output_log_probs: list[float]
    """Log-prob of each generated token, log softmax(logits / temperature) over the whole
    vocabulary: before any top-k/top-p filter, on every engine."""
    finish_reason: str
    """"stop" (a stop token), "length" (max_new_tokens reached) or "abort"."""
    routed_experts: torch.Tensor | None
    """When asked for: integer [len(input_ids) + len(output_ids) - 1, num_layers, topk], the
    experts of every position the engine forwarded (the input's from the prefill)."""
    meta_info: dict[str, Any]
    """The engine's raw metadata (SGLang's `meta_info` layout, `weight_version` included)."""


class EngineClient(Protocol):
    """What an `ember_generate` plugin generates through: token ids in, tokens out.

    Calls made concurrently (by the coroutines of every group an engine generates) go to the
    engine together, as one batch.
    """

    @property
    def kind(self) -> str:
        """The engine kind ("hf", "sglang")."""
        ...

    @property
    def tokenizer(self) -> Any:
        """The run's tokenizer (a transformers tokenizer), to encode inserted text."""
        ...

    async def generate(
        self,
        input_ids: Sequence[int],
        *,
        sample: int,
        max_new_tokens: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        routed_experts: bool | None = None,
    ) -> Completion:
        """Continue `input_ids` (the whole context so far) with one sampled response.

        Args:
            input_ids: Prompt and everything after it so far, as token ids.
            sample: Which sample of the group (0 .. n - 1) the call is for. It picks the
                sampler's seed: the k-th call of sample j gets its own seed, fixed by the run
                seed and the request's position, so the samples of a group differ and a rerun
                repeats them.
            max_new_tokens: Most tokens to generate; None: `GenerateSettings.max_new_tokens`.
            stop_token_ids: Tokens that end this call, besides the model's EOS; None: the
                group's `stop_token_ids`.
            routed_experts: Return routed experts; None: when the run asks for them.

        Raises:
            ValueError: `sample` outside the group, or an empty `input_ids`.
        """
        ...


# --------------------------------------------------------------------------------------------
# Setup
# --------------------------------------------------------------------------------------------


@hookspec
def ember_config_section() -> ConfigSection | None:
    """Declare the plugin's config section.

    Returns:
        The section name (conventionally the plugin's name) and the dataclass it parses into.
        Its fields become settable as `name.field` in run configs and with `--set`.
    """


@hookspec
def ember_configure(config: Any, sections: dict[str, Any], plugins: EmberPlugins) -> None:
    """Receive the resolved run config once, before any model or engine is built.

    Args:
        config: The whole run config (read-only by convention).
        sections: Every enabled plugin's parsed and validated section, by section name; a plugin
            reads its own (`sections["r3_routing"]`).
        plugins: The run's plugin facade, for a plugin that acts on what other plugins report
            (the KL checker asks `plugins.kl_check_exemptions()`). Call its query methods only,
            and not before every plugin is configured (that is, not inside this hook).
    """


@hookspec
def ember_model_config(role: Role, model_config: Any) -> None:
    """Adjust a backend's model config before the model for `role` is built.

    Args:
        role: The model being built.
        model_config: The backend's config object (for the Megatron backend, the
            `TransformerConfig`), to be modified in place.
    """


# --------------------------------------------------------------------------------------------
# Rollout
# --------------------------------------------------------------------------------------------


@hookspec
def ember_rollout_request_fields(engine: str) -> dict[str, Any] | None:
    """Extra top-level fields for every generate request.

    Args:
        engine: The engine kind ("hf", "sglang", ...).

    Returns:
        Fields to merge into the request (for SGLang, the /generate JSON body). Two plugins
        setting one field to different values is an error.
    """


@hookspec
def ember_rollout_server_args(engine: str) -> list[str] | None:
    """Extra command-line arguments for inference servers that the engine launches.

    Returns:
        Arguments appended to the server command line, e.g. ["--some-flag"].
    """


@hookspec
def ember_process_sample(sample: Any, meta_info: dict[str, Any], engine: str) -> None:
    """Process one finished sample together with the engine's raw response metadata.

    Called for every sample, in order, after the engine's own parsing. Implementations decode
    what they asked for (for example routed experts) into the sample and raise ValueError naming
    the sample when the engine's data is malformed.

    Args:
        sample: The `ember_core.types.Sample`, modified in place.
        meta_info: The engine's metadata for this sample (SGLang's `meta_info` layout).
        engine: The engine kind.
    """


@hookspec(firstresult=True)
def ember_generate(
    client: EngineClient,
    record: Any,
    prompt_ids: list[int],
    sampling: GenerateSettings,
    routed_experts: bool,
) -> list[Sample] | Awaitable[list[Sample] | None] | None:
    """Generate one prompt group in place of the built-in single-turn generation.

    Runs in the rollout engine's process, once per prompt group, for training rollouts and
    evaluations alike; the first plugin that answers owns the group. A multi-turn plugin calls
    `client.generate`, inserts the tokens the model did not generate (tool output,
    environment text), and generates again from the longer context: the produced tokens as
    they are plus the appended ones, never the conversation encoded again from its decoded text
    (`ember_rollout.turns` appends messages with the chat template's glue). Every returned
    sample is checked (errors name the sample and the field), numbered, given the record's
    prompt and label, and handed to `ember_process_sample` with the metadata of its last
    engine call; rewards, advantages, packing, losses and metrics then treat it like any other.

    Args:
        client: Generates through the run's engine (`EngineClient`).
        record: The prompt record (`prompt`, `label`, `metadata`, `source`).
        prompt_ids: The encoded prompt.
        sampling: The group's size and sampling settings.
        routed_experts: Whether the run needs routed experts (routing replay is on).

    Returns:
        `sampling.n` samples (`ember_core.types.Sample`), or an awaitable of them: write the hook
        as `async def`. Each sample has `tokens` = `prompt_ids` + response and
        `response_length`; `loss_mask`, one 0/1 per response token, 0 on every token the model
        did not generate (None: all generated); `rollout_log_probs`, one per response token,
        the engine's on generated tokens (anything, NaN included, where the mask is 0);
        `status`; `response`, the text the reward reads (empty: the decoded response); and,
        when `routed_experts`, `rollout_routed_experts` for all len(tokens) - 1 positions (the
        final call's, whose prefill covers every earlier token, does). None (from a plain
        `def`, or an awaitable's None) leaves the group to the built-in generation.
    """


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


@hookspec
def ember_forward_context(
    role: Role, phase: Phase, batch: Any
) -> AbstractContextManager[None] | None:
    """Wrap one model forward (or backward) pass.

    The facade enters every returned context manager, in registration order, around the pass.

    Args:
        role: The model running.
        phase: Log-prob scoring, training forward, or training backward (with recompute).
        batch: The micro-batch being processed (backend-specific; carries its samples).

    Returns:
        A context manager to hold during the pass, or None.
    """


@hookspec
def ember_kl_check_exemptions() -> KLExemption | None:
    """Say why the initial actor/reference KL is not expected to be exactly zero.

    Returns:
        An exemption naming the plugin, the reason and its scope (`ExemptionScope`), or None
        when this plugin does not change the actor's forward relative to the reference's.
    """


@hookspec
def ember_replayed_reference_forward(rollout_id: int) -> bool | None:
    """Ask the backend for one extra, check-only forward of the reference at this rollout.

    When any plugin answers True, the backend scores the rollout a second time with the
    reference under `Phase.REPLAY_CHECK` (a routing-replay plugin makes its routers pick the
    rollout's experts there), keeps the reference's normal forward for every loss, and logs
    `rollout/ref_replayed_log_probs_max_abs_diff`: the largest |old actor - replayed reference|
    log-prob over the counted response tokens of all ranks.

    Args:
        rollout_id: The rollout about to be scored.

    Returns:
        True to ask for the forward; False or None otherwise.
    """


@hookspec
def ember_rebuilt_reference_forward(rollout_id: int) -> bool | None:
    """Ask the backend to check the reference it holds against the one its config describes.

    When any plugin answers True, the backend builds a second reference from its source (the
    config's `train.ref_load`, or the actor's initial weights: `train.hf_load` or the seeded
    initialisation), scores the rollout with it once, check-only, drops it, and logs
    `rollout/ref_rebuilt_log_probs_max_abs_diff`: the largest |reference - rebuilt reference|
    log-prob over the counted response tokens of all ranks. After a resume the reference comes
    from the checkpoint; this compares it with what the run started from.

    Args:
        rollout_id: The rollout about to be scored.

    Returns:
        True to ask for the forward; False or None otherwise.
    """


@hookspec
def ember_audit_rollout(rollout_id: int) -> bool | None:
    """Ask for an audit iteration: this rollout is generated and scored so that the trainer's
    log-probs can be compared exactly with the engine's.

    When any plugin answers True, the driver lets no rollout generate ahead into it or past
    it (with `rollout.max_staleness` >= 1, it is generated after the previous iteration's
    weights reach the engines, so engine and trainer hold the same weights), and the backend
    scores it with the actor's own forward even under `algorithm.use_rollout_log_probs` and
    logs `rollout/audit` = 1 with the metrics that compare those log-probs with the engine's;
    the loss keeps the configured old policy, so an audit trains as any rollout does.
    Both the driver's process and every training rank ask, so the answer must depend on the
    rollout id and the run config only.

    Args:
        rollout_id: The rollout.

    Returns:
        True to audit this rollout; False or None otherwise.
    """


# --------------------------------------------------------------------------------------------
# Logging
# --------------------------------------------------------------------------------------------


@hookspec
def ember_after_train_step(
    rollout_id: int, step_id: int, accumulated_step_id: int, metrics: dict[str, float]
) -> None:
    """Observe one optimizer step's reduced metrics.

    Args:
        rollout_id: The rollout whose data was trained on.
        step_id: The step within this rollout, from 0.
        accumulated_step_id: The step within the whole run, from 0 (survives resume).
        metrics: Flat `train/*` metrics, already reduced across data-parallel ranks.
    """


@hookspec
def ember_after_log_rollout_data(rollout_id: int, metrics: dict[str, float]) -> None:
    """Observe a rollout batch's reduced metrics before training on it.

    Args:
        rollout_id: The rollout.
        metrics: Flat `rollout/*` metrics, already reduced across data-parallel ranks.
    """
