"""`ember train` from a test, in this process where the run's actors would be in one process
anyway, in a process of its own otherwise.

A run whose roles fit one process (`ember.layout.in_process`) is called here, through
`ember.cli.main`, as the command calls it: the same config, plugins, driver and actors, only
without starting an interpreter and importing torch, transformers and megatron-core again (about
9 s of each run on a 2-core AMD EPYC, a third to a half of a short test run). Runs that need Ray
(several ranks or engines, SGLang servers, `ray.enabled=true`) and runs that a test kills keep a
process of their own: a child of the session's fork server (`ForkServer`), which has imported
Ember's libraries already. Those that only need Ray to be there (not its start, its shutdown,
its log directory or the processes it leaves) join one Ray cluster that the test session starts
on first use (`SharedRay`), which saves each of them Ray's start and shutdown (a two-rank run:
31.3 s against 35.6 s with a Ray of its own, 2-core AMD EPYC).
"""

from __future__ import annotations

import atexit
import contextlib
import io
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from ember import RAY_ENV
from ember.quiet import VERBOSE_ENV
from ember_core.certify import PLANT_ENV


def fits_one_process(argv: list[str]) -> bool:
    """Whether `ember ARGV` (a `train` or a single-setup `certify`) runs every role in its own
    process, as the command would decide it; a config the command would refuse counts as one
    process (the refusal is the same either way)."""
    from ember.cli import build_parser, train_config_source
    from ember.config import load_config
    from ember.layout import in_process

    args = build_parser().parse_args(argv)
    if args.command not in ("train", "certify") or getattr(args, "matrix", False):
        return False
    try:
        if args.command == "train":
            source, overrides = train_config_source(args)
        else:
            source, overrides = args.config, args.set
        config, _ = load_config(source, overrides=overrides, plugins=args.plugins)
        return in_process(config)[0]
    except (ValueError, OSError):
        return True


def ember_here(argv: list[str]) -> subprocess.CompletedProcess:
    """`ember ARGV` in this process: its standard output, its standard error with the run's log
    lines (as the command prints them), and its exit status, as `subprocess.run` returns them.
    An error that escapes the command is its traceback on standard error and status 1, as in a
    process of its own. A hang is pytest-timeout's to stop (its limit is the test's).

    The process-wide settings a command changes (the environment, torch's thread count, the
    root logger's level) are put back afterwards."""
    import torch

    from ember.cli import main

    out, err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(err)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    level, threads = root.level, torch.get_num_threads()
    environment = dict(os.environ)
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = main(argv)
            except SystemExit as exc:  # argparse's refusals
                status = exc.code if isinstance(exc.code, int) else 1
            except Exception:
                traceback.print_exc()
                status = 1
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        torch.set_num_threads(threads)
        os.environ.clear()
        os.environ.update(environment)
    return subprocess.CompletedProcess(["ember", *argv], status, out.getvalue(), err.getvalue())


class SharedRay:
    """One Ray cluster (`ray start --head`) for the session's `ember` runs that need Ray, started
    on first use and stopped when the session's process exits.

    A run joins it with `ray.address` (and no `ray.object_store_mb`, which sizes a Ray the run
    starts). Ember hands a joined cluster's workers only the variables it forwards (`RAY_ENV`,
    the verbosity, a certifier's plant), so a run whose environment differs from the one the
    cluster started with in anything else (a test's monkeypatched variable: a Ray setting,
    a fault switch read inside an actor) starts its own Ray instead, as it would alone.
    """

    JOIN_ENV = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    """The cluster's token, the session's own: its processes listen on the machine's address, so
    it runs with token authentication (Ray 2.60), and the runs that join it present the token."""
    IGNORED = frozenset(
        {
            "PYTEST_CURRENT_TEST", "RAY_IGNORE_UNHANDLED_ERRORS", VERBOSE_ENV, PLANT_ENV,
            *RAY_ENV, *JOIN_ENV,
        }
    )  # fmt: skip
    """Variables no worker of the cluster needs from its start: pytest's per-test one, one the
    driver reads itself (`ember.cli.main` sets it in this process when a test calls it), those
    Ember forwards to a joined cluster's workers (`runtimes.RayRuntime.start`), and the token's
    (`ray.init` of a local Ray sets `RAY_AUTH_MODE` in the process that calls it)."""

    def __init__(self) -> None:
        self.address: str | None = None
        self.environment: dict[str, str] = {}
        self._process: subprocess.Popen | None = None
        self._temp: Path | None = None

    def joinable(self, argv: list[str]) -> bool:
        """Whether `ember ARGV` (run in a process of its own) can join the shared cluster: a
        fresh `train` or a single-setup `certify`, with no Ray settings of its own, and this
        process's environment the cluster's (or no cluster yet)."""
        words = " ".join(argv)
        if argv[0] not in ("train", "certify") or "--resume" in argv or "--matrix" in argv:
            return False
        if any(f"ray.{key}=" in words for key in ("address", "object_store_mb", "num_cpus")):
            return False
        return self.address is None or self._environment() == self.environment

    def join(self, argv: list[str]) -> tuple[list[str], dict[str, str]]:
        """`argv` and the environment that run it on the shared cluster (started if need be)."""
        if self.address is None:
            self._start()
        argv = [*argv, "--set", f"ray.address={self.address}", "--set", "ray.object_store_mb=null"]
        return argv, {**os.environ, **self.JOIN_ENV}

    def _environment(self) -> dict[str, str]:
        return {k: v for k, v in os.environ.items() if k not in self.IGNORED}

    def _start(self) -> None:
        from ember_rollout.sglang_launch import free_port

        self.environment = self._environment()
        port = free_port("127.0.0.1")
        # A directory of its own: Ray's default one holds the address file through which a bare
        # `ray.init()` (some tests' own Ray) would join this cluster instead of starting one.
        temp = Path(tempfile.mkdtemp(prefix="ember-ray-"))
        logs = temp / "start.log"
        command = [
            sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
            "--node-ip-address=127.0.0.1", f"--port={port}", f"--num-cpus={os.cpu_count() or 1}",
            "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}",
        ]  # fmt: skip
        with open(logs, "wb") as sink:
            # The workers get this environment for the session: the variables a run forwards
            # itself (a plant, the verbosity) stay out of it, whichever test starts the cluster.
            self._process = subprocess.Popen(
                command,
                stdout=sink,
                stderr=subprocess.STDOUT,
                env={**self.environment, **RAY_ENV, **self.JOIN_ENV},
                start_new_session=True,
            )
        self._temp = temp
        atexit.register(self.stop)
        deadline = time.monotonic() + 120
        while b"Ray runtime started" not in logs.read_bytes():
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the tests' Ray cluster did not start: see {logs}")
            time.sleep(0.2)
        self.address = f"127.0.0.1:{port}"

    def stop(self) -> None:
        """Stop the cluster and every process under it (its workers too)."""
        from ember import processes

        if self._process is None:
            return
        tree = processes.descendants([self._process.pid]) | {self._process.pid}
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._process.pid, signal.SIGTERM)  # `ray start --block` stops its Ray
        processes.reap(tree, timeout=10)
        self._process.wait()
        self._process = None
        self.address = None
        if self._temp is not None:  # Ray's session logs of the whole test session
            shutil.rmtree(self._temp, ignore_errors=True)
            self._temp = None


