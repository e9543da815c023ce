"""Start `fake_sglang_server.py` as a server someone else launched, for tests that attach."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from ember_rollout.sglang_launch import free_port

FAKE_SERVER = Path(__file__).with_name("fake_sglang_server.py")


@contextmanager
def fake_server(model: Path, record: Path, *, start_timeout_s: float = 60) -> Iterator[str]:
    """Run the fake server for the checkpoint at `model`, recording to `record`; yields its
    URL once /health answers, and stops it on exit."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, str(FAKE_SERVER), "--model-path", str(model), "--port", str(port)]
        + ["--record", str(record)],
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("the fake SGLang server did not start")
                time.sleep(0.05)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)
