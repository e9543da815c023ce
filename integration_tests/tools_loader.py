"""Import a script of `tools/` as a module, for the tests of the benchmarks."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_tool(name: str) -> ModuleType:
    """`tools/<name>.py` as module `name`, registered in `sys.modules` so that one tool can
    import another that was loaded before it."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
