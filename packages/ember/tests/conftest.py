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


def generate_with_sglang(model, requests, log_dir, *server_args):
    """Launch the real SGLang server on `model` in fp32 (CPU), answer `requests` with it, and
    shut it down; the tests that compare its answers with transformers share this."""
    import asyncio

    from ember_rollout.config import SGLangEngineConfig
    from ember_rollout.sglang_engine import SGLangEngine

    engine = SGLangEngine(
        SGLangEngineConfig(
            model_path=str(model),
            device="cpu",
            dtype="float32",
            server_args=[*server_args, "--log-level", "warning"],
            launch_timeout_s=600.0,
            log_dir=str(log_dir),
        )
    )

    async def generate():
        try:
            return await engine.generate(requests)
        finally:
            await engine.shutdown()

    return asyncio.run(generate())
