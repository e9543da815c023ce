"""`ember certify`'s rows, judged from measurements (no Ray), and its bad-input errors."""

from __future__ import annotations

import json
import time

import pytest
import ray
import torch

from ember import certify_plugin
from ember.certify import (
    FAIL,
    NOT_APPLICABLE,
    PASS,
    PLUGIN,
    REPORTED,
    determinism_row,
    distribution_row,
    loaded_alike_row,
    log_prob_row,
    on_policy_row,
    passed,
    reference_row,
    routing_row,
    run_overrides,
    shifted_experts,
    table,
    top_k_kl,
    version_row,
    weights_row,
    write_certificate,
)
from ember.cli import USAGE_ERROR, main
from ember.config import load_config
from ember_core.certify import PLANT_ENV, Fault, mismatch_ceiling, planted
from ember_core.hookspecs import ExemptionScope, KLExemption
from ember_core.types import Sample
from ember_megatron_backend.forward import with_rest

NAN = float("nan")


def test_weights_row_passes_only_when_every_engine_serves_every_tensor():
    trainer = {"a": "1", "b": "2"}
    assert weights_row("1", trainer, [{"a": "1", "b": "2"}] * 2, "x").verdict == PASS
    differs = weights_row("1", trainer, [{"a": "1", "b": "2"}, {"a": "1", "b": "9"}], "x")
    assert (differs.verdict, differs.measured) == (FAIL, "3/4 tensors equal over 2 engines")
    assert "differ: b" in differs.detail
    missing = weights_row("1", trainer, [{"a": "1", "b": None}], "x")
    assert missing.verdict == FAIL and "not served: b" in missing.detail
    assert weights_row("1", {}, [{"a": "1"}], "x").verdict == FAIL
    assert weights_row("1", trainer, [None], "x").verdict == NOT_APPLICABLE


@pytest.mark.parametrize(
    ("mean", "largest", "verdict"),
    [(1e-8, 5e-5, PASS), (1e-8, 2e-4, FAIL), (2e-4, 1e-5, FAIL), (NAN, 0.0, FAIL)],
)
def test_log_prob_row_bars_the_mean_and_the_maximum(mean, largest, verdict):
    metrics = {
        "rollout/train_rollout_logprob_abs_diff": mean,
        "rollout/train_rollout_logprob_max_abs_diff": largest,
    }
    assert log_prob_row("2", metrics, 1e-4, "fp32", "start").verdict == verdict
    assert log_prob_row("2", {}, 1e-4, "fp32", "start").verdict == FAIL  # no engine log-probs


def test_mismatch_ceiling_is_by_dtype():
    assert mismatch_ceiling("float32", None)[0] == 1e-4
    assert mismatch_ceiling("float32", "float32")[0] == 1e-4
    assert mismatch_ceiling("bfloat16", "float32")[0] == 0.1
    assert mismatch_ceiling(None, "float32")[0] == 0.1  # an attached server: unknown


def test_routing_row():
    natural = {"rollout/routing_agreement": 0.9}
    dense = routing_row("4", natural, None, moe=False, replaying=False, when="start")
    assert dense.verdict == NOT_APPLICABLE
    off = routing_row("4", natural, None, moe=True, replaying=False, when="start")
    assert (off.verdict, off.measured) == (REPORTED, "without replay 0.9000")
    assert routing_row("4", {}, None, moe=True, replaying=False, when="s").verdict == NOT_APPLICABLE
    exact = {"rollout/replay_agreement": 1.0}
    assert routing_row("4", natural, exact, moe=True, replaying=True, when="s").verdict == PASS
    short = {"rollout/replay_agreement": 0.999}
    assert routing_row("4", natural, short, moe=True, replaying=True, when="s").verdict == FAIL
    assert routing_row("4", natural, {}, moe=True, replaying=True, when="s").verdict == FAIL


def test_on_policy_row_needs_exact_zeros_at_the_first_step():
    zero = {"train/ppo_kl": 0.0, "train/ppo_kl_abs_max": 0.0}
    assert on_policy_row([zero, {"train/ppo_kl": 5.0}]).verdict == PASS
    assert on_policy_row([{**zero, "train/ppo_kl_abs_max": 1e-7}]).verdict == FAIL
    assert on_policy_row([{**zero, "train/ppo_kl": NAN}]).verdict == FAIL
    assert on_policy_row([]).verdict == FAIL


