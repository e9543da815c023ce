"""The truncation_mask example plugin through the plugin facade, run configs and real rollouts."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from ember.cli import main
from ember.config import load_config
from ember_core.algorithms import policy_loss, reduce_loss
from ember_core.config import CoreConfig, SamplingConfig
from ember_core.plugins import EmberPlugins, installed_plugins
from ember_core.types import Sample, SampleStatus, pack_samples
from ember_rollout import RolloutGenerator, build_engine
from ember_truncation_mask import SECTION, TruncationMaskConfig
from ember_truncation_mask import plugin as mask_plugin


@pytest.fixture
def reset_plugin():
    """Forget the configured limit after the test."""
    yield
    mask_plugin._longest_kept = None


@pytest.fixture
def host(reset_plugin):
    """A facade with the plugin registered explicitly; `configure(...)` sets its section."""
    plugins = EmberPlugins()
    plugins.register(mask_plugin, SECTION)

    def configure(max_response_len: int = 8, buffer: int = 0) -> None:
        config = CoreConfig(
            plugins=[SECTION], rollout=SamplingConfig(max_response_len=max_response_len)
        )
        plugins.configure(config, {SECTION: TruncationMaskConfig(buffer=buffer)})

    plugins.configure_mask = configure  # type: ignore[attr-defined]
    try:
        yield plugins
    finally:
        plugins.unregister(SECTION)


def sample(length: int, status: SampleStatus, index: int = 0) -> Sample:
    return Sample(
        tokens=list(range(3 + length)), response_length=length, index=index, status=status
    )


def test_truncated_responses_lose_every_loss_token(host):
    host.configure_mask(max_response_len=8)
    cut = sample(8, SampleStatus.TRUNCATED)
    finished = sample(8, SampleStatus.COMPLETED)
    short = sample(3, SampleStatus.COMPLETED)
    for s in (cut, finished, short):
        host.process_sample(s, {"finish_reason": {"type": str(s.status)}}, "hf")
    assert cut.loss_mask == [0] * 8 and cut.metadata == {SECTION: "truncated"}
    # A response that ends with its stop token exactly at the limit is a real answer.
    assert finished.loss_mask is None and finished.metadata == {}
    assert short.loss_mask is None and short.effective_loss_mask() == [1, 1, 1]
    cut.validate()


def test_buffer_also_masks_finished_responses_near_the_limit(host):
    host.configure_mask(max_response_len=8, buffer=2)
    by_length = {n: sample(n, SampleStatus.COMPLETED) for n in (5, 6, 7, 8)}
    for s in by_length.values():
        host.process_sample(s, {}, "sglang")
    assert {n: s.loss_mask for n, s in by_length.items()} == {
        5: None,
        6: None,
        7: [0] * 7,
        8: [0] * 8,
    }
    assert by_length[7].metadata[SECTION] == "buffer"
    # Aborted and failed samples are dropped by the rollout, never trained on: left alone.
    aborted = sample(7, SampleStatus.ABORTED)
    host.process_sample(aborted, {}, "sglang")
    assert aborted.loss_mask is None


def test_a_masked_sample_gets_no_gradient(host):
    host.configure_mask(max_response_len=4)
    samples = [sample(4, SampleStatus.TRUNCATED, 0), sample(3, SampleStatus.COMPLETED, 1)]
    for s in samples:
        host.process_sample(s, {}, "hf")
    packed = pack_samples(samples)
    mask_T = torch.cat(packed.loss_masks)
    log_probs = torch.tensor([-1.0, -2.0, -0.5, -0.7, -1.2, -0.3, -0.9], requires_grad=True)
    advantages = torch.tensor([1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0])
    loss_T, _ = policy_loss(log_probs, log_probs.detach(), advantages, eps_clip=0.2)
    for mode in ("sample", "token"):
        log_probs.grad = None
        reduce_loss(loss_T, mask_T, packed.response_lengths, mode).backward(retain_graph=True)
        assert torch.equal(log_probs.grad[:4], torch.zeros(4))
        assert (log_probs.grad[4:] != 0).all()


def test_section_parses_and_validates(host):
    assert host.config_sections() == {SECTION: TruncationMaskConfig}
    with pytest.raises(ValueError, match=r"buffer=-1: expected an integer >= 0"):
        TruncationMaskConfig(buffer=-1)
    with pytest.raises(
        ValueError,
        match=r"truncation_mask\.buffer=8: expected < rollout\.max_response_len=8 "
        r"\(otherwise every response is masked\)",
    ):
        host.configure_mask(max_response_len=8, buffer=8)


def test_process_sample_before_configure_is_an_error(host):
    with pytest.raises(RuntimeError, match="before ember_configure"):
        host.process_sample(sample(2, SampleStatus.TRUNCATED), {}, "hf")


# --------------------------------------------------------------------------------------------
# Installed and enabled like any plugin: entry point, run config, `--set`, `ember plugins`
# --------------------------------------------------------------------------------------------


def test_installed_but_not_enabled_changes_nothing(reset_plugin):
    found = installed_plugins()[SECTION]
    assert (found.distribution, found.value) == (
        "ember-truncation-mask",
        "ember_truncation_mask.plugin",
    )
    config, plugins = load_config({"truncation_mask": {"buffer": 2}})
    assert SECTION not in plugins.enabled and config.plugin_sections == {}
    assert mask_plugin._longest_kept is None  # never configured
    truncated = sample(4, SampleStatus.TRUNCATED)
    plugins.process_sample(truncated, {}, "hf")
    assert truncated.loss_mask is None


def test_enabled_by_name_with_its_section_from_the_run_config(reset_plugin, capsys):
    config, plugins = load_config(
        {"rollout": {"max_response_len": 16}, "truncation_mask": {"buffer": 4}},
        plugins=[SECTION],
        overrides=["truncation_mask.buffer=3"],
    )
    assert plugins.enabled == [SECTION]
    assert config.plugin_sections[SECTION] == TruncationMaskConfig(buffer=3)
    assert config.to_dict()[SECTION] == {"buffer": 3}
    assert mask_plugin._longest_kept == 13
    assert main(["plugins", "--plugins", SECTION]) == 0
    listed = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()}
    assert listed[SECTION][1:3] == ["enabled", "ember-truncation-mask"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["truncation_mask.buffer=-2"], "truncation_mask.buffer=-2: expected an integer >= 0"),
        (
            ["truncation_mask.buffr=2"],
            "truncation_mask.buffr: unknown key; known keys here: buffer",
        ),
        (
            ["truncation_mask.buffer=8", "rollout.max_response_len=8"],
            "truncation_mask.buffer=8: expected < rollout.max_response_len=8",
        ),
    ],
)
def test_bad_section_values_name_the_key(reset_plugin, overrides, message, capsys):
    assert main(["train", "--plugins", SECTION, *(a for o in overrides for a in ("--set", o))]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


# --------------------------------------------------------------------------------------------
# A real rollout on the embedded engine (tiny random model, toy task)
# --------------------------------------------------------------------------------------------

RUN_CONFIG = """\
rollout:
  rollout_batch_size: 3
  n_samples_per_prompt: 4
  max_response_len: 3     # the toy answers need up to 5 tokens: most responses are cut off
  seed: 5
