"""TRL's side of the peer benches: the process that drives `trl.GRPOTrainer` on the work an
Ember run config describes (its prompts as TRL's dataset, Ember's reward as TRL's reward
function), from the spec `bench_peer.py` writes."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

STAND_IN_PROMPT = [0]
"""The prompt ids of a sample whose prompt the reward call did not get (Ember's samples hold a
prompt; the built-in rewards read the response, its label and whether it stopped)."""


def make_ember_reward(
    reward: Any,
    stop_ids: Collection[int],
    *,
    group_size: int = 1,
    encode: Any = None,
    sink: list[float] | None = None,
    lengths: list[float] | None = None,
):
    """TRL's reward function for Ember's reward `reward` (a RewardConfig): each completion
    becomes an Ember sample (its text, label and metadata; completed when it ends with one of
    `stop_ids`, else truncated; `encode` turns its prompt into the prompt ids) and Ember's own
    scorer scores them, whole groups of `group_size` at once for a group reward (TRL passes a
    prompt's completions one after the other). Appends each call's mean (one call per rollout)
    to `sink`, and its completions' mean length in tokens to `lengths`."""
    from ember_core.types import Sample, SampleStatus
    from ember_rollout.rewards import Scorer

    scorer = Scorer(reward)

    def ember_reward(completions, completion_ids, prompts=None, label=None, metadata=None, **_):
        samples = []
        for i, (completion, ids) in enumerate(zip(completions, completion_ids, strict=True)):
            prompt = prompts[i] if prompts is not None else ""
            prompt_ids = list(encode(prompt)) if encode and prompts is not None else STAND_IN_PROMPT
            stopped = bool(ids) and ids[-1] in stop_ids
            text = completion[-1]["content"] if isinstance(completion, list) else completion
            samples.append(
                Sample(
                    tokens=[*prompt_ids, *ids],
                    response_length=len(ids),
                    index=i,
                    group_index=i // group_size,
                    prompt=prompt,
                    response=text,
                    label=None if label is None else label[i],
                    metadata=dict(metadata[i] or {}) if metadata is not None else {},
                    status=SampleStatus.COMPLETED if stopped else SampleStatus.TRUNCATED,
                )
            )
        groups = [samples[i : i + group_size] for i in range(0, len(samples), group_size)]
        asyncio.run(scorer.score_groups(groups))
        scores = [float(s.reward) for s in samples]
        if sink is not None:
            sink.append(statistics.fmean(scores))
        if lengths is not None:
            lengths.append(statistics.fmean(len(ids) for ids in completion_ids))
        return scores

    return ember_reward


def make_toy_reward(
    eos_token_id: int, sink: list[float] | None = None, lengths: list[float] | None = None
):
    """TRL's reward function for the toy task: Ember's `toy` reward, a completion counting as
    stopped when it ends with EOS."""
    from ember_rollout.config import RewardConfig

    return make_ember_reward(
        RewardConfig(reward_fn="toy"), {eos_token_id}, sink=sink, lengths=lengths
    )


def trl_rows(records: Sequence[Any], *, chat: bool) -> list[dict[str, Any]]:
    """TRL's dataset rows for Ember's prompt records: `prompt` (chat messages as they are, the
    conversational format; with `chat`, a text prompt becomes one user message, as Ember's
    encoder makes it), `label`, and `metadata` when a record has some."""
    rows = []
    for record in records:
        prompt = record.prompt
        if chat and isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        row = {"prompt": prompt, "label": record.label}
        if record.metadata:
            row["metadata"] = record.metadata
        rows.append(row)
    return rows


def check_prompt_ids(rows: Sequence[dict[str, Any]], records: Sequence[Any], tokenizer: Any,
                     ember_encoder: Any) -> int:  # fmt: skip
    """Check that TRL turns each row's prompt into the token ids Ember's encoder makes of the
    record (TRL: the chat template with the generation prompt for messages, the tokenizer for
    text). Returns how many were checked.

    Raises:
        ValueError: The first prompt whose ids differ, with both.
    """
    for row, record in zip(rows, records, strict=True):
        if isinstance(row["prompt"], list):
            trl_ids = tokenizer.apply_chat_template(
                conversation=[row["prompt"]], add_generation_prompt=True, tokenize=True,
                return_dict=True,
            )["input_ids"][0]  # fmt: skip
        else:
            trl_ids = tokenizer(text=[row["prompt"]])["input_ids"][0]
        ember_ids = ember_encoder.encode(record)
        if list(trl_ids) != list(ember_ids):
            raise ValueError(
                f"{record.source}: TRL's prompt ids {list(trl_ids)} differ from Ember's "
                f"{list(ember_ids)}"
            )
    return len(rows)


def trl_worker(spec_path: str) -> None:
    """Train with TRL as the spec says (`bench_peer.run_trl` writes it), writing one Ember-shaped
    rollout record per rollout to the spec's `dir`/metrics.jsonl."""
    spec = json.loads(Path(spec_path).read_text())
    if spec["threads"]:
        import torch

        torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from ember.config import load_config
    from ember_rollout.data import PromptEncoder, PromptRecord, load_prompts
    from ember_rollout.tokenizer import load_tokenizer

    config, _ = load_config(spec["config"], overrides=spec["sets"])
    steps = spec["steps_per_rollout"]
    metrics = (Path(spec["dir"]) / "metrics.jsonl").open("w")
    rewards: list[float] = []
    lengths: list[float] = []  # mean completion tokens per rollout, as Ember logs them

    class RolloutClock(TrainerCallback):
        """One Ember-shaped record at the end of each rollout's last optimizer step."""

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % steps == 0:
                rid = state.global_step // steps - 1
                record = {
                    "kind": "rollout",
                    "rollout_id": rid,
                    "step": rid,
                    "time": time.time(),
                    "rollout/rewards": rewards[rid],
                    "rollout/response_len_mean": lengths[rid],
                }
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()

    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer"], padding_side="left")
    args = GRPOConfig(**spec["grpo"])
    expected = spec["grpo"]["per_device_train_batch_size"] * spec["grpo"]["steps_per_generation"]
    assert args.generation_batch_size == expected, (args.generation_batch_size, expected)
    records = load_prompts(config.data)
    encoder = PromptEncoder(load_tokenizer(spec["tokenizer"]),
                            apply_chat_template=config.data.apply_chat_template)  # fmt: skip
    rows = trl_rows(records, chat=encoder.use_template)
    checked = check_prompt_ids(rows[:64], records[:64], tokenizer, encoder)
    print(f"{len(rows)} prompts; the first {checked} encode to Ember's ids", flush=True)
    stop_ids: set[int] = set()  # the trainer's own, once it is built
    reward = make_ember_reward(
        config.reward,
        stop_ids,
        group_size=args.num_generations,
        encode=lambda prompt: encoder.encode(PromptRecord(prompt)),
        sink=rewards,
        lengths=lengths,
    )
    reward.__name__ = config.reward.reward_fn.replace(":", ".")  # TRL logs it by name
    trainer = GRPOTrainer(
        model=spec["model"],
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[RolloutClock()],
    )
    stop_ids.update(trainer.eos_token_ids)
    trainer.train()
    metrics.close()
