"""Every `from ember_... import name` in the repository resolves, in the code that CPU CI runs
and in the code it cannot (the GPU tests, `tools/device_check_parts.py`): a name moved between
modules fails here, in the fast tier, instead of on the first GPU machine."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIPPED_DIRS = {".venv", "__pycache__", ".git", "build", "dist"}


def _python_files() -> list[Path]:
    files = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = set(path.relative_to(ROOT).parts)
        # sglang_cpu/site/ runs on an SGLang server's own path, next to sglang itself.
        if parts & SKIPPED_DIRS or {"sglang_cpu", "site"} <= parts:
            continue
        files.append(path)
    return files


def _project_imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) of each absolute `from ember... import name` of a file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0].startswith("ember"):
                found += [(node.lineno, node.module, a.name) for a in node.names if a.name != "*"]
    return found


def _resolves(module: str, name: str) -> bool:
    imported = importlib.import_module(module)
    if hasattr(imported, name):
        return True
    try:  # `from package import submodule`
        importlib.import_module(f"{module}.{name}")
    except ModuleNotFoundError:
        return False
    return True


def test_the_scan_sees_the_gpu_only_code():
    scanned = {p.relative_to(ROOT).as_posix() for p in _python_files()}
    assert {"tools/device_check_parts.py", "integration_tests/test_megatron_gpu.py"} <= scanned
    names = {(m, n) for _, m, n in _project_imports(ROOT / "tools/device_check_parts.py")}
    assert ("ember_rollout.sglang_weights", "serialize_flattened_bucket") in names


def test_a_moved_name_is_reported(tmp_path):
    moved = tmp_path / "moved.py"
    moved.write_text("from ember_rollout.sglang_engine import serialize_flattened_bucket\n")
    [(line, module, name)] = _project_imports(moved)
    assert (line, module, name) == (1, "ember_rollout.sglang_engine", "serialize_flattened_bucket")
    assert not _resolves(module, name)


def test_every_project_import_in_the_repository_resolves():
    missing = []
    for path in _python_files():
        for line, module, name in _project_imports(path):
            try:
                ok = _resolves(module, name)
            except ImportError as error:
                pytest.fail(f"{path.relative_to(ROOT)}:{line}: import {module}: {error}")
            if not ok:
                missing.append(f"{path.relative_to(ROOT)}:{line}: {module} has no {name}")
    assert not missing, "\n".join(missing)
