"""A prompt longer than the model's context is refused before any actor starts, in one line."""

from __future__ import annotations

import json
import time

import pytest
import ray

from ember.cli import USAGE_ERROR, main
from ember_rollout.families import write_family_checkpoint


@pytest.fixture
def nothing_starts(monkeypatch):
    """Fail the test if the run's actors start: under Ray, or in this process (the default
    config's runtime)."""
    from ember.runtimes import LocalRuntime, RayRuntime

    monkeypatch.setenv("EMBER_VERBOSE", "0")

    def refuse(*args, **kwargs):
        raise AssertionError("the run's runtime was started")

    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(LocalRuntime, "start", refuse)
    monkeypatch.setattr(RayRuntime, "start", refuse)


@pytest.fixture(scope="module")
def short_context_model(tmp_path_factory):
    """A tiny checkpoint with the toy tokenizer (digits one token each), context 40 tokens."""
    return write_family_checkpoint(
        tmp_path_factory.mktemp("model"), "qwen3_moe", max_position_embeddings=40
    )


def _prompts(tmp_path, *prompts):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "label": "1"}) + "\n" for p in prompts))
    return path


def _train(capsys, *settings):
    start = time.monotonic()
    status = main(["train", *(arg for s in settings for arg in ("--set", s))])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    return status, lines[0], time.monotonic() - start


def test_a_prompt_longer_than_the_context_names_itself_and_the_limit(
    tmp_path, capsys, nothing_starts, short_context_model
):
    path = _prompts(tmp_path, "copy 12 =", "copy " + "1" * 31 + " =")
    status, line, seconds = _train(
        capsys,
        f"train.hf_load={short_context_model}",
        f"data.prompt_data={path}",
        "rollout.max_response_len=8",
        "run.eval_interval=0",
    )
    assert status == USAGE_ERROR
    # 33 tokens ("copy", 31 digits, "=") against 40 - 8.
    assert line.startswith(f"ember train: error: {path}:2: the prompt has 33 tokens, more than 32")
    assert "context 40" in line and "rollout.max_response_len=8" in line
    assert "data.overlong_prompt" in line
    assert seconds < 10


def test_prompts_that_fit_pass_and_the_explicit_limit_is_named(
    tmp_path, capsys, nothing_starts, short_context_model
):
    from ember.config import check_inputs, load_config

    path = _prompts(tmp_path, "copy 12 =", "copy " + "1" * 20 + " =")
    settings = [f"train.hf_load={short_context_model}", f"data.prompt_data={path}"]
    config, _ = load_config(None, overrides=[*settings, "rollout.max_response_len=8"])
    check_inputs(config)  # 22 tokens fit in 40 - 8
    config, _ = load_config(None, overrides=[*settings, "data.max_prompt_len=10"])
    with pytest.raises(
        ValueError,
        match=r"prompts.jsonl:2: the prompt has 22 tokens, more "
        r"than 10 \(data.max_prompt_len\)",
    ):
        check_inputs(config)
    config, _ = load_config(
        None, overrides=[*settings, "data.max_prompt_len=10", "data.overlong_prompt=drop"]
    )
    check_inputs(config)  # the policy allows it


def test_the_run_tokenizer_is_hf_loads_own_unless_one_is_named(tmp_path, short_context_model):
    from ember.config import load_config, run_tokenizer_path

    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((short_context_model / "config.json").read_text())
    cases = {
        (f"train.hf_load={short_context_model}",): str(short_context_model),
        (f"train.hf_load={bare}",): None,  # no tokenizer there: the toy one
        (f"train.hf_load={bare}", f"data.tokenizer_path={tmp_path}"): str(tmp_path),
        (): None,
    }
    for overrides, expected in cases.items():
        config, _ = load_config(None, overrides=list(overrides))
        assert run_tokenizer_path(config) == expected, overrides
