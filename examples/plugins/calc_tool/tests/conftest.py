"""Fixtures of the calc_tool tests: the task's files, the plugin on a facade, a tiny engine."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ember_calc_tool import plugin as calc_plugin

ROOT = Path(__file__).resolve().parents[4]
"""The repository root (run configs name their data relative to it)."""
DATA = Path(__file__).resolve().parents[1] / "data"
"""The task's checked-in tokenizer and prompts."""


@pytest.fixture
def data_dir() -> Path:
    return DATA


@pytest.fixture
def reset_plugins():
    """Forget the plugins' configured state (module globals) after the test."""
    yield
    calc_plugin._config = None
    try:
        from ember_r3_routing import plugin as r3_plugin
    except ImportError:
        return
    r3_plugin._config = None


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(autouse=True, scope="module")
def _two_threads():
    """The tiny models gain nothing from more threads on shared cores."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


def hand_calculator_output(call: list[str]) -> str:
    """What the calculator must print for a call (its tokens, `calc` last), worked out here from
    the task's rules rather than by the plugin's `calculate`: the tokens before `calc` joined
    must read as non-negative integers separated by single `+` signs (adjacent digit tokens form
    one number); the output is their sum, and `?` for anything else."""
    assert call[-1] == "calc"
    text = "".join(call[:-1])
    if re.fullmatch(r"[0-9]+(\+[0-9]+)*", text) is None:
        return "?"
    return str(sum(int(number) for number in re.findall(r"[0-9]+", text)))


@pytest.fixture
def calculator_output() -> Callable[[list[str]], str]:
    return hand_calculator_output
