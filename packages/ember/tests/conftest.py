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


@pytest.fixture
def nothing_starts(monkeypatch):
    """Fail the test if anything tries to start the run's actors: Ray, or the in-process
    runtime that the default config gets."""
    import ray

    from ember.runtimes import LocalRuntime, RayRuntime

    def refuse(*args, **kwargs):
        raise AssertionError("the run's runtime was started")

    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(LocalRuntime, "start", refuse)
    monkeypatch.setattr(RayRuntime, "start", refuse)
    assert not ray.is_initialized()
    yield
    assert not ray.is_initialized()
