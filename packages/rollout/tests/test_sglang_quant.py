"""Quantized weights for SGLang: the exported `quantization_config`, sglang 0.5.23's loader rules
as CPU checks (`ember_rollout.sglang_loader_rules`), pushes through a fake server launched from a
quantized checkpoint, attached servers' quantization, and the launch command."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from sglang_fake import FakeSGLang, run
from sglang_fake_model import (
    ATTN,
    HF_CONFIG,
    L0,
    SHAPES,
    ServedModel,
    config,
    load_checkpoint,
    pushed,
    write_checkpoint,
)

from ember_core import quant
from ember_core.quant import QuantSpec
from ember_rollout import sglang_quant
from ember_rollout.config import SGLangEngineConfig
from ember_rollout.engine import EngineError
from ember_rollout.sglang_engine import SGLangEngine
from ember_rollout.sglang_loader_rules import check_push, check_session, check_sglang_quantized
from ember_rollout.sglang_quant import LoaderRuleError, quantization_config, table
from ember_rollout.sglang_weights import serialize_flattened_bucket

FP8 = QuantSpec("fp8_block", 128, "linear")
FP8_EXPERTS = QuantSpec("fp8_block", 128, "experts")
INT4 = QuantSpec("int4_w4a16", 128, "experts")
# -- the exported quantization_config ------------------------------------------------------


def test_quantization_config_holds_the_keys_sglang_reads():
    assert quantization_config(FP8, SHAPES) == {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "ignored_layers": [],
    }
    assert quantization_config(FP8_EXPERTS, SHAPES)["ignored_layers"] == ATTN
    assert quantization_config(INT4, SHAPES) == {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": 128,
                    "dynamic": False,
                    "actorder": None,
                },
                "input_activations": None,
            }
        },
        "ignore": ATTN,  # the router, embeddings and output layer are no quantized Linear
    }
    for spec in (FP8, FP8_EXPERTS, INT4):
        assert sglang_quant.check_config(quantization_config(spec, SHAPES)) == spec


@pytest.mark.parametrize("spec", [FP8, FP8_EXPERTS, INT4], ids=str)
def test_a_push_and_its_layout_pass_the_loader_rules(spec):
    tensors = table(pushed(spec).items())
    assert tensors == sglang_quant.export_layout(SHAPES, spec, torch.bfloat16)
    check_sglang_quantized(tensors, config(spec))
    # sglang would cast the bfloat16 tensors into a float16 server: stricter, refused.
    with pytest.raises(LoaderRuleError, match="torch.bfloat16 where the model computes in"):
        check_sglang_quantized(tensors, config(spec), dtype=torch.float16)


# -- each rule, broken ------------------------------------------------------------------------

Q_PROJ = f"{L0}.self_attn.q_proj"
K_PROJ, V_PROJ = f"{L0}.self_attn.k_proj", f"{L0}.self_attn.v_proj"
GATE0 = f"{L0}.mlp.experts.0.gate_proj"
F8, F32, BF16, I32 = torch.float8_e4m3fn, torch.float32, torch.bfloat16, torch.int32


@pytest.mark.parametrize(
    ("spec", "changes", "kwargs", "expected"),
    [
        (  # a wrong suffix: sglang would skip it and keep the scale at -FLT_MAX
            FP8,
            {f"{Q_PROJ}.weight_scale_inv": None, f"{Q_PROJ}.weight_scale": (F32, (2, 1))},
            {},
            "q_proj.weight_scale: suffix .weight_scale where the fp8_block layer takes .weight, "
            ".weight_scale_inv (stricter than sglang 0.5.23, which skips a name its model "
            "lacks (models/qwen3_moe.py:1224-1225))",
        ),
        (  # a full-precision weight where FP8 is due: sglang would cast it
            FP8,
            {f"{Q_PROJ}.weight": (F32, (256, 128))},
            {},
            "q_proj.weight: torch.float32 where the fp8_block layer holds torch.float8_e4m3fn "
            "(stricter than sglang 0.5.23, which casts it silently",
        ),
        (  # a scale shape off by one
            FP8,
            {f"{Q_PROJ}.weight_scale_inv": (F32, (3, 1))},
            {},
            "q_proj.weight_scale_inv: shape (3, 1), a weight of (256, 128) in 128x128 blocks "
            "takes (2, 1): Attempted to load weight into parameter (sglang 0.5.23 "
            "srt/layers/quantization/fp8.py:653-714",
        ),
        (  # a missing scale
            FP8,
            {f"{Q_PROJ}.weight_scale_inv": None},
            {},
            "q_proj.weight_scale_inv: missing",
        ),
        (  # fused q/k/v shards that are not whole blocks: k and v of 64 rows
            FP8,
            {
                f"{K_PROJ}.weight": (F8, (64, 128)),
                f"{K_PROJ}.weight_scale_inv": (F32, (1, 1)),
                f"{V_PROJ}.weight": (F8, (64, 128)),
                f"{V_PROJ}.weight_scale_inv": (F32, (1, 1)),
            },
            {},
            "k_proj (64x128, tp_size 1): Weight output_partition_size = 64 is not divisible by "
            "weight quantization block_n = 128. (sglang 0.5.23 "
            "srt/layers/quantization/fp8.py:600-610)",
        ),
        (  # the MoE intermediate size on each of two ranks
            FP8,
            {},
            {"tp_size": 2},
            "The output_size of gate's and up's weight = 64 is not divisible by weight "
            "quantization block_n = 128. (sglang 0.5.23 srt/layers/quantization/fp8.py:1588-1593)",
        ),
        (  # INT4 groups that do not divide an expert's hidden size of 192
            INT4,
            {f"{GATE0}.weight_packed": (I32, (128, 24)), f"{GATE0}.weight_scale": (BF16, (128, 1))},
            {},
            "gate_proj (128x192, tp_size 1): hidden size (w13's scale groups) 192 is not "
            "divisible by 128 (sglang 0.5.23 srt/layers/quantization/compressed_tensors/schemes/"
            "compressed_tensors_wNa16_moe.py:156-159)",
        ),
        (  # a full-precision weight in an INT4 expert
            INT4,
            {f"{GATE0}.weight": (BF16, (128, 128))},
            {},
            "gate_proj.weight: a full-precision weight where the int4_w4a16 layer takes "
            ".weight_packed, .weight_scale, .weight_shape (stricter than sglang 0.5.23",
        ),
        (  # INT4 scales in another dtype than the served one
            INT4,
            {f"{GATE0}.weight_scale": (F32, (128, 1))},
            {},
            "gate_proj.weight_scale: torch.float32 where the int4_w4a16 layer holds "
            "torch.bfloat16 (stricter than sglang 0.5.23, which casts it silently",
        ),
        (  # INT4 served in float32: Marlin's kernels take 16-bit activations
            INT4,
            {},
            {"dtype": F32},
            "int4_w4a16: served in torch.float32: Marlin's MoE GEMM takes float16 and bfloat16 "
            "activations only (sglang 0.5.23 srt/layers/moe/fused_moe_triton/"
            "fused_marlin_moe.py:211)",
        ),
        (  # a quantized tensor on a layer the config leaves alone
            FP8_EXPERTS,
            {f"{Q_PROJ}.weight_scale_inv": (F32, (2, 1))},
            {},
            "q_proj.weight_scale_inv: a quantized tensor of model.layers.0.self_attn.q_proj, "
            "which the config leaves unquantized (stricter than sglang 0.5.23",
        ),
    ],
)
def test_each_loader_rule_refuses_its_violation(spec, changes, kwargs, expected):
    tensors = table(pushed(spec).items())
    for name, value in changes.items():
        if value is None:
            tensors.pop(name)
        else:
            tensors[name] = value
    with pytest.raises(LoaderRuleError) as caught:
        check_sglang_quantized(tensors, config(spec), **kwargs)
    message = str(caught.value)
    assert expected in message, message
    assert "\n" not in message


def test_int4_on_dense_layers_cannot_take_updates_but_can_load():
    spec = QuantSpec("int4_w4a16", 128, "linear")
    tensors = table(pushed(spec).items())
    with pytest.raises(
        LoaderRuleError,
        match=r"a dense INT4 layer cannot take weight updates.*"
        r"engine.quantization_targets=experts.*compressed_tensors_wNa16\.py:234-249",
    ):
        check_sglang_quantized(tensors, config(spec))
    # Served without updates, Marlin's rules hold: 128 outputs and inputs, groups of 128.
    check_sglang_quantized(tensors, config(spec), updates=False)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            lambda qc: qc.pop("activation_scheme"),
            "Cannot find any of ['activation_scheme'] in the model's quantization config. "
            "(sglang 0.5.23 srt/layers/quantization/base_config.py:257-264)",
        ),
        (lambda qc: qc.update(activation_scheme="static"), "fp8.py:311-314"),
        (lambda qc: qc.update(weight_block_size=[128]), "must have 2 dimensions"),
        (lambda qc: qc.update(weight_block_size=[96, 96]), "a power of two >= 16"),
        (lambda qc: qc.update(scale_fmt="ue8m0"), "fp8.py:548-552"),
        (lambda qc: qc.update(quant_method="gptq"), "__init__.py:63-92"),
    ],
)
def test_fp8_config_rules(change, expected):
    qc = quantization_config(FP8, SHAPES)
    change(qc)
    with pytest.raises(LoaderRuleError, match=None) as caught:
        sglang_quant.check_config(qc)
    assert expected in str(caught.value)


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("group_size", 48, "Marlin's INT4 kernels take group sizes [32, 64, 128]"),
        ("symmetric", False, "weights.symmetric: False, expected True"),
        ("strategy", "channel", "strategy 'channel' with group_size 128"),
        ("num_bits", 8, "weights.num_bits: 8, expected 4"),
    ],
)
def test_compressed_tensors_config_rules(field, value, expected):
    qc = quantization_config(INT4, SHAPES)
    qc["config_groups"]["group_0"]["weights"][field] = value
    with pytest.raises(LoaderRuleError) as caught:
        sglang_quant.check_config(qc)
    assert expected in str(caught.value)
    qc = quantization_config(INT4, SHAPES)
    qc["format"] = "naive-quantized"
    with pytest.raises(LoaderRuleError, match="compressed_tensors.py:733-751"):
        sglang_quant.check_config(qc)


def test_a_push_must_fit_the_served_model_and_int4_sessions_resend_every_expert():
    model = table(pushed(INT4).items())
    check_push({f"{GATE0}.weight_packed": model[f"{GATE0}.weight_packed"]}, model)
    with pytest.raises(LoaderRuleError, match=r"no such tensor in the served model \(stricter"):
        check_push({f"{GATE0}.weight": (BF16, (128, 128))}, model)
    with pytest.raises(LoaderRuleError, match=r"Attempted to load weight \(torch.Size\(\[128, 8\]"):
        check_push({f"{GATE0}.weight_packed": (I32, (128, 8))}, model)
    check_session(model, model, config(INT4))
    partial = [n for n in model if n != f"{GATE0}.weight_scale"]
    with pytest.raises(LoaderRuleError, match=r"gate_proj.weight_scale: not resent .*corrupts"):
        check_session(partial, model, config(INT4))
    check_session([], table(pushed(FP8).items()), config(FP8))  # FP8 keeps its layout


# -- the servers: CPU refusal, launch, attach -------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "kernel"),
    [
        (FP8, "srt/layers/quantization/fp8.py:826-829"),
        (INT4, "compressed_tensors/compressed_tensors.py:1090-1091"),
    ],
)
def test_a_quantized_scheme_on_cpu_servers_is_one_line(spec, kernel):
    sglang_quant.check_device(spec, "cuda", "engine.sglang.device=cuda")
    with pytest.raises(ValueError) as caught:
        sglang_quant.check_device(spec, "cpu", "engine.sglang.device=cpu")
    message = str(caught.value)
    assert message.startswith(f"engine.quantization={spec.scheme} with SGLang servers on CPU")
    assert kernel in message and "\n" not in message


@pytest.mark.parametrize(("spec", "method"), [(FP8, "fp8"), (INT4, "compressed-tensors")])
def test_launched_servers_start_from_the_quantized_export_and_name_its_scheme(
    tmp_path, spec, method
):
    export = write_checkpoint(tmp_path / "export", spec)
    cfg = SGLangEngineConfig(model_path=str(export), device="cuda", tp_size=1)
    command = SGLangEngine(cfg, quantization=spec).server_command(30000)
    assert command[command.index("--model-path") + 1] == str(export)
    assert command[command.index("--quantization") + 1] == method
    assert command.count("--quantization") == 1
    given = SGLangEngineConfig(
        model_path=str(export), device="cuda", server_args=["--quantization", method]
    )
    assert SGLangEngine(given, quantization=spec).server_command(30000).count("--quantization") == 1
    assert "--quantization" not in SGLangEngine(cfg).server_command(30000)  # full precision
    other = FP8 if spec is INT4 else INT4
    with pytest.raises(
        ValueError, match=rf"engine.quantization={other.scheme} .* a {spec.scheme} "
    ):
        SGLangEngine(cfg, quantization=other).server_command(30000)
    wrong = SGLangEngineConfig(
        model_path=str(export), device="cuda", server_args=["--quantization", "awq"]
    )
    with pytest.raises(ValueError, match="server_args --quantization awq"):
        SGLangEngine(wrong, quantization=spec).server_command(30000)
    cpu = SGLangEngineConfig(model_path=str(export), device="cpu")
    with pytest.raises(ValueError, match="SGLang servers on CPU"):
        SGLangEngine(cpu, quantization=spec).server_command(30000)


def test_a_server_launched_from_a_full_precision_checkpoint_is_refused(tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    (full / "config.json").write_text(json.dumps(HF_CONFIG))
    cfg = SGLangEngineConfig(model_path=str(full), device="cuda")
    with pytest.raises(ValueError, match="holds no quantization_config"):
        SGLangEngine(cfg, quantization=FP8).server_command(30000)


def fake_of(path: Path, **launch) -> FakeSGLang:
    return FakeSGLang(model=ServedModel.launch(path, **launch))


def test_a_fake_server_refuses_to_launch_from_a_checkpoint_sglang_cannot_load(tmp_path):
    export = write_checkpoint(tmp_path / "fp8", FP8)
    fake_of(export)
    with pytest.raises(LoaderRuleError, match="fp8.py:1588-1593"):
        fake_of(export, tp_size=2)  # 64 intermediate rows per rank
    with pytest.raises(ValueError, match=r"model config \(fp8\) does not match .* \(awq\)"):
        fake_of(export, quantization="awq")


def test_attached_servers_report_their_quantization_as_sglang_does(tmp_path):
    fp8, int4 = write_checkpoint(tmp_path / "fp8", FP8), write_checkpoint(tmp_path / "int4", INT4)

    async def body(engine):
        url = engine.urls[0]
        # Synchronous HTTP, as the config check asks before Ray starts: off the fake's loop.
        served = await asyncio.to_thread(sglang_quant.server_quantization, url)
        assert (served.method, served.config) == ("fp8", quantization_config(FP8, SHAPES))
        assert served.how == f"its checkpoint {fp8 / 'config.json'} says quant_method='fp8'"
        await asyncio.to_thread(sglang_quant.check_attached, [url], FP8)
        for spec, expected in [
            (None, "engine.quantization=null, but the attached SGLang server"),
            (INT4, "engine.quantization=int4_w4a16, but the attached SGLang server"),
            (FP8_EXPERTS, "engine.quantization_targets=experts, but the attached"),
        ]:
            with pytest.raises(ValueError) as caught:
                await asyncio.to_thread(sglang_quant.check_attached, [url], spec)
            assert expected in str(caught.value) and "\n" not in str(caught.value)

    run(fake_of(fp8), body)

    async def named(engine):
        served = await asyncio.to_thread(sglang_quant.server_quantization, engine.urls[0])
        assert served.method == "compressed-tensors"
        assert served.how == "GET /server_info reports quantization='compressed-tensors'"
        await asyncio.to_thread(sglang_quant.check_attached, engine.urls, INT4)

    run(fake_of(int4, quantization="compressed-tensors"), named)


# -- pushes through the fake ------------------------------------------------------------------


def flattened(named: dict[str, torch.Tensor]) -> list[tuple[list, str]]:
    """Flattened buckets of `named`, one dtype each (sglang cuts them with `.view(dtype)`)."""
    by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in named.items():
        by_dtype.setdefault(tensor.dtype, []).append((name, tensor))
    buckets = []
    for dtype, group in by_dtype.items():
        flat = torch.cat([t.contiguous().view(torch.uint8).reshape(-1) for _, t in group])
        names = [n for n, _ in group]
        shapes = [list(t.shape) for _, t in group]
        dtypes = [str(dtype).removeprefix("torch.")] * len(group)
        buckets.append((names, serialize_flattened_bucket(flat, names, dtypes, shapes)))
    return buckets


@pytest.mark.parametrize("spec", [FP8, INT4], ids=str)
def test_a_quantized_push_loads_and_a_bad_one_is_refused_as_sglang_answers(tmp_path, spec):
    fake = fake_of(write_checkpoint(tmp_path / "export", spec))
    update = pushed(spec, seed=1)

    async def body(engine):
        await engine.update_weights_from_tensors(update.items(), weight_version="1")
        await engine.begin_weight_update()
        buckets = flattened(update)
        for i, (_, payload) in enumerate(buckets):
            last = i == len(buckets) - 1
            await engine.update_weights_from_ipc([payload], weight_version="2" if last else None)
        await engine.end_weight_update()
        # A full-precision weight where the quantized tensors belong: sglang would cast it
        # into the FP8 parameter, or skip the name INT4 layers lack.
        bad = dict(update)
        first = next(n for n in bad if n.endswith((".weight_packed", ".weight_scale_inv")))
        stem = first.rpartition(".")[0]
        shape = update[f"{stem}.weight"].shape if spec is FP8 else (128, 128)
        bad[f"{stem}.weight"] = torch.zeros(shape, dtype=torch.bfloat16)
        expected = (
            "torch.bfloat16 into a tensor of torch.float8_e4m3fn"
            if spec is FP8
            else "no such tensor in the served model"
        )
        with pytest.raises(EngineError, match=rf"HTTP 400.*{expected} \(stricter than sglang"):
            await engine.update_weights_from_tensors(bad.items())
        # A scale one row short, through a bucket.
        scale = f"{stem}.weight_scale_inv" if spec is FP8 else f"{stem}.weight_scale"
        short = {scale: update[scale][:-1]}
        await engine.begin_weight_update()
        with pytest.raises(EngineError, match=r"HTTP 400.*Attempted to load weight"):
            await engine.update_weights_from_ipc([flattened(short)[0][1]], weight_version="3")
        with pytest.raises(EngineError, match="an update of the session failed"):
            await engine.end_weight_update()

    run(fake, body)
    assert fake.open_sessions == set()


def test_distributed_int4_buckets_must_resend_every_expert(tmp_path):
    fake = fake_of(write_checkpoint(tmp_path / "export", INT4))
    update = pushed(INT4, seed=1)
    join = {
        "master_address": "127.0.0.1",
        "master_port": 29500,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "w",
        "backend": "gloo",
    }

    def bucket(names):
        dtypes = [str(update[n].dtype).removeprefix("torch.") for n in names]
        return names, dtypes, [list(update[n].shape) for n in names]

    async def body(engine):
        await engine.init_weights_update_group(**join)
        await engine.begin_weight_update()
        dtypes = sorted({t.dtype for t in update.values()}, key=str)
        for dtype in dtypes:
            names = [n for n, t in update.items() if t.dtype == dtype]
            version = "1" if dtype == dtypes[-1] else None
            await engine.update_weights_from_distributed(
                *bucket(names), group_name="w", weight_version=version
            )
        await engine.end_weight_update()
        # Only expert 1's packed weights: expert 0 would be repacked from stale Marlin bytes.
        await engine.begin_weight_update()
        experts = [n for n in update if ".experts.1." in n and update[n].dtype == torch.int32]
        await engine.update_weights_from_distributed(
            *bucket(experts), group_name="w", weight_version="2"
        )
        with pytest.raises(EngineError, match=r"experts.0.down_proj.weight_packed: not resent"):
            await engine.end_weight_update()
        await engine.begin_weight_update()
        names, _, shapes = bucket(["model.norm.weight"])
        with pytest.raises(EngineError, match=r"torch.float32 into a tensor of torch.bfloat16"):
            await engine.update_weights_from_distributed(
                names, ["float32"], shapes, group_name="w", weight_version="3"
            )
        with pytest.raises(EngineError, match="an update of the session failed"):
            await engine.end_weight_update()

    run(fake, body)
    assert fake.open_sessions == set()


# -- a real model's export ----------------------------------------------------------------------

_EXPORT = textwrap.dedent(
    """
    import sys, torch
    from ember_core.quant import QuantSpec
    from ember_megatron_backend.hf_layout import hf_names
    from ember_megatron_backend.model import ModelConfig, build_model
    from ember_megatron_backend.parallel import init_distributed
    from ember_megatron_backend.weights import export_hf_checkpoint
    from ember_rollout.sglang_quant import quantization_config

    init_distributed()
    cfg = ModelConfig.preset("tiny-moe").replace(
        vocab_size=16, num_layers=2, hidden_size=128, head_dim=64, moe_ffn_hidden_size=128,
        num_experts=4,
    )
    model = build_model(cfg, seed=0)
    root = sys.argv[1]
    export_hf_checkpoint(model, cfg, f"{root}/full")  # the parameters' float32
    for name, spec in (("fp8", QuantSpec("fp8_block", 128, "linear")),
                       ("int4", QuantSpec("int4_w4a16", 128, "experts"))):
        qc = quantization_config(spec, hf_names(cfg))
        export_hf_checkpoint(model, cfg, f"{root}/{name}", dtype=torch.bfloat16,
                             quantization=spec, quantization_config=qc)
    """
)


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> Path:
    """The trainer's exports of one tiny-moe model (megatron-core, in a process of its own: the
    export sets up torch.distributed): full precision, fp8_block and int4_w4a16 (experts)."""
    root = tmp_path_factory.mktemp("exports")
    subprocess.run(
        [sys.executable, "-c", _EXPORT, str(root)], check=True, capture_output=True, timeout=600
    )
    return root


@pytest.mark.slow
@pytest.mark.parametrize(("name", "spec"), [("fp8", FP8), ("int4", INT4)])
def test_a_real_models_export_holds_what_every_push_sends_and_passes_the_rules(exports, name, spec):
    from ember_rollout.models import load_model

    full = load_checkpoint(exports / "full")
    written = load_checkpoint(exports / name)
    expected = dict(quant.quantize_named(full.items(), spec, dtype=torch.bfloat16))
    assert written.keys() == expected.keys()
    for key, tensor in expected.items():  # the export is the push: bit for bit
        assert written[key].dtype == tensor.dtype and torch.equal(
            written[key].view(torch.uint8), tensor.view(torch.uint8)
        ), key
    config = json.loads((exports / name / "config.json").read_text())
    assert config["quantization_config"] == quantization_config(spec, full)
    assert config["dtype"] == "bfloat16"
    check_sglang_quantized(table(written.items()), config)
    served = ServedModel.launch(exports / name, tensors=written)  # the fake starts from it
    assert served.load(table(written.items()).items()) is None and served.end() is None
    shapes = {n: tuple(t.shape) for n, t in full.items()}
    assert sglang_quant.export_layout(shapes, spec, torch.bfloat16) == table(written.items())
    with pytest.raises(ValueError, match=r"a quantized checkpoint \(quantization_config"):
        load_model(exports / name, dtype=torch.bfloat16)  # the embedded engine's start


@pytest.mark.slow
def test_sglang_itself_parses_the_config_and_skips_the_same_layers():
    """sglang's own config parsers and layer-skipping rules (pure Python; its kernels need
    CUDA), against the rules' reading of them."""
    pytest.importorskip(
        "sglang", reason="the sglang extra is not installed (uv sync --extra sglang)"
    )
    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )
    from sglang.srt.layers.quantization.compressed_tensors.utils import should_ignore_layer
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.layers.quantization.utils import is_layer_skipped

    from ember_rollout.sglang_loader_rules import _is_ignored

    names = [
        *SHAPES,
        f"{L0}.mlp.shared_expert.gate_proj.weight",
        f"{L0}.mlp.shared_expert.up_proj.weight",
    ]
    fused = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    layers = [
        f"{L0}.self_attn.qkv_proj",
        f"{L0}.self_attn.o_proj",
        f"{L0}.mlp.shared_expert.gate_up_proj",
        f"{L0}.mlp.experts.0.gate_proj",
    ]
    for spec in (FP8, FP8_EXPERTS):
        qc = quantization_config(spec, names)
        parsed = Fp8Config.from_config(qc)
        assert parsed.weight_block_size == [128, 128] and parsed.is_checkpoint_fp8_serialized
        for layer in [*layers, f"{L0}.mlp.experts"]:
            skipped = is_layer_skipped(layer, parsed.ignored_layers, fused_mapping=fused)
            shard = layer.replace("qkv_proj", "q_proj").replace("gate_up_proj", "gate_proj")
            assert (
                skipped
                == _is_ignored(shard, qc)
                == (spec is FP8_EXPERTS and "experts" not in layer)
            )
    qc = quantization_config(INT4, names)
    parsed = CompressedTensorsConfig.from_config(qc)
    weights = parsed.target_scheme_map["Linear"]["weights"]
    assert (weights.num_bits, weights.group_size, weights.symmetric) == (4, 128, True)
    assert parsed.quant_format == "pack-quantized"
    for layer in layers:
        shard = layer.replace("qkv_proj", "q_proj").replace("gate_up_proj", "gate_proj")
        assert should_ignore_layer(layer, parsed.ignore, fused) == _is_ignored(shard, qc)
        assert _is_ignored(shard, qc) == ("experts" not in layer)
