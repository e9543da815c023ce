"""Fixtures of the r3_routing tests."""

from __future__ import annotations

import pytest
from r3_samples import small_shape

from ember_core.config import CoreConfig
from ember_core.plugins import EmberPlugins
from ember_r3_routing import R3RoutingConfig
from ember_r3_routing import plugin as r3_plugin


@pytest.fixture
def shape() -> R3RoutingConfig:
    return small_shape()


@pytest.fixture
def reset_plugin():
    """Forget the plugin's configured section after the test."""
    yield
    r3_plugin._config = None


@pytest.fixture
def host(shape, reset_plugin):
    """A plugin host with r3_routing registered and configured for `shape`."""
    plugins = EmberPlugins()
    plugins.register(r3_plugin, "r3_routing")
    plugins.configure(CoreConfig(plugins=["r3_routing"]), {"r3_routing": shape})
    try:
        yield plugins
    finally:
        plugins.unregister("r3_routing")
