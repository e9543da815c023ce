"""The peer benchmarks' own parts, without TRL: arguments, the Ember -> TRL hyper-parameter
mapping (the toy task's and a run config's), TRL's dataset and reward function, the summaries
of a run's records (thresholds, first and last means, memory) and the learning report."""

from __future__ import annotations

import json
import math
import re
import statistics
import sys

import pytest
from tools_loader import ROOT, load_tool

bench_peer = load_tool("bench_peer")
bench_learning = load_tool("bench_learning")  # imports bench_peer, registered just above
figures = sys.modules["peer_figures"]  # as bench_peer imported it (one Threshold class)
peer_trl = load_tool("peer_trl")

DEFAULT_SETS = bench_peer.ember_overrides("copy", 3, 3, 200, None, [])


# -- TRL from the peer group ------------------------------------------------------------------


def test_without_trl_the_bench_runs_itself_again_with_the_peer_group_once(monkeypatch):
    execs = []
    monkeypatch.setattr(bench_peer.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(bench_peer.shutil, "which", lambda name: "/opt/uv")
    monkeypatch.setattr(bench_peer.sys, "argv", ["tools/bench_peer.py", "--rollouts", "3"])
    monkeypatch.setattr(bench_peer.os, "execve", lambda *call: execs.append(call))
    monkeypatch.delenv(bench_peer.REEXEC_ENV, raising=False)
    with pytest.raises(SystemExit, match="peer"):  # execve (faked here) would not return
        bench_peer.require_trl()
    ((path, argv, env),) = execs
    assert path == "/opt/uv"
    assert argv == ["/opt/uv", "run", "--group", "peer", "python", "tools/bench_peer.py",
                    "--rollouts", "3"]  # fmt: skip
    assert env[bench_peer.REEXEC_ENV] == "1"
    # Run again (TRL still missing): it says what to do instead of looping.
    monkeypatch.setenv(bench_peer.REEXEC_ENV, "1")
    with pytest.raises(SystemExit, match="uv run --group peer"):
        bench_peer.require_trl()
    assert len(execs) == 1


# -- arguments and overrides -----------------------------------------------------------------


def test_arguments_default_to_the_default_config_and_reject_bad_values():
    args = bench_peer.parse_args([])
    assert (args.task, args.min_digits, args.max_digits, args.rollouts) == ("copy", 3, 3, 200)
    assert args.seeds is None and args.only is None
    args = bench_peer.parse_args(
        "--task reverse --min-digits 2 --max-digits 4 --rollouts 10 --seeds 1 2 --only trl".split()
    )
    assert (args.task, args.min_digits, args.max_digits, args.rollouts) == ("reverse", 2, 4, 10)
    assert args.seeds == [1, 2] and args.only == "trl"
    for bad in (
        ["--min-digits", "4", "--max-digits", "2"],
        ["--rollouts", "0"],
        ["--seeds", "1", "1"],
        ["--only", "verl"],
        ["--task", "add"],
    ):
        with pytest.raises(SystemExit):
            bench_peer.parse_args(bad)


def test_overrides_set_task_horizon_and_seeds_and_let_the_user_win():
    sets = bench_peer.ember_overrides("sort", 2, 4, 10, 7, ["rollout.seed=99"])
    assert sets[:5] == [
        "data.toy.task=sort",
        "data.toy.min_digits=2",
        "data.toy.max_digits=4",
        "run.num_rollouts=10",
        "train.optimizer.lr_decay_steps=40",  # 10 rollouts x 4 steps: decay over the run
    ]
    assert sets[5:] == ["rollout.seed=7", "train.seed=7", "data.seed=7", "rollout.seed=99"]
    config = bench_peer.load_run_config(sets)
    assert config.rollout.seed == 99 and config.train.seed == 7 and config.data.toy.task == "sort"
    own = bench_peer.ember_overrides("copy", 3, 3, 10, None, ["train.optimizer.lr_decay_steps=8"])
    assert [s for s in own if "lr_decay_steps" in s] == ["train.optimizer.lr_decay_steps=8"]
    assert DEFAULT_SETS[4] == "train.optimizer.lr_decay_steps=800"  # the config's own value


# -- the mapping ------------------------------------------------------------------------------


def test_default_config_maps_to_the_issue_hyper_parameters():
    mapping = bench_peer.trl_mapping(bench_peer.load_run_config(DEFAULT_SETS))
    expected = {
        "num_generations": 8,
        "per_device_train_batch_size": 64,  # 32 prompts x 8 samples over 4 optimizer steps
        "gradient_accumulation_steps": 1,
        "steps_per_generation": 4,
        "num_iterations": 1,
        "max_steps": 800,
        "temperature": 1.0,
        "top_k": 0,
        "max_completion_length": 8,
        "epsilon": 0.2,
        "epsilon_high": 0.28,
        "beta": 0.0,
        "entropy_coef": 0.03,
        "loss_type": "grpo",
        "scale_rewards": "group",
        "learning_rate": 1e-3,
        "warmup_steps": 4,
        "lr_scheduler_type": "cosine_warmup_with_min_lr",
        "lr_scheduler_kwargs": {"min_lr": 1e-4},
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "bf16": False,
        "use_cpu": True,
        "use_vllm": False,
        "gradient_checkpointing": False,
        "router_aux_loss_coef": 0.0,
        "seed": 1234,
        "save_strategy": "steps",
        "save_steps": 40,
    }
    assert {k: mapping.kwargs[k] for k in expected} == expected
    assert mapping.steps_per_rollout == 4 and mapping.threads is None
    rows = {r.ember: r for r in mapping.rows}
    # Both sample in fp32 from the weights they train.
    assert (rows["engine.hf.dtype"].ember_value, rows["engine.hf.dtype"].trl_value) == (
        "float32",
        "float32",
    )
    assert "token mean" in rows["algorithm.entropy_coef"].note
    # What cannot be mapped, or differs, is printed as such, with the reason.
    other = bench_peer.trl_mapping(
        bench_peer.load_run_config(
            [*DEFAULT_SETS, "engine.hf.dtype=bfloat16", "algorithm.use_kl_loss=true"]
        )
    )
    others = {r.ember: r for r in other.rows}
    assert others["engine.hf.dtype"].trl == "-" and "on-policy" in others["engine.hf.dtype"].note
    assert "reference" in others["algorithm.use_kl_loss, kl_loss_coef"].note
    assert other.kwargs["beta"] == 0.0
    text = bench_peer.format_mapping(mapping)
    assert text.splitlines()[0].split() == ["Ember", "key", "value", "TRL", "GRPOConfig", "value",
                                            "note"]  # fmt: skip
    assert len(text.splitlines()) == len(mapping.rows) + 1


def test_mapping_follows_micro_batches_seeds_threads_and_refuses_what_it_cannot_hold():
    sets = [*DEFAULT_SETS, "train.micro_batch_size=16", "ray.threads_per_actor=1"]
    mapping = bench_peer.trl_mapping(bench_peer.load_run_config(sets), seed=5)
    kwargs = mapping.kwargs
    assert kwargs["per_device_train_batch_size"] == 16
    assert kwargs["gradient_accumulation_steps"] == 4
    assert kwargs["steps_per_generation"] == 16  # micro-batches per rollout
    assert kwargs["seed"] == 5 and mapping.threads == 1
    whitening = bench_peer.trl_mapping(
        bench_peer.load_run_config([*DEFAULT_SETS, "algorithm.whiten_advantages=true"])
    )
    assert any(r.ember == "algorithm.whiten_advantages" and r.trl == "-" for r in whitening.rows)
    with pytest.raises(ValueError, match="advantage_estimator"):
        bench_peer.trl_mapping(
            bench_peer.load_run_config([*DEFAULT_SETS, "algorithm.advantage_estimator=gspo"])
        )
    with pytest.raises(ValueError, match="num_steps_per_rollout=3"):
        bench_peer.trl_mapping(
            bench_peer.load_run_config([*DEFAULT_SETS, "train.num_steps_per_rollout=3"])
        )


@pytest.mark.slow  # imports megatron-core for Ember's schedule
def test_trl_schedule_follows_embers_learning_rate():
    import torch
    from transformers import get_scheduler

    from ember_megatron_backend.optimizer import learning_rate

    config = bench_peer.load_run_config(DEFAULT_SETS)
    kwargs = bench_peer.trl_mapping(config).kwargs
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=kwargs["learning_rate"])
    # What transformers' Trainer builds from these GRPOConfig fields.
    scheduler = get_scheduler(
        kwargs["lr_scheduler_type"],
        optimizer,
        num_warmup_steps=kwargs["warmup_steps"],
        num_training_steps=kwargs["max_steps"],
        scheduler_specific_kwargs=kwargs["lr_scheduler_kwargs"],
    )
    gaps = []
    for step in range(kwargs["max_steps"]):
        ember = learning_rate(step, config.train.optimizer)
        trl = scheduler.get_last_lr()[0]
        if step < kwargs["warmup_steps"]:
            assert trl == pytest.approx(ember, rel=1e-12)  # the same warm-up, step for step
        gaps.append(abs(trl - ember))
        optimizer.step()
        scheduler.step()
    assert max(gaps) < 0.005 * kwargs["learning_rate"]  # the decay runs one step ahead
    assert learning_rate(799, config.train.optimizer) == pytest.approx(1e-4, rel=1e-3)


