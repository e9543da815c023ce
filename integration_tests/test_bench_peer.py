"""The peer benchmarks' own parts, without TRL: arguments, the Ember -> TRL hyper-parameter
mapping, TRL's reward function, the summaries of a run's records and the learning report."""

from __future__ import annotations

import json
import math
import statistics

import pytest
from tools_loader import load_tool

bench_peer = load_tool("bench_peer")
bench_learning = load_tool("bench_learning")  # imports bench_peer, registered just above

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
    sink = []
    reward = bench_peer.make_toy_reward(eos, sink)
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
    assert short["reach"] == {"0.5": None, "0.9": None}
    assert short["max_drop"] is None  # the run never got to rollout 50
    with pytest.raises(ValueError, match="no rollout records"):
        bench_peer.summarize([], 1.0)


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
    assert bench_peer.fmt([1.0, None], 1) == "1.0 +- 0.0 (1/2)"
    assert bench_peer.fmt([None], 1) == "- (0/1)" and bench_peer.ratio(1.0, None) == "-"


# -- running in parts and the learning report ---------------------------------------------------


def test_kept_results_are_reused_only_for_the_same_overrides(tmp_path, monkeypatch):
    where = tmp_path / "copy-3-3" / "seed1"
    (where / "ember").mkdir(parents=True)
    records = bench_peer.rollout_records(synthetic_run([0.2, 0.95]), 1000.0)
    bench_peer.save_result(where / "ember", "ember", ["a=1"], ["cmd"], 40.0, records)
    ran = []

    def fake_ember(where_, sets, side="ember"):
        ran.append(sets)
        return {"records": records, "wall_s": 50.0}

    monkeypatch.setattr(bench_peer, "run_ember", fake_ember)
    kept = bench_peer.run_pair(where, ["a=1"], 1, "ember", reuse=True)
    assert set(kept) == {"ember"}  # the in-turn loop only when asked
    assert ran == [] and kept["ember"]["wall_s"] == 40.0
    again = bench_peer.run_pair(where, ["a=2"], 1, "ember", reuse=True)
    assert ran == [["a=2"]] and again["ember"]["wall_s"] == 50.0


def test_task_specs():
    assert bench_learning.parse_task("copy:3") == ("copy", 3, 3)
    assert bench_learning.parse_task("reverse:2-4") == ("reverse", 2, 4)
    for bad in ("copy", "add:3", "copy:4-2", "copy:0"):
        with pytest.raises(ValueError, match="task"):
            bench_learning.parse_task(bad)
    args = bench_learning.parse_args(["--report"])
    assert args.tasks == [("copy", 3, 3), ("copy", 2, 4), ("reverse", 3, 3), ("sort", 3, 3)]
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
    assert math.isclose(found["ember"][2]["last_reward"], 0.3)
    # Other overrides (here: more rollouts) do not pick up these results.
    tables = bench_learning.main([*argv[:-1], "80"])
    assert all(s is None for side in tables[task].values() for s in side)
