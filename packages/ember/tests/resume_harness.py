"""Runs `ember train` in child processes that a test can SIGKILL at a named point of the loop.

A kill + resume test launches `ember train` five times, and each launch would import
megatron-core, transformers and the actors' modules again (about 20 s on 2 cores). Here a
server process imports everything once and forks one child per launch; each child runs
`ember.cli.main(argv)` as it is. The test runs' configs (one training rank, one embedded engine,
no GPUs) get the default in-process runtime (`ray.enabled: auto`): the training rank, the engine
and the rollout manager are objects in the child, each on threads of its own, so killing the
child kills the driver and its actors at once, as a SIGKILL of `ember train` does. A launch
whose config needs Ray (`ray.num_engines=2`) starts its own local Ray from the child, as
`ember train` would. The server only imports before it forks: a process that has run parallel
torch ops is not safe to fork (OpenMP's thread pool).

Kill points (`POINT:ROLLOUT`), each a SIGKILL of the child from inside the loop. They are armed
in the child's process, so they fire in an in-process run (and `checkpoint`, which is the
driver's rename, under Ray too):
- `rollout:R`: during rollout R's generation, as an engine hands its first sample to the
  plugins (`ember_process_sample`; the hf engine's `meta_info.id` names the request's
  rollout). With `rollout.async` that is during rollout R - 1's iteration;
- `train:R`: during rollout R's training, after its first optimizer step
  (`ember_after_train_step`);
- `checkpoint:R`: while the checkpoint of rollout R is being written, once its training state
  and driver state are in the hidden directory and before the rename that publishes it.
"""

from __future__ import annotations

import importlib
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ember.checkpoints
import ember.cli
import ember_megatron_backend.checkpoint
from ember_core import hookimpl
from ember_core.plugins import EmberPlugins

POINTS = ("rollout", "train", "checkpoint")
PRELOAD = (
    "ember.driver",
    "ember.actors",
    "ember.rollout_manager",
    "ember_megatron_backend.worker",
    "ember_rollout.hf_engine",
    "megatron.core",
    "megatron.core.distributed",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.transformer.moe.router",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "safetensors.torch",
)
"""What the server imports before forking, so that no child imports it again: the driver and
the actors' classes, and the modules the actors import lazily (megatron-core alone takes about
10 s on 2 cores without cached bytecode)."""


# --------------------------------------------------------------------------------------------
# Test side
# --------------------------------------------------------------------------------------------


class Launcher:
    """The fork server, seen from the test: `launch` runs one `ember train` to its end."""

    def __init__(self, log: Path) -> None:
        """Start the server (its imports take about 20 s on 2 cores); its output goes to `log`."""
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        paths = [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        with open(log, "w") as stderr:
            self.server = subprocess.Popen(
                [sys.executable, "-c", "import resume_harness; resume_harness.serve()"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                env=env,
            )

    def trainer(self, log_dir: Path) -> Callable[..., None]:
        """`train(*argv, kill=None)`: one `ember train ARGV` (logged to
        `log_dir/launchN.log`) that must end as intended: SIGKILLed at `kill`, else with exit
        code 0; a failure shows the log's tail."""
        numbers = itertools.count()

        def train(*argv: str, kill: str | None = None) -> None:
            log = log_dir / f"launch{next(numbers)}.log"
            code = self.launch(["train", *argv], log, kill)
            assert code == (-signal.SIGKILL if kill else 0), log.read_text()[-3000:]

        return train

    def launch(
        self,
        argv: list[str],
        log: Path,
        kill: str | None = None,
        *,
        err: Path | None = None,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        cwd: str | None = None,
    ) -> int:
        """Run `ember ARGV` in a fresh child; returns its exit code (-9: killed at `kill`,
        -14: still running after `timeout`).

        Args:
            argv: The `ember` command line.
            log: File that receives the child's stdout (and its stderr, without `err`).
            kill: `POINT:ROLLOUT` at which the child SIGKILLs itself, or None.
            err: File that receives the child's stderr.
            env: The child's environment (default: the server's). What the server read from
                its own when it imported (torch's thread count, for one) stays as it was.
            timeout: Seconds the child may run (default `CHILD_TIMEOUT_S`).
            cwd: The child's working directory (default: the server's).
        """
        assert self.server.stdin is not None and self.server.stdout is not None
        request = {
            "argv": argv, "log": str(log), "kill": kill, "err": None if err is None else str(err),
            "env": env, "timeout": timeout, "cwd": cwd,
        }  # fmt: skip
        self.server.stdin.write(json.dumps(request) + "\n")
        self.server.stdin.flush()
        answer = self.server.stdout.readline()
        if not answer:
            raise RuntimeError(f"the fork server exited ({self.server.wait()})")
        return int(answer)

    def close(self, timeout: float = 30) -> None:
        assert self.server.stdin is not None
        self.server.stdin.close()
        self.server.wait(timeout=timeout)


# --------------------------------------------------------------------------------------------
# Server and child side
# --------------------------------------------------------------------------------------------


def serve() -> None:
    """Fork one child per request line from stdin; answer with its exit code."""
    for name in PRELOAD:
        importlib.import_module(name)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _child(**request)
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)


CHILD_TIMEOUT_S = 300
"""A child still running after this long is stopped by SIGALRM (exit code -14), not waited on."""


def _child(
    argv: list[str],
    log: str,
    kill: str | None,
    err: str | None = None,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    cwd: str | None = None,
) -> int:
    signal.alarm(math.ceil(timeout or CHILD_TIMEOUT_S))
    if cwd is not None:
        os.chdir(cwd)
    for stream, path in ((1, log), (2, err or log)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), stream)
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    if kill is not None:
        _arm(kill)
    return ember.cli.main(argv)


def _die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class KillAt:
    """A plugin that kills the process at a rollout or training point."""

    def __init__(self, point: str, rollout_id: int) -> None:
        self.point, self.rollout_id = point, rollout_id

    @hookimpl
    def ember_process_sample(self, meta_info: dict[str, Any]) -> None:
        if self.point == "rollout" and meta_info["id"].startswith(f"rollout {self.rollout_id} "):
            _die()

    @hookimpl
    def ember_after_train_step(self, rollout_id: int, step_id: int) -> None:
        if self.point == "train" and (rollout_id, step_id) == (self.rollout_id, 0):
            _die()


def _arm(kill: str) -> None:
    point, _, rollout = kill.partition(":")
    assert point in POINTS and rollout.isdigit(), kill
    rollout_id = int(rollout)
    if point == "checkpoint":
        final_name = ember.checkpoints.checkpoint_name(rollout_id)
        real = ember_megatron_backend.checkpoint.replace_dir

        def replace_dir(staging: Path, final: Path) -> None:
            # The driver's publishing rename (the training ranks' own renames go elsewhere).
            if final.name == final_name and final.parent.name == ember.checkpoints.CHECKPOINTS:
                _die()
            real(staging, final)

        ember_megatron_backend.checkpoint.replace_dir = replace_dir
        return
    real_load = EmberPlugins.load.__func__  # type: ignore[attr-defined]

    def load(cls: type[EmberPlugins], enabled: Any, built_in: Any = None) -> EmberPlugins:
        plugins = real_load(cls, enabled, built_in)
        plugins.register(KillAt(point, rollout_id), "kill_at")
        plugins.check_pending()
        return plugins

    EmberPlugins.load = classmethod(load)  # type: ignore[method-assign,assignment]
