"""`ember train` reports bad input before any actor starts (in this process or under Ray), and
any actor's error, as one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from ember_runs import ember_command
from ray.exceptions import ActorDiedError, RayTaskError

from ember.cli import RUN_ERROR, USAGE_ERROR, actor_error, main


@pytest.fixture(autouse=True)
def _environment(monkeypatch):
    """`main` sets these for the processes it starts; keep them from leaking into other tests."""
    monkeypatch.setenv("EMBER_VERBOSE", "0")
    monkeypatch.setenv("RAY_IGNORE_UNHANDLED_ERRORS", "1")


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ember train: error: ")
    return lines[0].removeprefix("ember train: error: ")


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        (['{"prompt": "a", "label": "1"}', "{not json"], ":2: malformed JSON"),
        (['{"prompt": "a", "label": "1"}', '{"prompt": "b"}'], ":2: no 'label' key (keys: prompt)"),
        (["", "[1, 2]"], ":2: expected a JSON object, got list"),
        (['{"prompt": 3, "label": "1"}'], ":1: 'prompt' must be a string or a non-empty list"),
    ],
)
def test_bad_prompt_lines_fail_before_ray(tmp_path, capsys, nothing_starts, lines, expected):
    path = _write(tmp_path / "prompts.jsonl", lines)
    run_dir = tmp_path / "run"
    argv = ["train", "--set", f"data.prompt_data={path}", "--set", f"run.dir={run_dir}"]
    assert main(argv) == USAGE_ERROR
    assert _one_error_line(capsys).startswith(f"{path}{expected}")
    assert not run_dir.exists()  # the driver never ran


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ("data.prompt_data=/no/such/prompts.jsonl", "data.prompt_data='/no/such/prompts.jsonl'"),
        ("data.tokenizer_path=/no/such/dir", "data.tokenizer_path='/no/such/dir': no such dir"),
        ("train.hf_load=/no/such/model", "train.hf_load='/no/such/model': no such directory"),
        ("train.hf_load=/", "train.hf_load='/': not a transformers checkpoint"),
        (
            "reward.reward_fn=mathh",
            # The registered names follow, sorted; other tests may register more of them in
            # this process (test_rewards.py checks the list itself).
            "reward.reward_fn: unknown reward function 'mathh'; known: ",
        ),
        ("reward.reward_fn=no_such_module:score", "cannot import module 'no_such_module'"),
    ],
)
def test_bad_paths_and_reward_names_fail_before_ray(capsys, nothing_starts, setting, expected):
    assert main(["train", "--set", setting]) == USAGE_ERROR
    assert expected in _one_error_line(capsys)


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        (
            ["run.eval_interval=5", "run.eval_sets.held=/no/such/held.jsonl"],
            "run.eval_sets.held='/no/such/held.jsonl': no such file",
        ),
        (["run.eval_sets.bad name=toy"], "run.eval_sets.bad name='toy': expected a set name"),
        (["run.eval_samples_per_prompt=0"], "run.eval_samples_per_prompt=0: expected >= 1"),
    ],
)
def test_bad_eval_sets_fail_before_ray(capsys, nothing_starts, settings, expected):
    argv = ["train"] + [arg for setting in settings for arg in ("--set", setting)]
    assert main(argv) == USAGE_ERROR
    assert expected in _one_error_line(capsys)


def test_yaml_syntax_error_names_file_line_and_column(tmp_path, capsys, nothing_starts):
    path = tmp_path / "run.yaml"
    path.write_text("run:\n  name: x\nrollout:\n  temperature: [1.0, 2.0\n")
    assert main(["train", str(path)]) == USAGE_ERROR
    line = _one_error_line(capsys)
    assert line.startswith(f"{path}:5:1: expected ',' or ']', but got '<stream end>'")
    assert "(while parsing a flow sequence at line 4, column 16)" in line


def test_tab_indentation_names_its_position(tmp_path, capsys, nothing_starts):
    path = tmp_path / "run.yaml"
    path.write_text("run:\n\tname: x\n")
    assert main(["train", str(path)]) == USAGE_ERROR
    assert _one_error_line(capsys).startswith(f"{path}:2:1: found character '\\t'")


def test_tensor_parallel_the_checkpoints_heads_do_not_split_fails_before_ray(
    tmp_path, capsys, nothing_starts
):
    from ember_megatron_backend.hf_layout import hf_config
    from ember_megatron_backend.model import ModelConfig

    smollm2_heads = dict(hidden_size=576, num_attention_heads=9, num_query_groups=3, head_dim=64)
    model = tmp_path / "llama"
    hf_config(ModelConfig.preset("tiny-llama").replace(**smollm2_heads)).save_pretrained(model)
    (model / "model.safetensors").write_bytes(b"")  # never read: the shape is refused first
    argv = ["train", "--set", f"train.hf_load={model}", "--set", "train.model=null"]
    argv += ["--set", "train.parallel.tensor_parallel=2", "--set", f"run.dir={tmp_path / 'run'}"]
    assert main(argv) == USAGE_ERROR
    assert _one_error_line(capsys) == (
        "train.parallel.tensor_parallel=2 must divide num_attention_heads=9 and "
        "num_query_groups=3 (each tensor-parallel rank holds whole heads)"
    )
    assert not (tmp_path / "run").exists()


def test_a_tied_mixtral_on_sglang_fails_before_ray(tmp_path, capsys, nothing_starts):
    argv = ["train", "--set", "train.model=tiny-mixtral"]
    argv += ["--set", "train.model_overrides.tie_word_embeddings=true"]
    argv += ["--set", "engine.kind=sglang", "--set", "engine.sglang.urls=[http://127.0.0.1:1]"]
    argv += ["--set", f"run.dir={tmp_path / 'run'}"]
    assert main(argv) == USAGE_ERROR
    assert _one_error_line(capsys).startswith(
        "train: a mixtral model with tie_word_embeddings=true cannot be served by "
        "engine.kind=sglang: SGLang's mixtral never ties its output layer"
    )
    assert not (tmp_path / "run").exists()


def test_bad_plugin_section_fails_before_ray(capsys, nothing_starts):
    argv = ["train", "--plugins", "ci_kl_checker", "--set", "ci_kl_checker.nope=1"]
    assert main(argv) == USAGE_ERROR
    assert "ci_kl_checker.nope: unknown key" in _one_error_line(capsys)


@pytest.mark.slow  # a CLI subprocess
def test_bad_prompt_file_from_the_command_line_is_one_line(tmp_path):
    """The real entry point: stderr holds the one error line and nothing else."""
    path = _write(tmp_path / "prompts.jsonl", [json.dumps({"prompt": "a"})])
    run = subprocess.run(
        [sys.executable, "-m", "ember.cli", "train", "--set", f"data.prompt_data={path}"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert run.returncode == USAGE_ERROR
    assert run.stderr == f"ember train: error: {path}:1: no 'label' key (keys: prompt)\n"
    assert not (tmp_path / "runs").exists()


# --- errors raised inside Ray actors ------------------------------------------------------------


def _task_error(cause: Exception, method: str, *, dual: bool = True) -> RayTaskError:
    """The exception `ray.get` raises for `cause` raised in actor method `method` (`dual`), or
    the plain RayTaskError Ray wraps in an ActorDiedError when `method` is `__init__`."""
    try:
        raise cause
    except Exception:
        import traceback

        trace = traceback.format_exc()
    error = RayTaskError(method, trace, cause, proctitle=f"ray::{method}", pid=1, ip="127.0.0.1")
    return error.as_instanceof_cause() if dual else error


def test_actor_value_error_is_its_message():
    error = _task_error(ValueError("prompts.jsonl:3: malformed JSON"), "RolloutEngine.generate")
    assert isinstance(error, ValueError)  # Ray's instance is both, as the CLI sees it
    assert actor_error(error) == ("prompts.jsonl:3: malformed JSON", USAGE_ERROR)


def test_other_actor_errors_name_type_and_method():
    error = _task_error(KeyError("train/loss"), "TrainRank.train")
    assert actor_error(error) == ("KeyError: 'train/loss' (in TrainRank.train)", RUN_ERROR)


def test_failed_actor_creation_is_the_last_traceback_line():
    cause = _task_error(
        ValueError("a.jsonl:2: no 'label' key"), "RolloutEngine.__init__", dual=False
    )
    died = ActorDiedError(cause)
    assert died.actor_init_failed
    assert actor_error(died) == ("a.jsonl:2: no 'label' key", USAGE_ERROR)
    crash = ActorDiedError(_task_error(RuntimeError("boom"), "TrainRank.__init__", dual=False))
    assert actor_error(crash) == ("RuntimeError: boom (while starting an actor)", RUN_ERROR)


def test_actor_error_is_one_line_and_whole_with_verbose(monkeypatch, capsys):
    error = _task_error(RuntimeError("collective timed out"), "TrainRank.train")

    def fails(args):
        raise error

    monkeypatch.setattr("ember.cli.cmd_train", fails)
    assert main(["train"]) == RUN_ERROR
    line = _one_error_line(capsys)
    assert line == "RuntimeError: collective timed out (in TrainRank.train)"
    with pytest.raises(RuntimeError, match="collective timed out"):
        main(["-v", "train"])  # -v: the whole exception, actor traceback included


@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["in-process", "ray"])
def test_error_inside_an_actor_is_one_line(tmp_path, runtime):
    """A checkpoint of another architecture fails in the training actor, once the run's
    runtime started: raised in this process by the default config's in-process actor, and
    across processes, wrapped by Ray, under Ray."""
    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (model / "model.safetensors").write_bytes(b"")  # read only once the shape is accepted
    run = ember_command(
        [
            "train",
            "--set",
            f"train.hf_load={model}",
            "--set",
            "train.model=null",  # the shape comes from the checkpoint's config.json
            "--set",
            f"run.dir={tmp_path / 'run'}",
            "--set",
            f"ray.enabled={'true' if runtime == 'ray' else 'auto'}",
        ],
    )  # in this process in-process (`ember_runs`), as a command of its own under Ray
    assert run.returncode == USAGE_ERROR, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if "error" in line.lower()]
    assert errors == [
        "ember train: error: unsupported model_type 'gpt2'; supported: qwen3_moe, qwen3, "
        "deepseek_v3, glm4_moe, qwen2_moe, mixtral, llama"
    ], run.stderr[-3000:]


def test_config_given_as_an_option_reads_like_the_argument(tmp_path, capsys, nothing_starts):
    path = _write(tmp_path / "run.yaml", ["rollout:", "  temperature: -1"])
    assert main(["train", "--config", str(path)]) == USAGE_ERROR
    assert "rollout.temperature=-1.0: expected a finite number > 0" in _one_error_line(capsys)
    assert main(["train", str(path), "--config", str(path)]) == USAGE_ERROR
    assert _one_error_line(capsys).startswith("two configs,")


def test_sglang_without_its_extra_fails_before_ray_with_the_install_command(
    capsys, nothing_starts, monkeypatch
):
    from ember_rollout import sglang_cpu

    monkeypatch.setattr(sglang_cpu, "sglang_installed", lambda: False)  # as without the extra
    assert main(["train", "--set", "engine.kind=sglang"]) == USAGE_ERROR
    error = _one_error_line(capsys)
    assert "engine.kind=sglang launches SGLang servers, but sglang is not installed" in error
    assert "uv sync --extra sglang" in error


def test_sglang_servers_with_untempered_log_probs_fail_before_ray(
    capsys, nothing_starts, monkeypatch
):
    from ember_rollout import sglang_cpu

    monkeypatch.setattr(sglang_cpu, "sglang_installed", lambda: True)
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "true")
    assert main(["train", "--set", "engine.kind=sglang"]) == USAGE_ERROR
    error = _one_error_line(capsys)
    assert error.startswith("SGLANG_RETURN_ORIGINAL_LOGPROB=true: "), error
