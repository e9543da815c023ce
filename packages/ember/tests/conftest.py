"""Shared fixtures of the ember package's tests."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _visible_gpus_restored():
    """Tests that run actor classes in this process (`in_process` stand-ins) run their set-up,
    which hides the GPUs Ray did not grant by setting CUDA_VISIBLE_DEVICES to "" for the whole
    process; a later test's Ray cluster with fake GPUs would then refuse to start. Put the
    variable back as it was after every test."""
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    yield
    if before is None:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = before