def test_reference_row_reads_the_replayed_reference_under_replay():
    metrics = {
        "rollout/log_probs_ref_max_abs_diff": 0.3,  # routes apart from the replaying actor
        "rollout/ref_replayed_log_probs_max_abs_diff": 0.0,
    }
    assert reference_row(metrics, reference=True, replaying=True).verdict == PASS
    assert reference_row(metrics, reference=True, replaying=False).verdict == FAIL
    assert reference_row({}, reference=True, replaying=False).verdict == FAIL
    assert reference_row({}, reference=False, replaying=False).verdict == NOT_APPLICABLE


def test_version_and_determinism_rows():
    assert version_row(["0", "0"], "0").verdict == PASS
    assert version_row(["0", "-1"], "0").verdict == FAIL
    assert version_row([], "0").verdict == FAIL
    assert determinism_row([[1, 2], [3]], [[1, 2], [3]], seeded=True).verdict == PASS
    row = determinism_row([[1, 2], [3]], [[1, 2], [4]], seeded=True)
    assert (row.verdict, row.measured) == (FAIL, "1/2 samples equal")
    assert determinism_row([[1, 2]], [[2, 1]], seeded=False).verdict == REPORTED


def test_table_and_certificate(tmp_path):
    rows = [
        version_row(["0"], "0"),
        weights_row("1", {"a": "1"}, [{"a": "2"}], "initial load"),
    ]
    text = table(rows).splitlines()
    assert text[0].split() == ["row", "check", "measured", "bar", "verdict"]
    assert text[2].startswith("7.5") and text[2].endswith(PASS)
    assert text[3].startswith("1") and text[3].endswith(FAIL)
    assert text[4].strip() == "differ: a"  # the detail, under its row
    assert not passed(rows) and passed(rows[:1])
    document = json.loads(write_certificate(tmp_path, rows, {"engine": "hf"}).read_text())
    assert document["passed"] is False
    assert [r["verdict"] for r in document["rows"]] == [PASS, FAIL]
    assert document["setup"] == {"engine": "hf"}


def test_run_overrides_keep_nothing_and_enable_the_plugin():
    config, _ = load_config(None, plugins=["r3_routing"])
    data = run_overrides(config)
    assert data["plugins"] == ["r3_routing", PLUGIN]
    assert data["run"]["num_rollouts"] == 2
    assert data["run"]["save_interval"] == 0 and data["run"]["plot"] is False
    assert data["ci"]["test"] is False
    assert data["run"]["rollout_only"] is False and data["run"]["train_from_rollouts"] is None
    again, plugins = load_config(data)  # what the certifier runs is a valid config
    assert again.plugins == ["r3_routing", PLUGIN]
    assert plugins.audit_rollout(0) and plugins.audit_rollout(1)
    assert plugins.replayed_reference_forward(0)  # r3_routing reports a routing exemption
    assert not plugins.replayed_reference_forward(1)


def test_the_plugin_asks_for_the_replayed_reference_only_under_a_routing_exemption():
    class Facade:
        def __init__(self, exemptions):
            self.exemptions = exemptions

        def kl_check_exemptions(self):
            return self.exemptions

    routing = KLExemption("r3_routing", "replays", ExemptionScope.ROUTING)
    certify_plugin.ember_configure(config=None, sections={}, plugins=Facade([]))
    assert not certify_plugin.ember_replayed_reference_forward(rollout_id=0)
    certify_plugin.ember_configure(config=None, sections={}, plugins=Facade([routing]))
    assert certify_plugin.ember_replayed_reference_forward(rollout_id=0)
    assert not certify_plugin.ember_replayed_reference_forward(rollout_id=1)


def test_shifted_experts_differ_everywhere_and_stay_valid():
    experts = torch.tensor([[[0, 7], [3, 4]], [[6, 7], [1, 2]]], dtype=torch.int32)
    sample = Sample(
        index=0, group_index=0, prompt="p", tokens=[1, 2, 3], response_length=1,
        rollout_routed_experts=experts,
    )  # fmt: skip
    shifted = shifted_experts([sample], 8)[0]
    assert torch.equal(shifted.rollout_routed_experts, (experts + 1) % 8)
    assert torch.all(shifted.rollout_routed_experts != experts)
    assert sample.rollout_routed_experts is experts  # the original is left as it was
    assert shifted.tokens == sample.tokens


