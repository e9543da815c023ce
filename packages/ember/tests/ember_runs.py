"""`ember train` from a test, in this process where the run's actors would be in one process
anyway, in a process of its own otherwise.

A run whose roles fit one process (`ember.layout.in_process`) is called here, through
`ember.cli.main`, as the command calls it: the same config, plugins, driver and actors, only
without starting an interpreter and importing torch, transformers and megatron-core again (about
9 s of each run on a 2-core AMD EPYC, a third to a half of a short test run). Runs that need Ray
(several ranks or engines, SGLang servers, `ray.enabled=true`) and runs that a test kills keep a
process of their own.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import sys
import traceback


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


def ember_command(
    argv: list[str], *, timeout: float = 300, here: bool | None = None
) -> subprocess.CompletedProcess:
    """`ember ARGV` here (`ember_here`) or as `python -m ember.cli ARGV` within `timeout`
    seconds; `here` None: here exactly when its roles fit one process (`fits_one_process`)."""
    if here is None:
        here = fits_one_process(argv)
    if here:
        return ember_here(argv)
    return subprocess.run(
        [sys.executable, "-m", "ember.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
