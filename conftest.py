"""Suite-wide test settings: a tight per-test timeout for the fast tier (tests not marked slow)."""

from __future__ import annotations

import pytest

FAST_TEST_TIMEOUT = 120
"""Seconds a test outside the slow tier may take, its fixtures included, before pytest-timeout
fails it by name. The slowest fast test takes about 15 s on a 2-core machine; the margin covers
session fixtures landing on a test and a busy shared machine."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slow") is None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(FAST_TEST_TIMEOUT))