def test_trl_mapping_is_a_valid_grpo_config():
    pytest.importorskip("trl", reason="TRL is in the `peer` dependency group only")
    from trl import GRPOConfig

    kwargs = bench_peer.trl_mapping(bench_peer.load_run_config(DEFAULT_SETS)).kwargs
    args = GRPOConfig(output_dir="unused", **kwargs)
    assert args.generation_batch_size == 256  # one generation = one rollout of 32 x 8
    assert args.epsilon_high == 0.28 and args.lr_scheduler_kwargs == {"min_lr": 1e-4}


# -- TRL's reward function ---------------------------------------------------------------------


def test_trl_reward_calls_toy_score_with_the_stop_state():
    from ember_rollout.tokenizer import toy_tokenizer

    eos = toy_tokenizer().eos_token_id
    sink, lengths = [], []
    reward = peer_trl.make_toy_reward(eos, sink, lengths)
    digits = [5, 3, 6]  # any non-EOS ids: only the last one's being EOS matters
    scores = reward(
        completions=["314", "314", "31"],
        completion_ids=[[*digits, eos], digits, [5, 3, eos]],
        label=["314", "314", "314"],
        trainer_state=None,
    )
    # Positions right out of 4 (3 digits + the stop): all; the stop missing; a digit missing.
    assert scores == [1.0, 0.75, 0.5]
    assert sink == [pytest.approx(0.75)]
    assert lengths == [pytest.approx(10 / 3)]  # tokens of each completion, the stop included


