"""The shipped arithmetic prompt sets are what their generator writes, and they read as chats
whose labels the boxed-math reward accepts."""

from __future__ import annotations

import re

from tools_loader import ROOT, load_tool

from ember_rollout.data import read_jsonl


def test_shipped_sets_are_the_generators_output():
    make = load_tool("make_arith_prompts")
    for name, rows in make.make_sets().items():
        path = ROOT / "examples" / "data" / f"arith-{name}.jsonl"
        assert path.read_text() == make.render(rows), f"{path}: run tools/make_arith_prompts.py"


def test_sets_are_disjoint_chats_with_right_labels():
    questions = {}
    for name in ("train", "eval"):
        records = read_jsonl(ROOT / "examples" / "data" / f"arith-{name}.jsonl")
        for record in records:
            system, user = record.prompt
            assert system["role"] == "system" and "\\boxed{}" in system["content"]
            a, op, b = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", user["content"]).groups()
            assert int(record.label) == {"+": int.__add__, "-": int.__sub__, "*": int.__mul__}[op](
                int(a), int(b)
            )
            assert questions.setdefault(user["content"], name) == name  # never in both sets
    assert len(questions) == 1100
