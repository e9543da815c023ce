"""`ember certify`'s rows, judged from measurements (no Ray), its bad-input errors, and its
generation of the same prompts twice (a real engine in this process)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import ray
import torch

from ember import certify_plugin
from ember.calls import LocalActor
from ember.certify import (
    FAIL,
    NOT_APPLICABLE,
    PASS,
    PLUGIN,
    REPORTED,
    determinism_row,
    distribution_row,
    generate_again,
    loaded_alike_row,
    log_prob_row,
    on_policy_row,
    passed,
    reference_row,
    routing_row,
    run_overrides,
    table,
    top_k_kl,
    version_row,
    weights_row,
    write_certificate,
)
from ember.cli import USAGE_ERROR, main
from ember.config import load_config
from ember_core.certify import (
    FP32_BARS,
    LOW_PRECISION_BARS,
    PLANT_ENV,
    Fault,
    MismatchBars,
    mismatch_ceiling,
    planted,
    reference_source,
    shifted_experts,
)
from ember_core.config import SamplingConfig
from ember_core.hookspecs import ExemptionScope, KLExemption
from ember_core.types import Sample
from ember_megatron_backend.forward import with_rest
from ember_rollout.config import (
    DataConfig,
    EngineConfig,
    GroupSamplingConfig,
    HFEngineConfig,
    RewardConfig,
    RolloutSections,
    TinyModelConfig,
)
from ember_rollout.data import PromptRecord
from ember_rollout.hf_engine import HFEngine
from ember_rollout.rewards import register_reward
from ember_rollout.rollout import RolloutGenerator

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


BARS = MismatchBars(mean=1e-4, max=1e-3, kl_mean=1e-6, kl_max=1e-4, why="test bars")
"""Separate bars on the mean and on the maximum, as each dtype's are."""


@pytest.mark.parametrize(
    ("mean", "largest", "verdict"),
    [
        (0.0, 0.0, PASS),
        (1e-8, 5e-4, PASS),  # a maximum above the mean's bar: the maximum has its own
        (1e-8, 2e-3, FAIL),  # one token over the maximum's bar, the mean far inside its own
        (2e-4, 2e-4, FAIL),  # the mean over its bar, every token inside the maximum's
        (NAN, 0.0, FAIL),
    ],
)
def test_log_prob_row_bars_the_mean_and_the_maximum(mean, largest, verdict):
    metrics = {
        "rollout/train_rollout_logprob_abs_diff": mean,
        "rollout/train_rollout_logprob_max_abs_diff": largest,
    }
    row = log_prob_row("2", metrics, BARS, "start")
    assert row.verdict == verdict
    assert row.bar == "mean <= 0.0001, max <= 0.001 (test bars)"
    assert log_prob_row("2", {}, BARS, "start").verdict == FAIL  # no engine log-probs
    counted = log_prob_row("2", metrics, BARS, "start", answers=[3, 250, 7])
    assert counted.measured.endswith(" over 260 tokens (answers of up to 250)")


def test_mismatch_bars_are_by_dtype():
    fp32 = mismatch_ceiling("float32", None)
    assert (fp32.mean, fp32.max, fp32.kl_mean, fp32.kl_max) == (1e-4, 5e-4, 1e-9, 1e-7)
    assert fp32 == FP32_BARS
    assert mismatch_ceiling("float32", "float32") == FP32_BARS
    low = mismatch_ceiling("bfloat16", "float32")
    assert (low.mean, low.max, low.kl_mean, low.kl_max) == (0.1, 2.0, 1e-2, 0.25)
    assert low.why == (
        "engine dtype bfloat16, trainer dtype float32: below float32, the two round differently"
    )
    unknown = mismatch_ceiling(None, "float32")  # an attached server
    assert unknown.max == LOW_PRECISION_BARS.max and "engine dtype unknown" in unknown.why
    assert mismatch_ceiling("float32", "bfloat16").mean == LOW_PRECISION_BARS.mean
    # The float32 maximum still fails one token off by 2^-10; the mean bar is slime's below.
    assert FP32_BARS.max < 2**-10 and LOW_PRECISION_BARS.mean == 0.1
    for bars in (FP32_BARS, LOW_PRECISION_BARS):
        assert bars.mean <= bars.max and bars.kl_mean <= bars.kl_max
    # Under rollout.true_on_policy every difference fails, whatever the dtypes.
    for engine, trainer in (("float32", "float32"), ("bfloat16", "bfloat16")):
        exact = mismatch_ceiling(engine, trainer, exact=True)
        assert (exact.mean, exact.max, exact.kl_mean, exact.kl_max) == (0, 0, 0, 0)
        assert "rollout.true_on_policy" in exact.why