# -- summaries -----------------------------------------------------------------------------------


def synthetic_run(rewards, start=1000.0, first=12.0, gap=2.0):
    """Ember-shaped metrics: rollout records `gap` s apart after a `first` s start-up, with
    train records in between and out of order."""
    metrics = []
    for i, reward in enumerate(rewards):
        t = start + first + gap * i
        metrics.append({"kind": "rollout", "rollout_id": i, "time": t, "rollout/rewards": reward})
        metrics.append({"kind": "train", "rollout_id": i, "time": t - 0.5, "train/loss": 0.1})
    return metrics[::-1]


def test_summary_of_a_synthetic_run():
    rewards = [min(1.0, 0.02 * i) for i in range(80)]  # 0.5 at rollout 25, 0.9 at rollout 45
    rewards[60] = 0.7  # a dip of 1.0 - 0.7 after rollout 50
    records = bench_peer.rollout_records(synthetic_run(rewards), start=1000.0)
    assert [r[0] for r in records] == list(range(80))
    summary = bench_peer.summarize(records, wall_s=200.0)
    assert summary["reach"]["0.5"] == (25, pytest.approx(12.0 + 2.0 * 25))
    assert summary["reach"]["0.9"] == (45, pytest.approx(12.0 + 2.0 * 45))
    assert summary["median_s_per_rollout"] == pytest.approx(2.0)
    assert summary["first_done_s"] == pytest.approx(12.0)
    assert summary["last_reward"] == pytest.approx(statistics.fmean(rewards[-20:]))
    assert summary["max_drop"] == pytest.approx(0.3)
    assert summary["wall_s"] == 200.0 and summary["rollouts"] == 80
    short = bench_peer.summarize(bench_peer.rollout_records(synthetic_run([0.1, 0.2]), 1000.0), 30)
    assert short["reach"] == {"0.5": None, "0.7": None, "0.9": None}
    assert summary["response_tokens"] is None and short["response_tokens"] is None
    assert short["max_drop"] is None  # the run never got to rollout 50
    with pytest.raises(ValueError, match="no rollout records"):
        bench_peer.summarize([], 1.0)


def test_the_mean_response_length_is_read_from_the_rollout_records_and_shown():
    metrics = synthetic_run([0.1, 0.2, 0.3])
    assert bench_peer.response_tokens(metrics) is None  # not logged: no figure
    rollouts = [m for m in metrics if m["kind"] == "rollout"]
    for record, tokens in zip(rollouts, [10.0, 20.0, 45.0], strict=True):
        record["rollout/response_len_mean"] = tokens
    metrics.append({"kind": "train", "rollout/response_len_mean": 1000.0})  # not a rollout
    assert bench_peer.response_tokens(metrics) == pytest.approx(25.0)
    records = bench_peer.rollout_records(metrics, 1000.0)
    ember = bench_peer.summarize(records, 30.0, tokens=25.0)
    trl = bench_peer.summarize(records, 30.0, tokens=50.0)
    table = bench_peer.peer_table({"ember": [ember], "trl": [trl]})
    assert re.search(r"^mean response tokens per sample\s+25\.0\s+50\.0\s+0\.50$", table, re.M)


def test_metrics_file_is_read_as_ember_writes_it(tmp_path):
    lines = [json.dumps(m) for m in synthetic_run([0.1, 0.3])]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"kind": "roll')  # torn end
    records = bench_peer.rollout_records(bench_peer.read_metrics_file(tmp_path), 1000.0)
    assert records == [(0, 12.0, 0.1), (1, 14.0, 0.3)]


def test_peer_table_prints_spread_over_seeds_and_ratios():
    def run(wall, gap, reach_at):
        rewards = [0.95 if i >= reach_at else 0.1 for i in range(30)]
        records = bench_peer.rollout_records(synthetic_run(rewards, gap=gap), 1000.0)
        return bench_peer.summarize(records, wall)

    table = bench_peer.peer_table(
        {"ember": [run(300.0, 1.5, 10), run(310.0, 1.5, 12)], "trl": [run(100.0, 0.5, 20)]}
    )
    lines = {line[:34].strip(): line[34:].split() for line in table.splitlines()[1:]}
    assert table.splitlines()[0].split() == ["Ember", "TRL", "Ember/TRL"]
    assert lines["whole command, wall (s)"] == ["305.0", "+-", "7.1", "100.0", "3.05"]
    assert lines["first rollout with reward >= 0.9"] == ["11.0", "+-", "1.4", "20.0", "0.55"]
    assert lines["median seconds per rollout"] == ["1.500", "+-", "0.000", "0.500", "3.00"]
    in_turn = bench_peer.peer_table(
        {
            "ember": [run(300.0, 1.5, 10)],
            bench_peer.IN_TURN: [run(360.0, 2.0, 10)],
            "trl": [run(100.0, 0.5, 20)],
        }
    )
    assert in_turn.splitlines()[0].split() == [
        "Ember", "Ember", "in", "turn", "TRL", "Ember/TRL", "in", "turn/TRL"
    ]  # fmt: skip
    walls = {line[:34].strip(): line[34:].split() for line in in_turn.splitlines()[1:]}
    assert walls["whole command, wall (s)"] == ["300.0", "360.0", "100.0", "3.00", "3.60"]
    assert figures.fmt([1.0, None], 1) == "1.0 +- 0.0 (1/2)"
    assert figures.fmt([None], 1) == "- (0/1)" and figures.ratio(1.0, None) == "-"


