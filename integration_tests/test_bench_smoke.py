"""The run-level benchmarks end to end at the smallest sizes: `tools/bench_e2e.py`,
`tools/bench_weights.py` and `tools/bench_peer.py` (both sides: Ember, and TRL from the `peer`
group, which CI installs). Each runs as a user runs it, in its own process; the tests check the
figures it prints and the files it writes, not its timings."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from tools_loader import ROOT, load_tool

pytestmark = pytest.mark.slow

ENV = {**os.environ, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "RAY_USAGE_STATS_ENABLED": "0"}
# A few prompts per rollout, so that a run is seconds of work after its start-up.
SMALL = ["rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4"]


def _run(*argv: str, timeout: float) -> str:
    done = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=ENV, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _figure(pattern: str, text: str) -> re.Match:
    match = re.search(pattern, text, flags=re.M)
    assert match is not None, (pattern, text)
    return match


def test_bench_e2e_prints_every_phase_and_the_engines_ratio_of_the_rollout_phase():
    sets = [arg for s in SMALL for arg in ("--set", s)]
    out = _run("tools/bench_e2e.py", "--rollouts", "2", "--rows", "phases,engines", *sets,
               timeout=900)  # fmt: skip
    _figure(r"^default: 1 iterations measured \(after 1 warm-up\), 16 samples", out)
    shares, seconds = [], []
    for label in ("rollout \\(waited\\)", "ref \\+ old log-probs", "training", "weight push"):
        row = _figure(rf"^{label}\s+(\d+\.\d+)\s+(\d+\.\d+)%\s+(\d+\.\d+)$", out)
        seconds.append(float(row.group(1)))
        shares.append(float(row.group(2)))
    # The phases run in turn (rollout.async=false), so they make up almost all the iteration.
    assert 50.0 < sum(shares) <= 100.5, shares
    ratio = _figure(r"^rollout phase, 2 engines x 1 thread vs 1 engine x 2 threads: "
                    r"(\d+\.\d+) vs (\d+\.\d+) s/iter -> (\d+\.\d+)x", out)  # fmt: skip
    two, one = float(ratio.group(1)), float(ratio.group(2))
    # The rollout phase itself, not the wait of an overlapped loop (milliseconds): both sides
    # generate the same 16 samples as the in-turn run above, whose rollout phase took
    # `seconds[0]`, so neither can be many times faster than it on the same machine.
    assert two > seconds[0] / 4 and one > seconds[0] / 4, out


def test_bench_weights_reports_both_paths_for_both_sizes():
    out = _run("tools/bench_weights.py", "--pushes", "2", timeout=900)
    rows = re.findall(
        r"^(tiny-moe|large)\s+(\d+\.\d+)M\s+(\d+\.\d+)\s+(broadcast|object store)\s+"
        r"(\d+\.\d+)\s+(\d+\.\d+)\s+(\d+)$",
        out,
        flags=re.M,
    )
    assert {(r[0], r[3]) for r in rows} == {
        ("tiny-moe", "broadcast"), ("tiny-moe", "object store"),
        ("large", "broadcast"), ("large", "object store"),
    }, out  # fmt: skip
    params = {r[0]: float(r[1]) for r in rows}
    assert params["large"] > 5 * params["tiny-moe"]  # the larger model is about 10x
    _figure(r"^driver peak RSS, broadcast, large vs tiny-moe: ", out)
    _figure(r"^median push time, large, broadcast vs object store: ", out)
    assert "warning" not in out


def test_bench_peer_runs_every_side_and_writes_their_results(tmp_path):
    pytest.importorskip("trl", reason="TRL is in the `peer` dependency group (CI installs it)")
    bench_peer = load_tool("bench_peer")
    rollouts = 2
    sets = [arg for s in SMALL for arg in ("--set", s)]
    out = _run("tools/bench_peer.py", "--rollouts", str(rollouts), "--out", str(tmp_path),
               *sets, timeout=1500)  # fmt: skip
    # The mapping it prints is the one it hands TRL.
    overrides = bench_peer.ember_overrides("copy", 3, 3, rollouts, None, SMALL)
    mapping = bench_peer.trl_mapping(bench_peer.load_run_config(overrides))
    assert bench_peer.format_mapping(mapping) in out
    where = tmp_path / "copy-3-3" / "seed-config"
    for side in ("ember", bench_peer.IN_TURN, "trl"):
        result = json.loads((where / side / bench_peer.RESULT).read_text())
        assert result["side"] == side and result["sets"] == overrides
        # Ember's in-turn loop is the same run with rollout.async off.
        in_turn = "rollout.async=false" in result["command"]
        assert in_turn == (side == bench_peer.IN_TURN)
        # (rollout id, seconds since the command started, mean reward) per rollout
        assert [r[0] for r in result["records"]] == list(range(rollouts))
        for _, seconds, reward in result["records"]:
            assert 0.0 < seconds <= result["wall_s"] and 0.0 <= reward <= 1.0
        assert result["wall_s"] > 0
    spec = json.loads((where / "trl" / "spec.json").read_text())
    assert {k: v for k, v in spec["grpo"].items() if k != "output_dir"} == {
        k: v for k, v in mapping.kwargs.items() if k != "output_dir"
    }
    header = r"^\s+Ember\s+Ember in turn\s+TRL\s+Ember/TRL\s+in turn/TRL$"
    assert re.search(header, out, flags=re.M), out  # the table
    assert re.search(r"^machine: .+, \d+ cores, load \d", out, flags=re.M), out


def test_bench_quantization_prints_each_mode_with_pushed_bytes_and_the_ratio():
    sets = [arg for s in [*SMALL, "engine.quantization_group_size=32"] for arg in ("--set", s)]
    out = _run("tools/bench_quantization.py", "--rollouts", "10", "--seeds", "1", "--modes",
               "full", "int4+qat", *sets, timeout=900)  # fmt: skip
    pushed = {}
    for mode in ("full", "int4\\+qat"):
        row = _figure(rf"^seed 1, {mode}: reward last (\S+), .* push MB (\S+), s/iter", out)
        assert 0.0 <= float(row.group(1)) <= 1.0
        pushed[mode] = float(row.group(2))
    # INT4 is an eighth of fp32's bytes, plus scales and the tensors left in full precision
    # (embeddings, norms, routers, the output layer).
    assert pushed["int4\\+qat"] < 0.5 * pushed["full"]
    _figure(r"^last-10 reward, int4\+qat / full: \d+\.\d+, target >= 0.95 \((met|NOT met)\)", out)
