"""Launched SGLang servers in float32 on GPUs: an attention backend that computes in float32,
in IEEE float32, and a tripwire on the installed sglang's and Triton's rules behind that."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from ember_rollout.config import SGLangEngineConfig
from ember_rollout.sglang_engine import SGLangEngine
from ember_rollout.sglang_launch import (
    FP32_ATTENTION_BACKENDS,
    TRITON_FP32_ENV,
    gpu_server_env,
)


def command(dtype: str, *server_args: str) -> list[str]:
    config = SGLangEngineConfig(
        model_path="/models/m", device="cuda", dtype=dtype, server_args=list(server_args)
    )
    engine = SGLangEngine(config)
    engine.partial_rollouts = False
    return engine.server_command(30000)


def value(cmd: list[str], flag: str) -> str | None:
    return cmd[cmd.index(flag) + 1] if flag in cmd else None


def test_float32_servers_run_an_fp32_attention_backend_in_ieee_float32(monkeypatch):
    assert value(command("float32"), "--attention-backend") == "triton"
    kept = command("float32", "--attention-backend", "torch_native")
    assert kept.count("--attention-backend") == 1
    assert value(kept, "--attention-backend") == "torch_native"
    assert "--attention-backend" not in command("bfloat16")  # sglang chooses

    monkeypatch.delenv(TRITON_FP32_ENV, raising=False)
    fp32 = gpu_server_env(SGLangEngineConfig(device="cuda", dtype="float32"))
    assert fp32 is not None and fp32[TRITON_FP32_ENV] == "ieee"
    assert gpu_server_env(SGLangEngineConfig(device="cuda", dtype="bfloat16")) is None


@pytest.mark.parametrize(
    "args",
    [
        ("--attention-backend", "fa3"),
        ("--attention-backend=flashinfer",),
        ("--decode-attention-backend", "fa3"),
        ("--prefill-attention-backend=trtllm_mha",),
    ],
)
def test_float32_with_an_attention_backend_that_refuses_it_is_refused_in_one_line(args):
    with pytest.raises(ValueError, match=r"dtype=float32.*attention-backend") as error:
        command("float32", *args)
    assert "\n" not in str(error.value)


def test_a_tf32_triton_default_is_refused_for_float32_servers(monkeypatch):
    monkeypatch.setenv(TRITON_FP32_ENV, "tf32")
    with pytest.raises(ValueError, match=f"{TRITON_FP32_ENV}=tf32"):
        gpu_server_env(SGLangEngineConfig(device="cuda", dtype="float32"))


# -- the rules upstream, as installed --------------------------------------------------------


def source(package: str, relative: str) -> str:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        pytest.skip(f"{package} is not installed (the sglang extra)")
    return (Path(spec.origin).parent / relative).read_text()


def function(text: str, name: str) -> ast.FunctionDef:
    tree = ast.parse(text)
    found = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name]
    assert len(found) == 1, f"{name} is gone or doubled upstream: read its backend choice again"
    return found[0]


def test_tripwire_sglang_chooses_the_attention_backend_without_the_dtype():
    # sglang 0.5.23 arg_groups/model_override_base.py `get_default_attn_backend`: FA3 on
    # Hopper (trtllm_mha on SM100, flashinfer elsewhere) whatever the dtype; FA3, trtllm_mha
    # and flashinfer take fp16/bf16 only. If this changes, revisit `FP32_ATTENTION_BACKENDS`.
    choose = function(
        source("sglang", "srt/arg_groups/model_override_base.py"), "get_default_attn_backend"
    )
    names = {n.id for n in ast.walk(choose) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(choose) if isinstance(n, ast.Attribute)}
    assert not {n for n in names if "dtype" in n.lower()}, "sglang now reads the dtype"
    returned = {
        n.value.value
        for n in ast.walk(choose)
        if isinstance(n, ast.Return) and isinstance(n.value, ast.Constant)
    }
    assert {"fa3", "flashinfer", "triton", "trtllm_mha"} <= returned
    choices = source("sglang", "srt/arg_groups/choices.py")
    listed = ast.literal_eval(
        next(
            n.value
            for n in ast.walk(ast.parse(choices))
            if isinstance(n, ast.Assign) and n.targets[0].id == "ATTENTION_BACKEND_CHOICES"
        )
    )
    assert set(FP32_ATTENTION_BACKENDS) <= set(listed)


def test_tripwire_triton_multiplies_float32_in_tf32_unless_told():
    # triton 3.8 language/core.py `dot`: input_precision defaults to knobs.language.fp32_default
    # (TRITON_F32_DEFAULT), else "tf32" where the GPU has it; sglang's triton attention kernels
    # (kernels/ops/attention/decode_attention.py, extend_attention.py) pass none.
    core = source("triton", "language/core.py")
    assert 'knobs.language.fp32_default or ("tf32"' in core
    knobs = source("triton", "knobs.py")
    assert f'fp32_default: env_opt_str = env_opt_str("{TRITON_FP32_ENV}")' in knobs
    for kernel in ("decode_attention.py", "extend_attention.py"):
        text = source("sglang", f"kernels/ops/attention/{kernel}")
        assert "input_precision" not in text and "allow_tf32" not in text