# -- a run config's own work (--config) ---------------------------------------------------------

ARITH_YAML = """
run: {name: arith, num_rollouts: 40, save_interval: 20, keep_checkpoints: 1, eval_interval: 10,
      eval_sets: {arith: examples/data/arith-eval.jsonl}}
rollout: {rollout_batch_size: 8, n_samples_per_prompt: 4, temperature: 0.7,
          max_response_len: 64, async: false}
algorithm: {advantage_estimator: grpo, eps_clip: 0.2, eps_clip_high: 0.28, use_kl_loss: false,
            use_rollout_log_probs: true}
train:
  hf_load: models/smollm2
  num_steps_per_rollout: 1
  micro_batch_size: 8
  optimizer: {lr: 1.0e-5, lr_warmup_steps: 2, weight_decay: 0.0, clip_grad: 1.0}
engine: {kind: hf, hf: {dtype: float32, max_batch_size: 32}}
data: {prompt_data: examples/data/arith-train.jsonl}
reward: {reward_fn: math}
"""
"""A real model's run config of the kind `examples/smollm2-arith.yaml` is, kept here so that the
figures below do not follow that example's tuning."""


@pytest.fixture
def arith(tmp_path):
    path = tmp_path / "arith.yaml"
    path.write_text(ARITH_YAML)
    return str(path)


def arith_sets(config, rollouts=2, seed=1, user=()):
    return bench_peer.ember_overrides(None, None, None, rollouts, seed, list(user), config=config)


def test_config_arguments_take_the_configs_work_and_its_figures(arith):
    args = bench_peer.parse_args(["--config", arith, "--seeds", "1", "2"])
    assert args.config == arith and args.work == "arith" and args.task is None
    assert args.rollouts == 40  # the config's run.num_rollouts
    assert args.thresholds == [figures.Threshold(0.25, relative=True)]  # prompt data: its gain
    assert (args.first, args.last) == (10, 10)
    args = bench_peer.parse_args(
        ["--config", arith, "--thresholds", "0.6", "+0.1", "--first", "5", "--last", "3"]
    )
    assert args.thresholds == [figures.Threshold(0.6), figures.Threshold(0.1, relative=True)]
    assert (args.first, args.last) == (5, 3)
    toy = bench_peer.parse_args([])
    assert toy.thresholds == [
        figures.Threshold(0.5),
        figures.Threshold(0.7),
        figures.Threshold(0.9),
    ]
    assert toy.last == 20
    example = bench_peer.parse_args(["--config", str(ROOT / "examples/smollm2-arith.yaml")])
    assert example.config == "examples/smollm2-arith.yaml"  # as the commands (at the root) read it
    for bad in (
        ["--config", arith, "--task", "copy"],  # the toy task's flags do not apply
        ["--config", arith, "--thresholds", "high"],
        ["--config", arith, "--last", "0"],
        ["--config", "examples/absent.yaml"],
    ):
        with pytest.raises(SystemExit):
            bench_peer.parse_args(bad)


def test_config_overrides_turn_evaluation_off_and_keep_a_constant_schedule(arith):
    # The config evaluates every 10 rollouts (TRL would not) and its lr is constant after the
    # warm-up (no decay horizon to set); no data.toy keys for a config's own prompts.
    assert arith_sets(arith) == [
        "run.num_rollouts=2",
        "run.eval_interval=0",
        "rollout.seed=1",
        "train.seed=1",
        "data.seed=1",
    ]
    own = arith_sets(arith, seed=None, user=["run.eval_interval=5"])
    assert own == ["run.num_rollouts=2", "run.eval_interval=5"]
    config = bench_peer.load_run_config(arith_sets(arith), arith)
    assert config.run.eval_interval == 0 and config.data.prompt_data is not None


