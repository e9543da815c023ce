"""A launched SGLang server's end when its engine actor is killed, and the replacement's start.

The engine actor is a process of its own here too (Ray kills an actor with SIGKILL); its server
is a stand-in launched through `engine.sglang.python`: a process that drains for 30 s on
SIGTERM, as sglang's server finishes its requests before it exits, with a worker in its process
group that, like any worker, outlives it for as long as nothing stops it. The GPU memory they
hold is what a replacement on the same GPU sizes its KV cache from.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ember_rollout.config import SGLangEngineConfig
from ember_rollout.sglang_engine import SGLangEngine
from ember_rollout.sglang_launch import SERVERS_DIR

pytestmark = pytest.mark.slow

STAND_IN = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, lambda *_: (time.sleep(30), sys.exit(0)))  # sglang drains
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(sys.argv[1], "a") as pids:
    pids.write(f"{os.getpid()} {worker.pid}\\n")
time.sleep(600)
"""

ENGINE_ACTOR = """
import sys, time
from ember_rollout.config import SGLangEngineConfig
from ember_rollout.sglang_engine import SGLangEngine
engine = SGLangEngine(SGLangEngineConfig(
    model_path=sys.argv[1], python=sys.argv[2], device="cpu", log_dir=sys.argv[3]))
engine.partial_rollouts = False
engine._launch()
print("launched", flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie has ended: it holds no memory)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_for(pids_file: Path, lines: int) -> list[tuple[int, int]]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if pids_file.exists():
            found = [tuple(map(int, ln.split())) for ln in pids_file.read_text().splitlines()]
            if len(found) >= lines:
                return found
        time.sleep(0.05)
    pytest.fail("the stand-in server did not start")


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
def test_a_killed_engines_server_dies_at_once_and_its_replacement_waits_for_it(tmp_path):
    pids_file = tmp_path / "pids"
    script = tmp_path / "stand-in.py"
    script.write_text(STAND_IN)
    python = tmp_path / "fake-python"
    python.write_text(
        f'#!/bin/sh\nexec env -u SGLANG_USE_CPU_ENGINE "{sys.executable}" "{script}" '
        f'"{pids_file}"\n'
    )
    python.chmod(0o755)
    actor = subprocess.Popen(
        [sys.executable, "-c", ENGINE_ACTOR, str(tmp_path), str(python), str(tmp_path / "logs")],
        stdout=subprocess.PIPE,
        text=True,
    )
    engine = None
    try:
        assert actor.stdout.readline().strip() == "launched"
        ((server, worker),) = wait_for(pids_file, 1)
        actor.send_signal(signal.SIGKILL)  # ray.kill
        actor.wait()
        killed = time.monotonic()
        while alive(server) and time.monotonic() - killed < 10:
            time.sleep(0.05)
        assert not alive(server), "the server outlived its engine actor (draining)"

        # The replacement, on the same node: its server starts once the old one's are gone.
        config = SGLangEngineConfig(
            model_path=str(tmp_path), python=str(python), device="cpu", log_dir=str(tmp_path)
        )
        engine = SGLangEngine(config)
        engine.partial_rollouts = False
        engine._launch()
        assert not alive(worker), "the replacement launched beside the old server's worker"
        (_, (new_server, _)) = wait_for(pids_file, 2)
        assert alive(new_server)
        assert not (SERVERS_DIR / str(server)).exists()  # the old server's record is gone
    finally:
        actor.kill()
        if engine is not None:
            for launched in engine._servers:
                os.killpg(launched.process.pid, signal.SIGKILL)
                launched.process.wait()
                (SERVERS_DIR / str(launched.process.pid)).unlink(missing_ok=True)
        for line in pids_file.read_text().splitlines() if pids_file.exists() else []:
            for pid in map(int, line.split()):
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
