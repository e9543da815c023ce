"""`ember certify --matrix` without running a certificate: which setups it certifies and the
page it writes. There is no loop dimension (the certifier measures in turn whatever the loop)."""

from __future__ import annotations

import pytest

from ember import certify_matrix as matrix
from ember.cli import main


def test_every_preset_and_layout_once_and_no_loop_dimension():
    combos = matrix.combinations(families=["llama", "deepseek_v3"], engines=["hf"])
    seen = [(c.preset, c.layout) for c in combos if c.config is None]
    assert len(seen) == len(set(seen))  # one setup per preset and layout, not one per loop
    assert ("tiny-deepseek-v3", "ep2") in seen and ("tiny-llama", "tp2") in seen
    for c in combos:
        sets = c.overrides()
        assert not any(s.startswith("rollout.max_staleness") for s in sets)
        if c.config is None:
            assert "rollout.async=false" in sets  # what the certifier measures anyway, said


def test_sglang_is_certified_in_layout_1_only_unless_named():
    combos = matrix.combinations(families=["qwen3_moe"], engines=None)
    sglang = {c.layout for c in combos if c.engine == "sglang"}
    assert sglang <= {matrix.SGLANG_LAYOUT}
    named = matrix.combinations(families=["qwen3_moe"], layouts=["ep2"], engines=["sglang"])
    assert [(c.layout, c.engine) for c in named if c.config is None] == [("ep2", "sglang")]


def test_the_page_has_no_loop_column_and_says_why():
    combo = matrix.Combination("tiny-llama", "llama", False, "tp2", "hf")
    outcome = matrix.Outcome(combo, {row: "PASS" for row in matrix.ROWS}, True, 30.0)
    page = matrix.markdown([outcome])
    header = next(line for line in page.splitlines() if line.startswith("| preset"))
    assert header.split(" | ")[:4] == ["| preset", "family", "layout", "engine"]
    assert "| tiny-llama | llama | tp2 | hf | PASS" in page
    assert "There is no loop column" in page


def test_the_loops_option_is_gone(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["certify", "--matrix", "--loops", "in-turn"])
    assert stopped.value.code != 0
    assert "unrecognized arguments: --loops" in capsys.readouterr().err