def test_config_maps_to_the_same_grpo_settings_model_prompts_and_reward(arith):
    mapping = bench_peer.trl_mapping(bench_peer.load_run_config(arith_sets(arith), arith), seed=1)
    expected = {
        "num_generations": 4,
        "per_device_train_batch_size": 8,  # micro-batches of 8 ...
        "gradient_accumulation_steps": 4,  # ... 4 of them in the one step over 8 x 4 samples
        "steps_per_generation": 4,
        "num_iterations": 1,
        "max_steps": 2,
        "temperature": 0.7,
        "top_k": 0,
        "max_completion_length": 64,
        "epsilon": 0.2,
        "epsilon_high": 0.28,
        "beta": 0.0,
        "loss_type": "grpo",  # Ember's per-sample token mean
        "scale_rewards": "group",
        "learning_rate": 1e-5,
        "warmup_steps": 2,
        "lr_scheduler_type": "cosine_warmup_with_min_lr",
        "lr_scheduler_kwargs": {"min_lr_rate": 1.0},  # constant after the warm-up
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "bf16": False,
        "use_cpu": True,
        "use_vllm": False,
        "seed": 1,
        "eval_strategy": "no",
        "save_steps": 20,
    }
    assert {k: mapping.kwargs[k] for k in expected} == expected
    assert mapping.steps_per_rollout == 1
    rows = {r.ember: r for r in mapping.rows}
    model = rows["train.hf_load"]
    assert (model.trl, model.trl_value) == ("model", "models/smollm2")
    assert rows["data.tokenizer_path"].trl_value == "models/smollm2"  # hf_load's own tokenizer
    assert rows["data.prompt_data"].trl == "train_dataset"
    assert "conversational" in rows["data.prompt_data"].note
    assert rows["reward.reward_fn"].trl_value == "Ember's math"
    assert "train.model (+ model_overrides)" not in rows and "data.toy" not in rows
    # One optimizer step per rollout: TRL runs no old-policy forward either.
    assert "neither" in rows["algorithm.use_rollout_log_probs"].note
    meta = bench_peer.trl_mapping(
        bench_peer.load_run_config([*arith_sets(arith), "data.metadata_key=meta"], arith)
    )
    assert any(r.ember == "data.metadata_key" and r.trl_value == "meta" for r in meta.rows)
    with pytest.raises(ValueError, match="reward_fn"):
        bench_peer.trl_mapping(
            bench_peer.load_run_config([*arith_sets(arith), "reward.reward_fn=nope"], arith)
        )


def test_the_smollm2_example_maps_with_its_own_values():
    import yaml

    example = "examples/smollm2-arith.yaml"
    raw = yaml.safe_load((ROOT / example).read_text())
    config = bench_peer.load_run_config(arith_sets(example), example)
    kwargs = bench_peer.trl_mapping(config).kwargs
    for key, trl in (("temperature", "temperature"), ("n_samples_per_prompt", "num_generations"),
                     ("max_response_len", "max_completion_length")):  # fmt: skip
        assert kwargs[trl] == raw["rollout"][key]
    assert kwargs["learning_rate"] == raw["train"]["optimizer"]["lr"]
    batch = kwargs["per_device_train_batch_size"] * kwargs["gradient_accumulation_steps"]
    assert batch * raw["train"]["num_steps_per_rollout"] == (
        raw["rollout"]["rollout_batch_size"] * raw["rollout"]["n_samples_per_prompt"]
    )
    rows = {r.ember: r for r in bench_peer.trl_mapping(config).rows}
    assert rows["train.hf_load"].trl_value == raw["train"]["hf_load"]
    assert rows["data.prompt_data"].ember_value == raw["data"]["prompt_data"]
    assert rows["reward.reward_fn"].ember_value == raw["reward"]["reward_fn"]


def test_trl_schedule_for_a_constant_lr_is_embers_step_for_step(arith):
    pytest.importorskip("trl", reason="TRL is in the `peer` dependency group only")
    import torch
    from transformers import get_scheduler

    sets = arith_sets(arith, rollouts=12)
    kwargs = bench_peer.trl_mapping(bench_peer.load_run_config(sets, arith)).kwargs
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=kwargs["learning_rate"])
    scheduler = get_scheduler(  # what transformers' Trainer builds from these fields
        kwargs["lr_scheduler_type"],
        optimizer,
        num_warmup_steps=kwargs["warmup_steps"],
        num_training_steps=kwargs["max_steps"],
        scheduler_specific_kwargs=kwargs["lr_scheduler_kwargs"],
    )
    trl = []
    for _ in range(kwargs["max_steps"]):
        trl.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    # Ember's rule by hand: step s < 2 takes lr * (s + 1) / 2, then lr.
    assert trl == pytest.approx([0.5e-5, 1e-5] + [1e-5] * 10, rel=1e-12)


def test_trl_rows_hold_the_prompt_files_messages_and_labels():
    from ember_rollout.data import PromptRecord, read_jsonl

    records = read_jsonl(ROOT / "examples/data/arith-train.jsonl")
    rows = peer_trl.trl_rows(records, chat=True)
    assert len(rows) == len(records) == 1000
    first = json.loads((ROOT / "examples/data/arith-train.jsonl").read_text().splitlines()[0])
    assert rows[0] == {"prompt": first["prompt"], "label": first["label"]}  # conversational
    text = [PromptRecord(prompt="copy 12", label="12", metadata={"k": 1})]
    assert peer_trl.trl_rows(text, chat=True) == [
        {"prompt": [{"role": "user", "content": "copy 12"}], "label": "12", "metadata": {"k": 1}}
    ]  # a text prompt under a chat template: one user message, as Ember's encoder makes it
    assert peer_trl.trl_rows(text, chat=False)[0]["prompt"] == "copy 12"


CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} = {% endfor %}"
    "{% if add_generation_prompt %}sort :{% endif %}"
)


