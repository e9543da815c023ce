"""The GPU suite's tooling, checked on the CPU: `tools/gpu_suite.sh` gets uv on a PEP 668 system,
and GPU tests that need Transformer Engine skip with that reason instead of doing less."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import shutil
import stat
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PYTHON3 = """\
#!/usr/bin/env bash
# python3 of a PEP 668 system: pip refuses installs outside a virtual environment.
if [ "$1 $2" = "-m venv" ]; then
    if [ "$STUB_NO_VENV" = 1 ]; then echo "ensurepip is not available" >&2; exit 1; fi
    mkdir -p "$3/bin"
    cat >"$3/bin/python" <<EOF
#!/usr/bin/env bash
[ "\\$*" = "-m pip install --quiet uv" ] || exit 3
cp "\\$STUB_UV" "$3/bin/uv"
EOF
    chmod +x "$3/bin/python"
    exit 0
fi
if [ "$1 $2 $3" = "-m pip install" ]; then
    case " $* " in
        *" --user --break-system-packages "*)
            mkdir -p "$HOME/.local/bin" && cp "$STUB_UV" "$HOME/.local/bin/uv" && exit 0 ;;
    esac
    echo "error: externally-managed-environment" >&2
    exit 1
fi
exit 3
"""
UV = """\
#!/usr/bin/env bash
echo "$*" >>"$UV_LOG"
"""


def _script(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.mark.parametrize("has_venv", [True, False], ids=["venv", "no-venv-module"])
def test_gpu_suite_installs_uv_where_system_pip_refuses(tmp_path, has_venv):
    # A PATH with the few real tools the scripts use, python3 stubbed, and no uv anywhere.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "mkdir", "cp", "chmod", "cat"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    _script(bin_dir / "python3", PYTHON3)
    _script(tmp_path / "uv-stub", UV)
    env = {
        "PATH": str(bin_dir),
        "HOME": str(tmp_path / "home"),
        "TMPDIR": str(tmp_path),
        "STUB_UV": str(tmp_path / "uv-stub"),
        "STUB_NO_VENV": "" if has_venv else "1",
        "UV_LOG": str(tmp_path / "uv.log"),
    }
    run = subprocess.run(
        ["bash", str(ROOT / "tools/gpu_suite.sh"), "-x"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    installed = tmp_path / "ember-uv/bin/uv" if has_venv else tmp_path / "home/.local/bin/uv"
    assert installed.is_file()
    assert (tmp_path / "uv.log").read_text().splitlines() == [
        "sync --locked --extra sglang",
        "run --locked --extra sglang python -",
        "run --locked --extra sglang pytest -m gpu integration_tests -rs -x",
    ]


def _check_calls(tree: ast.Module) -> dict[str, list[ast.Call]]:
    """Per test function, its calls of `_check`."""
    calls = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            found = [
                c
                for c in ast.walk(node)
                if isinstance(c, ast.Call) and getattr(c.func, "id", None) == "_check"
            ]
            calls[node.name] = found
    return calls


def test_tests_that_need_transformer_engine_skip_with_that_reason():
    # The premise: the locked environment can never hold Transformer Engine.
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    assert not [p["name"] for p in lock["package"] if p["name"].startswith("transformer-engine")]
    assert importlib.util.find_spec("transformer_engine") is None

    import test_megatron_gpu as module

    source = Path(module.__file__).read_text()
    default = inspect.signature(module._check).parameters["train"].default
    trains_under_tp = []
    for name, calls in _check_calls(ast.parse(source)).items():
        for call in calls:
            train = next((k.value for k in call.keywords if k.arg == "train"), None)
            if train is None:
                assert default is not inspect.Parameter.empty, f"{name}: train not given"
                train = ast.Constant(default)
            # Training is decided by the test, never by what happens to be installed.
            assert isinstance(train, ast.Constant), f"{name}: train={ast.unparse(train)}"
            layout = module.LAYOUTS[call.args[0].value][0]
            if train.value and layout.get("tensor_parallel", 1) > 1:
                trains_under_tp.append(name)
    assert trains_under_tp == ["test_tensor_parallel_2_trains"]
    for name in trains_under_tp:
        marks = getattr(module, name).pytestmark
        reasons = [m.kwargs["reason"] for m in marks if m.name == "skipif" and m.args[0]]
        assert any("Transformer Engine" in r for r in reasons), (name, reasons)
    # Scoring and export under TP=2 need no TE: that test still runs on two GPUs.
    scores = module.test_tensor_parallel_2_scores_and_exports.pytestmark
    assert not any("Transformer Engine" in m.kwargs.get("reason", "") for m in scores)


@pytest.mark.parametrize(
    "plugins", [["r3_routing", "ci_kl_checker"], ["ci_kl_checker"]], ids=["r3", "no-r3"]
)
def test_the_colocated_sglang_gpu_run_is_a_layout_ember_accepts(tmp_path, plugins):
    # test_e2e_gpu.py::test_sglang_rollouts_in_ci_mode runs this config on a GPU; a layout
    # `ember train` refuses would fail there before anything it checks ran.
    from gpu_support import SERVED_MODEL, colocated_sglang_run

    from ember.config import load_config, weight_transport
    from ember.placement import COLOCATED, MEMORY_SAVER_FLAG, plan_layout
    from ember_megatron_backend.config import BackendConfig
    from ember_megatron_backend.hf_layout import hf_config

    model = BackendConfig(model="tiny-moe", model_overrides=SERVED_MODEL).model_config()
    hf_config(model).save_pretrained(tmp_path / "model")  # what R3 reads the shape from
    config, _ = load_config(colocated_sglang_run(tmp_path / "model", tmp_path / "logs", plugins))
    assert MEMORY_SAVER_FLAG in config.engine.sglang.server_args
    layout = plan_layout(config)
    assert layout.bundles == {COLOCATED: [1]}
    assert [s.gpus for s in (*layout.train, *layout.engines)] == [0.5, 0.5]
    assert config.weights.transport == "auto" and config.run.save_interval == 1
    assert weight_transport(config) == "ipc"