def test_routing_row():
    natural = {"rollout/routing_agreement": 0.9}
    dense = routing_row("4", natural, moe=False, replaying=False, when="start")
    assert dense.verdict == NOT_APPLICABLE
    off = routing_row("4", natural, moe=True, replaying=False, when="start")
    assert (off.verdict, off.measured) == (REPORTED, "without replay 0.9000")
    assert routing_row("4", {}, moe=True, replaying=False, when="s").verdict == NOT_APPLICABLE
    exact = {**natural, "rollout/shifted_replay_agreement": 1.0}
    assert routing_row("4", exact, moe=True, replaying=True, when="s").verdict == PASS
    short = {**natural, "rollout/shifted_replay_agreement": 0.999}
    assert routing_row("4", short, moe=True, replaying=True, when="s").verdict == FAIL
    assert routing_row("4", natural, moe=True, replaying=True, when="s").verdict == FAIL
    # The engine's own experts replayed: a forward that does not replay follows them too where
    # its routing agrees (float32), so that agreement does not pass the row.
    own = {**natural, "rollout/replay_agreement": 1.0}
    assert routing_row("4", own, moe=True, replaying=True, when="s").verdict == FAIL


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


def test_reference_row_with_a_checkpoint_of_its_own_reads_the_rebuilt_reference():
    """An SFT model as reference (train.ref_load other than the actor's start): the actor need
    not equal it; the reference must equal a second model built from train.ref_load."""
    metrics = {
        "rollout/log_probs_ref_max_abs_diff": 0.7,  # the actor is not the SFT model
        "rollout/ref_replayed_log_probs_max_abs_diff": 0.7,
        "rollout/ref_rebuilt_log_probs_max_abs_diff": 0.0,
    }
    for replaying in (False, True):
        row = reference_row(metrics, reference=True, replaying=replaying, source="/ckpt/sft")
        assert (row.verdict, row.measured) == (PASS, "max 0.00e+00")
        assert "train.ref_load" in row.check
    wrong = {**metrics, "rollout/ref_rebuilt_log_probs_max_abs_diff": 0.01}
    assert reference_row(wrong, reference=True, replaying=False, source="s").verdict == FAIL
    missing = reference_row({}, reference=True, replaying=False, source="s")
    assert missing.verdict == FAIL and "ref_rebuilt" in missing.detail
    assert reference_row(metrics, reference=True, replaying=False).verdict == FAIL  # no source


def test_reference_source_is_ref_load_unless_it_is_the_actors_start():
    assert reference_source(None, "/m/base") is None
    assert reference_source("/m/base", "/m/base") is None
    assert reference_source("/m/base/", "/m/base") is None
    assert reference_source("/m/sft", "/m/base") == "/m/sft"
    assert reference_source("/m/sft", None) == "/m/sft"  # the actor starts from its seed


def test_the_plugin_asks_for_a_reference_rebuilt_from_its_own_checkpoint_at_rollout_0():
    class Facade:
        def kl_check_exemptions(self):
            return [KLExemption("r3_routing", "replays", ExemptionScope.ROUTING)]

    own = {"train": {"ref_load": "/m/sft", "hf_load": "/m/base"}}
    try:
        certify_plugin.ember_configure(config=own, sections={}, plugins=Facade())
        assert certify_plugin.ember_rebuilt_reference_forward(rollout_id=0)
        assert not certify_plugin.ember_rebuilt_reference_forward(rollout_id=1)
        assert not certify_plugin.ember_replayed_reference_forward(rollout_id=0)
        same = {"train": {"ref_load": "/m/base", "hf_load": "/m/base"}}
        certify_plugin.ember_configure(config=same, sections={}, plugins=Facade())
        assert not certify_plugin.ember_rebuilt_reference_forward(rollout_id=0)
        assert certify_plugin.ember_replayed_reference_forward(rollout_id=0)
    finally:
        certify_plugin.ember_configure(config=None, sections={}, plugins=None)


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
    row = distribution_row("3", coarse, BARS, k=4, vocab=50, when="start")
    assert row.verdict == FAIL and "top-4 ids + the rest of 50" in row.measured
    assert distribution_row("3", None, BARS, k=4, vocab=50, when="s").verdict == NOT_APPLICABLE