def test_trl_prompt_ids_are_checked_against_embers_encoder():
    from ember_rollout.data import PromptEncoder, PromptRecord
    from ember_rollout.tokenizer import toy_tokenizer

    tokenizer = toy_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    encoder = PromptEncoder(tokenizer)
    records = [
        PromptRecord(prompt=[{"role": "system", "content": "copy"}, {"role": "user", "content":
                     "12"}], source="a.jsonl:1"),
        PromptRecord(prompt="sort 31", source="a.jsonl:2"),
    ]  # fmt: skip
    rows = peer_trl.trl_rows(records, chat=encoder.use_template)
    assert peer_trl.check_prompt_ids(rows, records, tokenizer, encoder) == 2
    # Rows made without the template (text as it is) would reach the model differently.
    plain = peer_trl.trl_rows(records[1:], chat=False)
    with pytest.raises(ValueError, match="a.jsonl:2: TRL's prompt ids"):
        peer_trl.check_prompt_ids(plain, records[1:], tokenizer, encoder)


SEEN: list = []


def _probe(sample):
    SEEN.append(sample)
    return float(len(sample.response))


def _group_probe(samples):
    SEEN.append([s.index for s in samples])
    return [float(i) for i in range(len(samples))]


def _register_probes():
    from ember_rollout.rewards import REWARDS, RewardSpec

    for name, fn, group in (("peer_bench_probe", _probe, False),
                            ("peer_bench_group_probe", _group_probe, True)):  # fmt: skip
        if name not in REWARDS:
            REWARDS.add(name, RewardSpec(fn, group))


def test_trl_reward_scores_ember_samples_of_conversational_completions():
    from ember_core.types import SampleStatus
    from ember_rollout.config import RewardConfig

    _register_probes()
    SEEN.clear()
    sink = []
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    reward = peer_trl.make_ember_reward(
        RewardConfig(reward_fn="peer_bench_probe"), {2}, group_size=2,
        encode=lambda prompt: [7, 8, 9], sink=sink,
    )  # fmt: skip
    scores = reward(
        prompts=[messages, messages],
        completions=[[{"role": "assistant", "content": "4"}],
                     [{"role": "assistant", "content": "four"}]],
        completion_ids=[[5, 2], [5, 6, 6]],
        label=["4", "4"],
        metadata=[{"id": 1}, {"id": 1}],
        trainer_state=None,
    )  # fmt: skip
    assert scores == [1.0, 4.0] and sink == [2.5]
    first, second = sorted(SEEN, key=lambda s: s.index)
    assert (first.response, first.label, first.metadata, first.prompt) == (
        "4", "4", {"id": 1}, messages
    )  # fmt: skip
    assert first.tokens == [7, 8, 9, 5, 2] and first.response_length == 2
    assert first.status == SampleStatus.COMPLETED  # ends with a stop id
    assert second.status == SampleStatus.TRUNCATED and second.group_index == 0
    # A group reward gets each prompt's completions together, in TRL's order.
    SEEN.clear()
    group = peer_trl.make_ember_reward(RewardConfig(reward_fn="peer_bench_group_probe"), {2},
                                       group_size=2)  # fmt: skip
    scores = group(completions=["1", "2", "3", "4"], completion_ids=[[1]] * 4,
                   label=["x"] * 4)  # fmt: skip
    assert scores == [0.0, 1.0, 0.0, 1.0] and sorted(SEEN) == [[0, 1], [2, 3]]


# -- thresholds, first and last means, memory -------------------------------------------------


def test_relative_threshold_first_and_last_means_and_memory():
    rewards = [0.2] * 10 + [0.3, 0.5, 0.44, 0.46, 0.6]  # first-10 mean 0.2: the level is 0.45
    memory = {"peak_all_mib": 3000.0, "processes": [{"pid": 9, "name": "x", "peak_mib": 1200.0}]}
    records = bench_peer.rollout_records(synthetic_run(rewards), start=1000.0)
    gain = figures.Threshold(0.25, relative=True)
    summary = figures.summarize(records, 50.0, thresholds=[gain, figures.Threshold(0.55)],
                                first=10, last=3, memory=memory)  # fmt: skip
    assert summary["levels"] == {"+0.25": pytest.approx(0.45), "0.55": 0.55}
    assert summary["reach"]["+0.25"] == (11, pytest.approx(12.0 + 2.0 * 11))
    assert summary["reach"]["0.55"] == (14, pytest.approx(12.0 + 2.0 * 14))
    assert figures.reach_of(summary, gain, 0) == 11 and figures.reach_of(summary, 0.55, 0) == 14
    assert summary["first_reward"] == pytest.approx(0.2)
    assert summary["last_reward"] == pytest.approx((0.44 + 0.46 + 0.6) / 3)
    assert (summary["peak_rss_mib"], summary["peak_process_rss_mib"]) == (3000.0, 1200.0)
    # Fewer rollouts than the first window: the level is over what there is; never reached.
    short = figures.summarize(records[:2], 5.0, thresholds=[gain], first=10, last=3)
    assert short["levels"]["+0.25"] == pytest.approx(0.45) and short["reach"]["+0.25"] is None
    assert short["peak_rss_mib"] is None
    for text, threshold in (("0.9", figures.Threshold(0.9)),
                            ("+0.25", figures.Threshold(0.25, relative=True))):  # fmt: skip
        assert figures.parse_threshold(text) == threshold
    for bad in ("", "+", "nan", "high"):
        with pytest.raises(ValueError, match="threshold"):
            figures.parse_threshold(bad)


