"""The r3_routing hooks through the plugin facade, registered explicitly and via entry points."""

from __future__ import annotations

import base64
import logging
import sys

import pytest
import torch
from r3_samples import make_sample, random_experts, small_shape

from ember_core.config import AlgorithmConfig, CIConfig, CoreConfig
from ember_core.hookspecs import Phase, Role
from ember_core.plugins import EmberPlugins, installed_plugins
from ember_core.types import Sample, SampleStatus
from ember_r3_routing import R3RoutingConfig
from ember_r3_routing import plugin as r3_plugin


def sglang_meta(experts: torch.Tensor) -> dict:
    """meta_info as SGLang returns it: base64 of the int32 bytes (little-endian)."""
    raw = experts.to(torch.int32).contiguous().numpy().astype("<i4").tobytes()
    return {"routed_experts": base64.b64encode(raw).decode(), "finish_reason": {"type": "stop"}}


def test_engines_are_asked_for_routed_experts(host):
    assert host.rollout_request_fields("sglang") == {"return_routed_experts": True}
    assert host.rollout_request_fields("hf") == {"return_routed_experts": True}
    assert host.rollout_server_args("sglang") == ["--enable-return-routed-experts"]
    assert host.rollout_server_args("hf") == []


def test_process_sample_decodes_sglang_meta_info_into_uint8(host, shape):
    experts = random_experts(9, shape, torch.Generator().manual_seed(0))
    sample = Sample(tokens=list(range(10)), response_length=4, index=2, group_index=1)
    host.process_sample(sample, sglang_meta(experts), "sglang")
    stored = sample.rollout_routed_experts
    assert stored.dtype == torch.uint8 and stored.shape == (9, 3, 2)
    assert torch.equal(stored.to(torch.int32), experts)
    sample.validate()


def test_process_sample_narrows_experts_the_engine_already_decoded(host, shape):
    experts = random_experts(5, shape, torch.Generator().manual_seed(1))
    sample = Sample(tokens=list(range(6)), response_length=2, rollout_routed_experts=experts)
    host.process_sample(sample, {"routed_experts": "ignored when decoded"}, "hf")
    assert sample.rollout_routed_experts.dtype == torch.uint8
    assert torch.equal(sample.rollout_routed_experts.to(torch.int32), experts)


def test_missing_experts_name_the_sample_and_the_expected_shape(host):
    sample = Sample(tokens=list(range(6)), response_length=2, index=7, group_index=3)
    with pytest.raises(
        ValueError,
        match=r"sample 7 \(group 3\): no routed experts from the engine, expected "
        r"\[len\(tokens\) - 1, num_layers, topk\] = \[5, 3, 2\].*--enable-return-routed-experts",
    ):
        host.process_sample(sample, {"finish_reason": {"type": "stop"}}, "sglang")


def test_aborted_samples_without_experts_are_left_alone(host, shape):
    aborted = Sample(tokens=list(range(6)), response_length=2, index=3, status=SampleStatus.ABORTED)
    host.process_sample(aborted, {"finish_reason": {"type": "abort"}}, "sglang")
    assert aborted.rollout_routed_experts is None
    partial = random_experts(4, shape, torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match=r"sample 3 \(group 0\): routed experts hold 24 int32"):
        host.process_sample(aborted, sglang_meta(partial), "sglang")


def test_payload_one_position_short_is_rejected(host, shape):
    # An engine that forgot the "last token is never forwarded" rule would send len(tokens) rows;
    # one that dropped the prompt's first row sends one fewer. Both are errors.
    sample = Sample(tokens=list(range(6)), response_length=2, index=1)
    short = random_experts(4, shape, torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match=r"sample 1 \(group 0\): routed experts hold 24 int32"):
        host.process_sample(sample, sglang_meta(short), "sglang")


def test_exemption_says_why_actor_and_reference_differ(host):
    [exemption] = host.kl_check_exemptions()
    assert exemption.plugin == "r3_routing"
    assert "replays the rollout engine's expert choices" in exemption.reason
    assert "reference routes with its own router" in exemption.reason


def test_reference_and_critic_passes_are_left_alone(host):
    for role in (Role.REF, Role.CRITIC):
        for phase in Phase:
            if role == Role.REF and phase == Phase.REPLAY_CHECK:
                continue  # the check-only forward replays (test_r3_replay)
            assert r3_plugin.ember_forward_context(role=role, phase=phase, batch=None) is None
            # A replaying context would read batch.model and fail on a bare object.
            with host.forward_context(role, phase, batch=object()):
                pass
    # The reference's check-only forward does replay: it reads the batch.
    assert r3_plugin.ember_forward_context(Role.REF, Phase.REPLAY_CHECK, None) is not None
    with pytest.raises(AttributeError, match="model"):
        with host.forward_context(Role.REF, Phase.REPLAY_CHECK, batch=object()):
            pass


