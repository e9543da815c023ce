"""Write the arithmetic prompt sets of the real-model examples (`examples/data/arith-*.jsonl`).

Each line is a chat: a system message asking for the final answer in ``\\boxed{}`` and a user
question (a sum or a difference of two-digit numbers, or a product of one-digit ones), with the
exact answer as its label. The sets are drawn from a seeded generator, so the shipped files are
exactly what

    uv run python tools/make_arith_prompts.py

writes (a test checks it). The train and eval sets never share a question.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = "You are a helpful assistant. Answer briefly and put the final answer in \\boxed{}."
SETS = {"train": 1000, "eval": 100}
"""Prompts per set (file `examples/data/arith-<set>.jsonl`)."""
SEED = 20261204


def question(rng: random.Random) -> tuple[str, int]:
    """One question and its answer: a + b or a - b (two-digit), or a x b (one-digit)."""
    op = rng.choice("+-*")
    if op == "*":
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        return f"What is {a} * {b}?", a * b
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    if op == "-":
        a, b = max(a, b), min(a, b)
        return f"What is {a} - {b}?", a - b
    return f"What is {a} + {b}?", a + b


def make_sets(seed: int = SEED) -> dict[str, list[dict]]:
    """The prompt sets, by name: distinct questions, drawn in order from one seeded stream."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out: dict[str, list[dict]] = {}
    for name, count in SETS.items():
        rows = []
        while len(rows) < count:
            text, answer = question(rng)
            if text in seen:
                continue
            seen.add(text)
            rows.append(
                {
                    "prompt": [
                        {"role": "system", "content": SYSTEM},
                        {"role": "user", "content": text},
                    ],
                    "label": str(answer),
                }
            )
        out[name] = rows
    return out


def render(rows: list[dict]) -> str:
    """JSONL text of a set (one object per line, stable key order)."""
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "examples" / "data")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows in make_sets().items():
        path = args.out / f"arith-{name}.jsonl"
        path.write_text(render(rows))
        print(f"{path}: {len(rows)} prompts")


if __name__ == "__main__":
    main()