def test_table_of_a_relative_threshold_with_first_last_and_memory():
    def run(wall, jump, peak):
        rewards = [0.1] * 10 + [0.1 if i < jump else 0.5 for i in range(10)]
        records = bench_peer.rollout_records(synthetic_run(rewards), 1000.0)
        memory = {"peak_all_mib": peak, "processes": [{"pid": 1, "name": "p", "peak_mib": peak}]}
        return figures.summarize(records, wall, thresholds=figures.RELATIVE_THRESHOLDS,
                                 first=10, last=10, memory=memory)  # fmt: skip

    rows = figures.peer_rows(figures.RELATIVE_THRESHOLDS, first=10, last=10)
    table = figures.peer_table({"ember": [run(300.0, 2, 4000.0)], "trl": [run(150.0, 4, 2000.0)]},
                               rows)  # fmt: skip
    lines = table.splitlines()
    width = len("first rollout with reward >= first-10 + 0.25") + 2
    cells = {line[:width].strip(): line[width:].split() for line in lines[1:]}
    assert lines[0].split() == ["Ember", "TRL", "Ember/TRL"]
    assert cells["first rollout with reward >= first-10 + 0.25"] == ["12.0", "14.0", "0.86"]
    assert cells["mean reward, first 10 rollouts"] == ["0.100", "0.100", "1.00"]
    assert cells["mean reward, last 10 rollouts"] == ["0.420", "0.340", "1.24"]
    assert cells["peak RSS, all its processes (MiB)"] == ["4000", "2000", "2.00"]
    assert cells["peak RSS, largest process (MiB)"] == ["4000", "2000", "2.00"]


@pytest.mark.slow  # spawns processes
def test_watch_command_samples_the_peak_rss_of_a_process_tree(tmp_path):
    # A parent holding ~50 MiB starts a child that holds ~150 MiB; both stay for 3 s.
    child = "b = bytearray(150 << 20); import time; time.sleep(3)"
    parent = (
        "import subprocess, sys; b = bytearray(50 << 20); "
        f"subprocess.run([sys.executable, '-c', {child!r}], check=True)"
    )
    code, start, wall, memory = figures.watch_command(
        [sys.executable, "-c", parent], cwd=tmp_path, log=tmp_path / "log", interval_s=0.2
    )
    assert code == 0 and wall >= 3.0 and start > 0
    peaks = [p["peak_mib"] for p in memory["processes"]]
    assert len(peaks) == 2 and peaks == sorted(peaks, reverse=True)
    assert 150 <= peaks[0] < 300 and 50 <= peaks[1] < peaks[0]  # the child, then the parent
    assert memory["peak_all_mib"] >= 200  # both at once
    assert memory["samples"] >= 10


# -- running in parts and the learning report ---------------------------------------------------


def test_kept_results_are_reused_only_for_the_same_overrides(tmp_path, monkeypatch):
    where = tmp_path / "copy-3-3" / "seed1"
    (where / "ember").mkdir(parents=True)
    records = bench_peer.rollout_records(synthetic_run([0.2, 0.95]), 1000.0)
    bench_peer.save_result(where / "ember", "ember", ["a=1"], ["cmd"], 40.0, records)
    ran = []

    def fake_ember(where_, sets, side="ember", config=None):
        ran.append(sets)
        return {"records": records, "wall_s": 50.0}

    monkeypatch.setattr(bench_peer, "run_ember", fake_ember)
    kept = bench_peer.run_pair(where, ["a=1"], 1, "ember", reuse=True)
    assert set(kept) == {"ember"}  # the in-turn loop only when asked
    assert ran == [] and kept["ember"]["wall_s"] == 40.0
    again = bench_peer.run_pair(where, ["a=2"], 1, "ember", reuse=True)
    assert ran == [["a=2"]] and again["ember"]["wall_s"] == 50.0


