"""Integration tests: tests marked `gpu` are skipped, with the reason, where CUDA is absent."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is available on this machine")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