def test_planted_reads_the_environment(monkeypatch):
    monkeypatch.delenv(PLANT_ENV, raising=False)
    assert not any(planted(f) for f in Fault)
    monkeypatch.setenv(PLANT_ENV, Fault.REFERENCE.value)
    assert [f for f in Fault if planted(f)] == [Fault.REFERENCE]


@pytest.fixture
def nothing_starts(monkeypatch):
    """Fail the test if the certifier's actors start: under Ray, or in this process (the
    default config's runtime)."""
    from ember.runtimes import LocalRuntime, RayRuntime

    def refuse(*args, **kwargs):
        raise AssertionError("the run's runtime was started")

    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(LocalRuntime, "start", refuse)
    monkeypatch.setattr(RayRuntime, "start", refuse)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--set", "rollout.temperature=-1"], "temperature"),
        (["--set", "train.model=no-such-model"], "no-such-model"),
        (["no-such-config.yaml"], "no-such-config"),
        (["--plugins", "no_such_plugin"], "no_such_plugin"),
    ],
)
def test_bad_input_is_one_line_before_ray(argv, named, capsys, nothing_starts):
    started = time.perf_counter()
    assert main(["certify", *argv]) == USAGE_ERROR
    assert time.perf_counter() - started < 10
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = err.splitlines()
    assert line.startswith("ember certify: error: ") and named in line


def test_top_k_kl_is_the_kl_of_the_coarsened_distributions():
    torch.manual_seed(0)
    engine_full = torch.log_softmax(torch.randn(5, 50, dtype=torch.float64), -1)
    trainer_full = torch.log_softmax(torch.randn(5, 50, dtype=torch.float64), -1)
    exact = (engine_full.exp() * (engine_full - trainer_full)).sum(-1)
    everything = torch.arange(50).expand(5, 50)
    covered = top_k_kl(with_rest(engine_full, everything), with_rest(trainer_full, everything))
    assert torch.allclose(covered, exact)  # k covers the vocabulary: the full KL
    ids = engine_full.topk(4, -1).indices
    coarse = top_k_kl(with_rest(engine_full, ids), with_rest(trainer_full, ids))
    rest = lambda lp: torch.log1p(-lp.gather(1, ids).exp().sum(-1))  # noqa: E731
    p, q = engine_full.gather(1, ids), trainer_full.gather(1, ids)
    by_hand = (p.exp() * (p - q)).sum(-1) + rest(engine_full).exp() * (
        rest(engine_full) - rest(trainer_full)
    )
    assert torch.allclose(coarse, by_hand)
    assert torch.all(coarse <= exact + 1e-12) and torch.all(coarse >= 0)  # a lower bound
    same = with_rest(engine_full.float(), ids)
    assert float(top_k_kl(same, same).abs().max()) < 1e-12
    row = distribution_row("3", coarse, 1e-4, "fp32", k=4, vocab=50, when="start")
    assert row.verdict == FAIL and "top-4 ids + the rest of 50" in row.measured
    assert distribution_row("3", None, 1e-4, "", k=4, vocab=50, when="s").verdict == NOT_APPLICABLE


def test_loaded_alike_row_needs_equal_scores_from_push_and_checkpoint():
    pushed = [[[-1.0, -2.0], [-0.5]]]  # one engine, two servers
    assert loaded_alike_row("1", pushed, [[[-1.0, -2.0], [-0.5]]], "x").verdict == PASS
    off = loaded_alike_row("1", pushed, [[[-1.0, -2.0], [-0.6]]], "x")
    assert off.verdict == FAIL and off.measured.startswith("max |diff| 1.00e-01 over 3 tokens")
    assert loaded_alike_row("1", pushed, [[[-1.0], [-0.5]]], "x").verdict == FAIL
    assert loaded_alike_row("1", [None], [None], "x").verdict == NOT_APPLICABLE


def test_a_colocated_gpu_run_is_refused_in_one_line(capsys, nothing_starts):
    argv = ["certify", "--set", "ray.colocate=true", "--set", "ray.gpus_per_rank=0.5"]
    argv += ["--set", "ray.gpus_per_engine=0.5"]
    assert main(argv) == USAGE_ERROR
    (line,) = capsys.readouterr().err.splitlines()
    assert "ray.colocate=true on GPUs" in line and "ray.colocate=false" in line