def test_configure_requires_the_model_shape(reset_plugin):
    plugins = EmberPlugins()
    plugins.register(r3_plugin, "r3_routing")
    try:
        assert plugins.config_sections() == {"r3_routing": R3RoutingConfig}
        with pytest.raises(ValueError, match=r"r3_routing.num_layers, r3_routing.num_experts, "):
            plugins.configure(CoreConfig(), {})
        with pytest.raises(RuntimeError, match="before ember_configure"):
            plugins.process_sample(make_sample(4, small_shape(), seed=0), {}, "hf")
    finally:
        plugins.unregister("r3_routing")


def test_configure_takes_unset_shape_fields_from_the_training_model(reset_plugin):
    class Model:
        num_layers, num_experts, moe_router_topk = 6, 16, 4

    class Train:
        def model_config(self):
            return Model()

    class Run:
        train = Train()

    plugins = EmberPlugins()
    plugins.register(r3_plugin, "r3_routing")
    try:
        plugins.configure(Run(), {"r3_routing": R3RoutingConfig(dense_layers=[0])})
        configured = r3_plugin._current()
        assert (configured.num_layers, configured.num_experts, configured.topk) == (6, 16, 4)
        assert configured.moe_layers == [1, 2, 3, 4, 5]
        plugins.configure(Run(), {"r3_routing": R3RoutingConfig(topk=2)})
        assert r3_plugin._current().topk == 2  # an explicit field wins
    finally:
        plugins.unregister("r3_routing")


def test_installed_entry_point_loads_the_plugin(shape, reset_plugin):
    assert installed_plugins()["r3_routing"].distribution == "ember-r3-routing"
    plugins = EmberPlugins.load(["r3_routing"])
    try:
        plugins.configure(CoreConfig(plugins=["r3_routing"]), {"r3_routing": shape})
        assert plugins.rollout_server_args("sglang") == ["--enable-return-routed-experts"]
        assert [e.plugin for e in plugins.kl_check_exemptions()] == ["r3_routing"]
    finally:
        plugins.unregister("r3_routing")


def test_kl_checker_stands_down_for_r3_with_one_line(shape, reset_plugin, caplog):
    if "ci_kl_checker" not in installed_plugins():
        pytest.skip("ember-ci-kl-checker is not installed")
    caplog.set_level(logging.INFO, logger="ember_ci_kl_checker")
    plugins = EmberPlugins.load(["r3_routing", "ci_kl_checker"])
    try:
        config = CoreConfig(
            plugins=["r3_routing", "ci_kl_checker"],
            ci=CIConfig(test=True),
            algorithm=AlgorithmConfig(use_kl_loss=True),  # a reference model: the checks apply
        )
        sections = {name: cls() for name, cls in plugins.config_sections().items()}
        sections["r3_routing"] = shape
        plugins.configure(config, sections)
        # R3 excuses routing only: the checker asks for the replayed reference at rollout 0.
        assert plugins.replayed_reference_forward(0)
        assert not plugins.replayed_reference_forward(1)
        first_step = {
            "train/ppo_kl": 0.0,
            "train/ppo_kl_abs_max": 0.0,
            "train/pg_clipfrac": 0.0,
            "train/kl_loss": 0.004,
            "train/replay_agreement": 1.0,  # the training forward replayed every expert
        }
        rollout = {
            "rollout/log_probs": -1.0,
            "rollout/ref_log_probs": -1.1,
            "rollout/audit": 1.0,  # rollout 0 is an audit: the trainer scored it itself
            "rollout/train_rollout_logprob_abs_diff": 0.0,
            "rollout/train_rollout_logprob_max_abs_diff": 0.0,
            "rollout/routing_agreement": 1.0,  # the trainer's own routers picked the engine's
            "rollout/shifted_replay_agreement": 1.0,  # the audit's probe followed the shift
        }
        replayed = "rollout/ref_replayed_log_probs_max_abs_diff"
        with pytest.raises(AssertionError, match=f"{replayed} is not logged"):
            plugins.after_log_rollout_data(0, rollout)
        plugins.after_log_rollout_data(0, {**rollout, replayed: 0.0})
        plugins.after_train_step(0, 0, 0, first_step)
        reason = f"r3_routing: {r3_plugin.EXEMPTION_REASON}"
        [record] = [r for r in caplog.records if reason in r.getMessage()]
        assert f"r3_routing: {r3_plugin.EXEMPTION_REASON}" in record.getMessage()
        assert "first_rollout_ref_replayed_log_probs at rollout 0" in record.getMessage()
        with pytest.raises(AssertionError, match="first_step_ppo_kl"):
            plugins.after_train_step(0, 0, 0, {**first_step, "train/ppo_kl": 0.01})
    finally:
        plugins.unregister("ci_kl_checker")
        plugins.unregister("r3_routing")
        sys.modules["ember_ci_kl_checker.plugin"]._checker = None