engine:
  hf:
    dtype: float32
    num_threads: 1
    tiny: {num_layers: 2, hidden_size: 32, num_experts: 4}
data:
  toy: {num_prompts: 64, seed: 2}
"""


def rollout(config_path, plugins: list[str]) -> list[Sample]:
    config, host = load_config(config_path, plugins=plugins)

    async def generate() -> list[Sample]:
        async with build_engine(config.engine, plugins=host) as engine:
            generator = RolloutGenerator.from_config(
                engine=engine, sampling=config.rollout, sections=config, plugins=host
            )
            return (await generator.generate(rollout_id=0)).samples

    return asyncio.run(generate())


def test_rollouts_carry_the_mask_to_training(tmp_path, reset_plugin, caplog):
    path = tmp_path / "run.yaml"
    path.write_text(RUN_CONFIG)
    caplog.set_level(logging.INFO, logger="ember_truncation_mask.plugin")
    masked = rollout(path, [SECTION])
    assert caplog.messages == ["truncation_mask: responses cut off by the engine train on no token"]
    plain = rollout(path, [])
    # The same seeds sample the same tokens: the plugin changes masks, nothing else.
    assert [s.tokens for s in masked] == [s.tokens for s in plain]
    assert [s.reward for s in masked] == [s.reward for s in plain]
    statuses = {s.status for s in masked}
    assert statuses == {SampleStatus.TRUNCATED, SampleStatus.COMPLETED}
    for s in masked:
        cut = s.status == SampleStatus.TRUNCATED
        assert s.effective_loss_mask() == [0 if cut else 1] * s.response_length
        assert s.metadata.get(SECTION) == ("truncated" if cut else None)
    assert all(s.loss_mask is None for s in plain)
