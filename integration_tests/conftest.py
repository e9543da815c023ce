"""Integration tests: tests marked `gpu` are skipped, with the reason, where CUDA is absent."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is available on this machine")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def served_root(tmp_path_factory) -> Path:
    """Where `gpu_support.served_model` writes the models the SGLang tests serve (once each)."""
    return tmp_path_factory.mktemp("served")