def test_keep_flag_reuses_the_runs_already_in_out(tmp_path, monkeypatch, arith):
    calls = []

    def fake_pair(where, sets, seed, only, **kw):
        calls.append(kw["reuse"])
        records = [(0, 10.0, 0.1), (1, 20.0, 0.3)]
        return {"ember": bench_peer.summarize(records, 30.0, **kw["figures"])}

    monkeypatch.setattr(bench_peer, "run_pair", fake_pair)
    monkeypatch.setattr(bench_peer, "trl_mapping", lambda *a, **k: [])
    monkeypatch.setattr(bench_peer, "format_mapping", lambda rows: "")
    base = ["--config", arith, "--only", "ember", "--out", str(tmp_path), "--rollouts", "2"]
    bench_peer.main(base)
    bench_peer.main([*base, "--keep"])
    assert calls == [False, True]
    curves = tmp_path / "arith" / "curves.png"  # the work is the config's file name
    assert curves.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_curves_draw_each_seed_and_the_mean_of_each_side(tmp_path, monkeypatch):
    import matplotlib.axes

    drawn = []
    real_plot = matplotlib.axes.Axes.plot

    def plot(self, xs, ys, *args, **kwargs):
        drawn.append((kwargs.get("label"), list(xs), list(ys)))
        return real_plot(self, xs, ys, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", plot)
    runs = {
        "ember": [{"rewards": [0.0, 0.5, 1.0]}, {"rewards": [0.2, 0.3]}],
        "trl": [{"rewards": [0.1, 0.1, 0.1]}],
    }
    bench_peer.plot_curves(runs, tmp_path / "c.png", "t")
    means = {label: ys for label, _, ys in drawn if label}
    assert means == {"Ember (mean of 2 seeds)": [0.1, 0.4], "TRL (mean of 1 seed)": [0.1] * 3}
    assert len(drawn) == 5 and (tmp_path / "c.png").is_file()


def test_task_specs():
    assert bench_learning.parse_task("copy:3") == ("copy", 3, 3)
    assert bench_learning.parse_task("reverse:2-4") == ("reverse", 2, 4)
    for bad in ("copy", "add:3", "copy:4-2", "copy:0"):
        with pytest.raises(ValueError, match="task"):
            bench_learning.parse_task(bad)
    args = bench_learning.parse_args(["--report"])
    assert args.tasks == [("copy", 3, 3), ("copy", 2, 4), ("reverse", 3, 3), ("sort", 3, 3),
                          ("reverse", 4, 4), ("sort", 4, 4), ("shift", 2, 2)]  # fmt: skip
    assert args.seeds == [1, 2, 3] and args.rollouts == 200
    with pytest.raises(SystemExit):
        bench_learning.parse_args(["--task", "copy"])  # the learning mode takes --tasks


def test_learning_report_from_results_run_in_parts(tmp_path, capsys):
    rollouts = 60
    task = ("copy", 2, 4)
    curves = {  # (side, seed) -> the rollout where the reward jumps to 0.92, or None
        ("ember", 1): 10, ("ember", 2): 20, ("ember", 3): None,
        ("trl", 1): 30, ("trl", 2): 30,
    }  # fmt: skip
    for (side, seed), jump in curves.items():
        sets = bench_peer.ember_overrides(*task, rollouts, seed, [])
        directory = bench_peer.task_dir(tmp_path, *task, seed) / side
        directory.mkdir(parents=True)
        rewards = [0.92 if jump is not None and i >= jump else 0.3 for i in range(rollouts)]
        records = bench_peer.rollout_records(synthetic_run(rewards), 1000.0)
        bench_peer.save_result(directory, side, sets, ["cmd"], 100.0, records)
    argv = ["--report", "--out", str(tmp_path), "--tasks", "copy:2-4", "--rollouts", "60"]
    tables = bench_learning.main(argv)
    out = capsys.readouterr().out
    found = tables[task]
    assert [s is not None for s in found["ember"]] == [True, True, True]
    assert [s is not None for s in found["trl"]] == [True, True, False]  # seed 3: not run yet
    rows = {line[:38].strip(): line[38:] for line in out.splitlines()}
    # Ember reaches 0.9 at rollouts 10 and 20 (2 of 3 seeds), TRL at 30 (both seeds it ran).
    assert rows["first rollout with reward >= 0.9"].split() == [
        "15.0", "+-", "7.1", "(2/3)", "30.0", "+-", "0.0", "0.50",
    ]  # fmt: skip
    ember_last = statistics.fmean([0.92, 0.92, 0.3])
    assert rows["mean reward, last 20 rollouts"].split()[0] == f"{ember_last:.3f}"
    assert "TRL last-20 by seed: 1: 0.920, 2: 0.920, 3: -" in out
    assert "Ember first >= 0.7 by seed: 1: 10, 2: 20, 3: None" in out
    assert rows["first rollout with reward >= 0.7"].split()[:4] == ["15.0", "+-", "7.1", "(2/3)"]
    assert (tmp_path / "copy-2-4.png").is_file()
    bench_learning.main([*argv, "--markdown"])
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| copy")]
    assert table[1] == (
        "| copy 2-4 | first >= 0.5 | 15.0 +- 7.1 (2/3) | 30.0 +- 0.0 | 10, 20, never "
        "| 30, 30, not run |"
    )
    assert math.isclose(found["ember"][2]["last_reward"], 0.3)
    # Other overrides (here: more rollouts) do not pick up these results.
    tables = bench_learning.main([*argv[:-1], "80"])
    assert all(s is None for side in tables[task].values() for s in side)
    # An Ember variant in its own directory, against the TRL runs made without --set.
    variant = tmp_path / "variant"
    sets = bench_peer.ember_overrides(*task, rollouts, 1, ["train.shuffle_mini_batches=true"])
    directory = bench_peer.task_dir(variant, *task, 1) / "ember"
    directory.mkdir(parents=True)
    records = bench_peer.rollout_records(synthetic_run([0.3] * 5 + [0.92] * 55), 1000.0)
    bench_peer.save_result(directory, "ember", sets, ["cmd"], 100.0, records)
    found = bench_learning.main(["--report", "--out", str(variant), "--trl-out", str(tmp_path),
                                 "--tasks", "copy:2-4", "--rollouts", "60", "--seeds", "1", "2",
                                 "--set", "train.shuffle_mini_batches=true"])[task]  # fmt: skip
    assert [s is not None for s in found["ember"]] == [True, False]
    assert [figures.reach_of(s, 0.9, 0) for s in found["trl"]] == [30, 30]
