"""Shared fixtures: one single-process gloo group per test session (megatron state is global)."""

from __future__ import annotations

import pytest
import torch

from ember_megatron_backend.parallel import destroy_distributed, init_distributed


@pytest.fixture(scope="session")
def dist_env():
    """torch.distributed (gloo, world size 1) and megatron-core parallel state, TP=PP=EP=1."""
    torch.set_num_threads(2)
    init_distributed()
    yield
    destroy_distributed()