SHARED_RAY = SharedRay()


class ForkServer:
    """The session's fork server (`resume_harness.Launcher`), started on first use: it imports
    Ember and its libraries once, and each command that needs a process of its own is a fresh
    child forked from it, with the test's environment, rather than a new interpreter that
    imports them again (about 5 s of a command under Ray, 15 s of one that trains in its own
    process, on a 2-core AMD EPYC)."""

    def __init__(self) -> None:
        self._launcher: Any = None
        self._logs: Path | None = None

    def close(self) -> None:
        """Stop the server and the child it runs, if any."""
        from ember import processes

        launcher, self._launcher = self._launcher, None
        if launcher is None:
            return
        server = launcher.server
        tree = processes.descendants([server.pid]) | {server.pid}
        with contextlib.suppress(OSError, ValueError, subprocess.TimeoutExpired):
            launcher.close(timeout=5)  # a server waiting on a child does not exit: reaped
        processes.reap(tree, timeout=5)
        if self._logs is not None:
            shutil.rmtree(self._logs, ignore_errors=True)

    def run(
        self, argv: list[str], *, timeout: float, env: dict[str, str] | None
    ) -> subprocess.CompletedProcess:
        """`ember ARGV` in a child, as `subprocess.run` would return it (a child that outlives
        `timeout` is stopped and raises `subprocess.TimeoutExpired`)."""
        from resume_harness import Launcher

        if self._launcher is None:
            self._logs = Path(tempfile.mkdtemp(prefix="ember-forks-"))
            self._launcher = Launcher(self._logs / "server.log")
            atexit.register(self.close)
        with tempfile.TemporaryDirectory(prefix="ember-command-") as where:
            out, err = Path(where) / "stdout", Path(where) / "stderr"
            try:
                code = self._launcher.launch(
                    argv,
                    out,
                    err=err,
                    env=dict(os.environ if env is None else env),
                    timeout=timeout,
                    cwd=os.getcwd(),
                )
            except BaseException:
                # Interrupted (pytest-timeout, ^C) while a child runs: its exit code would be
                # the next command's answer. The server and its child go; the next starts anew.
                self.close()
                raise
            command = ["ember", *argv]
            stdout = out.read_text(errors="replace") if out.exists() else ""
            stderr = err.read_text(errors="replace") if err.exists() else ""
        if code == -signal.SIGALRM:
            raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
        return subprocess.CompletedProcess(command, code, stdout, stderr)


FORKS = ForkServer()


def ember_command(
    argv: list[str],
    *,
    timeout: float = 300,
    here: bool | None = None,
    shared_ray: bool = True,
) -> subprocess.CompletedProcess:
    """`ember ARGV` here (`ember_here`) or in a process of its own (`ForkServer`) within
    `timeout` seconds; `here` None: here exactly when its roles fit one process
    (`fits_one_process`).
    A run in a process of its own joins the session's Ray cluster (`SharedRay`) where it can,
    unless `shared_ray` is False (a test of Ray's start, shutdown or leftovers)."""
    if here is None:
        here = fits_one_process(argv)
    if here:
        return ember_here(argv)
    env = None
    # A run that fits one process but is asked to run in a process of its own (`here` False)
    # stays off Ray: a Ray address would make every role a Ray actor.
    if shared_ray and not fits_one_process(argv) and SHARED_RAY.joinable(argv):
        argv, env = SHARED_RAY.join(argv)
    return FORKS.run(argv, timeout=timeout, env=env)