def one_far_position(value: float, positions: int = 1000) -> torch.Tensor:
    kl = torch.zeros(positions, dtype=torch.float64)
    kl[positions // 2] = value
    return kl


@pytest.mark.parametrize(
    ("kl", "verdict"),
    [
        (torch.zeros(1000, dtype=torch.float64), PASS),
        (torch.full((1000,), 5e-7, dtype=torch.float64), PASS),
        # One position above the mean's bar, inside the maximum's: the maximum has its own.
        (one_far_position(5e-5), PASS),
        # Mean 2e-7, under its bar; one position at 2e-4 over the maximum's: that decides.
        (one_far_position(2e-4), FAIL),
        (torch.full((1000,), 2e-6, dtype=torch.float64), FAIL),  # the mean, every position
        (one_far_position(float("nan")), FAIL),
    ],
    ids=["zero", "under", "one-position-under", "one-position", "mean", "nan"],
)
def test_distribution_row_bars_the_mean_and_the_maximum(kl, verdict):
    row = distribution_row("3", kl, BARS, k=20, vocab=20, when="start")
    assert row.verdict == verdict
    assert row.measured.endswith("over the whole vocabulary")


def test_row_3s_engine_forward_replays_the_rollouts_experts_when_asked():
    """Under R3 the trainer's forward replays the rollout's experts: so does the engine's."""
    from types import SimpleNamespace

    from ember.actors import RolloutEngine
    from ember_rollout.families import build_family_model
    from ember_rollout.routing import replay_routing

    model = build_family_model("qwen3_moe", seed=3)
    tokens = [12, 5, 3, 16, 13, 2, 9, 9, 4, 16]
    experts = torch.randint(
        0, 8, (len(tokens) - 1, 3, 1), generator=torch.Generator().manual_seed(0)
    )
    experts = torch.cat([experts, (experts + 1 + experts % 3) % 8], dim=-1)  # two distinct ids
    sample = Sample(index=0, tokens=tokens, response_length=4, rollout_routed_experts=experts)
    engine = SimpleNamespace(engine=SimpleNamespace(model=model))
    [(ids, replayed)] = RolloutEngine.top_log_probs(engine, [sample], 5, 0.8, replay=True)
    [(_, routed)] = RolloutEngine.top_log_probs(engine, [sample], 5, 0.8)
    with torch.no_grad(), replay_routing(model, experts):
        logits = model(input_ids=torch.tensor([tokens[:-1]])).logits[0]
    rows = torch.log_softmax(logits[-4:] / 0.8, -1)
    assert torch.equal(ids, rows.topk(5, dim=-1).indices)
    torch.testing.assert_close(replayed, with_rest(rows, ids), atol=0, rtol=0)
    assert (routed - replayed).abs().max() > 1e-3  # routing afresh picks other experts


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


@register_reward("certify_flat_when_labelled", group=True)
def _flat_when_labelled(samples):
    """Groups labelled "flat" get equal rewards (no signal for the dynamic filter)."""
    if samples[0].label == "flat":
        return [0.5] * len(samples)
    return [float(i % 2) for i in range(len(samples))]


class _Manager:
    """The rollout manager's generate and prompt-stream calls over one rollout generator in this
    process (a tiny fp32 model on the embedded engine), with the dynamic filter on."""

    def __init__(self, data: str) -> None:
        tiny = TinyModelConfig(num_layers=1, hidden_size=32)
        engine_config = HFEngineConfig(dtype="float32", tiny=tiny)
        engine = HFEngine(engine_config)
        engine.load()
        sections = RolloutSections(
            engine=EngineConfig(kind="hf", hf=engine_config),
            data=DataConfig(prompt_data=data, shuffle=False),
            reward=RewardConfig(reward_fn="certify_flat_when_labelled"),
            group_sampling=GroupSamplingConfig(dynamic_filter=True),
        )
        sampling = SamplingConfig(
            rollout_batch_size=2, n_samples_per_prompt=2, max_response_len=4, seed=5
        )
        self.generator = RolloutGenerator.from_config(
            engine=engine, sampling=sampling, sections=sections
        )

    def encoded(self, labels: list[str]) -> list[tuple[PromptRecord, list[int]]]:
        records = [PromptRecord(prompt=f"again {i} =", label=x) for i, x in enumerate(labels)]
        return [(r, self.generator.encoder.encode(r)) for r in records]

    def generate(self, rollout_id, prompts=None):
        return asyncio.run(self.generator.generate(rollout_id, prompts))

    def state_dict(self):
        return self.generator.state_dict()

    def load_state_dict(self, state):
        self.generator.load_state_dict(state)


@pytest.mark.slow  # a real engine and tokenizer: about 8 s on two cores
def test_generating_again_refills_dropped_groups_from_the_same_prompts(tmp_path):
    """Row 8 under the dynamic filter: a group the filter drops on the second generation of the
    same prompts is replaced by the same prompt from the stream as on the first."""
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"copy {i}{i} =", "label": "ok"} for i in range(8)]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    manager = LocalActor(_Manager, (str(data),), {}, name="manager")
    try:
        prompts = manager.instance.encoded(["ok", "flat"])  # the second group is dropped
        first, second = generate_again(manager, 1, prompts)
    finally:
        manager.close()
    assert [s.prompt for s in first.samples[::2]] == ["again 0 =", "copy 00 ="]  # refilled
    assert [s.prompt for s in second.samples] == [s.prompt for s in first.samples]
    tokens = [[s.tokens for s in b.samples] for b in (first, second)]
    assert determinism_row(*tokens, seeded=True).verdict == PASS
