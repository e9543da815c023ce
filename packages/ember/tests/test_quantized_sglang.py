"""`engine.quantization` with SGLang engines: what sglang 0.5.23 cannot serve or update is one
line before Ray starts (`ember.config.check_sglang_quantization`, `check_quantized_sources`),
attached servers of another quantization included (asked over HTTP, as the real server answers:
the in-process fake of `packages/rollout/tests/sglang_fake.py`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "rollout" / "tests"))

from sglang_fake import FakeSGLang, serving  # noqa: E402
from sglang_fake_model import ServedModel, write_checkpoint  # noqa: E402

from ember.cli import USAGE_ERROR, main  # noqa: E402
from ember.config import load_config  # noqa: E402
from ember_core.quant import QuantSpec  # noqa: E402

# tiny-moe (hidden 64, 4 heads and 2 key/value heads of 16, experts of 32) in blocks of 32.
FP8 = ["engine.quantization=fp8_block", "engine.quantization_group_size=32"]
INT4 = [*FP8[1:], "engine.quantization=int4_w4a16", "engine.quantization_targets=experts"]
GPU = ["engine.kind=sglang", "engine.sglang.device=cuda", "engine.sglang.dtype=bfloat16"]


@pytest.fixture(autouse=True)
def _environment(monkeypatch):
    monkeypatch.setenv("EMBER_VERBOSE", "0")


def argv(*overrides: str) -> list[str]:
    return ["train", *(arg for o in overrides for arg in ("--set", o))]


def refused(*overrides: str) -> str:
    with pytest.raises(ValueError) as caught:
        load_config("default", overrides=list(overrides))
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_quantized_sglang_runs_the_servers_can_serve_and_update_load():
    for scheme in (FP8, INT4):
        config, _ = load_config("default", overrides=[*GPU, *scheme])
        assert config.engine.quant_spec().group_size == 32


@pytest.mark.parametrize(
    ("scheme", "device", "why", "kernel"),
    [
        (FP8, "cpu", "engine.sglang.device=cpu", "fp8.py:826-829"),
        (INT4, "cpu", "engine.sglang.device=cpu", "compressed_tensors.py:1090-1091"),
        (FP8, "auto", "ray.gpus_per_engine=0", "fp8.py:826-829"),
    ],
)
def test_quantized_sglang_servers_on_cpu_are_one_line_before_ray(
    capsys, nothing_starts, scheme, device, why, kernel
):
    assert (
        main(argv("engine.kind=sglang", f"engine.sglang.device={device}", *scheme)) == USAGE_ERROR
    )
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    name = "int4_w4a16" if scheme is INT4 else "fp8_block"
    assert lines[0].startswith(
        f"ember train: error: engine.quantization={name} with SGLang servers on CPU ("
    )
    assert why in lines[0] and "sglang 0.5.23 srt/layers/quantization/" in lines[0]
    assert kernel in lines[0] and "engine.sglang.device=cuda" in lines[0]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            [*GPU, *INT4, "engine.quantization_targets=linear"],
            "engine.quantization=int4_w4a16 with engine.quantization_targets=linear on SGLang: "
            "sglang 0.5.23 repacks dense compressed-tensors INT4 layers",
        ),
        (
            [*GPU, *FP8, "engine.sglang.tp_size=2"],
            "engine.quantization=fp8_block on SGLang (engine.sglang.tp_size=2): "
            "model.layers.0.mlp.experts.0.down_proj (64x32, tp_size 2): The output_size of "
            "gate's and up's weight = 16 is not divisible by weight quantization block_n = 32. "
            "(sglang 0.5.23 srt/layers/quantization/fp8.py:1588-1593)",
        ),
        (
            [*GPU, *INT4, "engine.sglang.tp_size=2"],
            "w13's size_n (2 x intermediate per rank) 32 is not divisible by 64 (sglang 0.5.23 "
            "kernels/jit/csrc/gemm/marlin/gptq_marlin_repack.cuh:305-316)",
        ),
        (
            [*GPU, *FP8, "engine.sglang.dtype=auto"],
            "engine.quantization=fp8_block with engine.sglang.dtype=auto and train.dtype=float32",
        ),
        (
            [*GPU, *INT4, "engine.sglang.dtype=float32"],
            "Marlin's MoE GEMM takes float16 and bfloat16 activations only",
        ),
    ],
)
def test_what_sglang_cannot_update_is_refused_in_one_line(overrides, expected):
    assert expected in refused(*overrides)


@pytest.mark.parametrize(
    ("run", "expected"),
    [
        ([], "engine.quantization=null, but the attached SGLang server {url} serves "),
        (
            [*FP8, "engine.sglang.dtype=bfloat16"],
            "engine.quantization=fp8_block with engine.quantization_group_size=32 and "
            "engine.quantization_targets=linear, but the attached SGLang server {url} serves "
            "group size 128",
        ),
    ],
)
def test_an_attached_server_of_another_quantization_is_one_line_before_ray(
    tmp_path, capsys, nothing_starts, run, expected
):
    export = write_checkpoint(tmp_path / "fp8", QuantSpec("fp8_block", 128, "linear"))
    fake = FakeSGLang(model=ServedModel.launch(export))
    with serving(fake) as url:
        overrides = ["engine.kind=sglang", f"engine.sglang.urls=[{url}]", *run]
        assert main(argv(*overrides)) == USAGE_ERROR
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert expected.format(url=url) in lines[0]
    assert f"its checkpoint {export / 'config.json'} says quant_method='fp8'" in lines[0]


def test_a_quantized_export_is_no_checkpoint_to_train_from_but_a_rollout_only_server_serves_it(
    tmp_path,
):
    from ember.config import check_quantized_sources

    export = str(write_checkpoint(tmp_path / "fp8", QuantSpec("fp8_block", 128, "linear")))
    config, _ = load_config("default", overrides=["engine.kind=sglang"])
    config.train.hf_load = export
    with pytest.raises(ValueError) as caught:
        check_quantized_sources(config)
    assert str(caught.value) == (
        f"train.hf_load={export!r}: a quantized checkpoint (quantization_config quant_method="
        "'fp8', as Ember exports for SGLang), which the trainer cannot load; start from a "
        "full-precision checkpoint (a run's checkpoint through `ember convert`)"
    )
    config.run.rollout_only = True  # the servers serve it as it is: its scheme must be the run's
    with pytest.raises(
        ValueError,
        match=r"\(fp8_block, group size 128, targets linear\), and "
        r"engine.quantization=null asks for full precision",
    ):
        check_quantized_sources(config)
    config.engine.quantization = "fp8_block"
    check_quantized_sources(config)
    config.engine.kind = "hf"
    with pytest.raises(ValueError, match="which the embedded engine cannot load"):
        check_quantized_sources(config)
