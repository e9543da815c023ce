"""`ember train` with the real SGLang server on CPU (`engine.kind=sglang`): the server launches
from the trainer's export, weights reach it by broadcast over gloo, and the seed scenario (R3
with the CI checks and a reference) holds with SGLang's own routed experts on the overlapped
loop, pushes landing while requests run.

One run makes every assertion: a server launch costs about 75 s of a 2-core machine. R3 with the
CI checks on the real server's prefix cache (which partial rollouts turn off) is
`test_e2e_smollm2.py`'s upcycled MoE on SGLang; the overlapped loop without partial rollouts on
the real server is `test_engine_faults_ray.py`'s killed-server run."""

from __future__ import annotations

import json
import re

import pytest
from test_e2e import ember, records

from ember_rollout import sglang_cpu

pytestmark = [
    pytest.mark.slow,
    pytest.mark.sglang,
    pytest.mark.skipif(
        not sglang_cpu.sglang_installed(), reason=f"needs SGLang: {sglang_cpu.EXTRA_HINT}"
    ),
]


def test_partial_rollouts_on_the_real_sglang_server_keep_routes_and_log_probs_together(tmp_path):
    """Pushes land while SGLang requests run (paused in place, continued after), and R3 with
    the CI checks holds: every token's recorded experts and log-prob come from one forward."""
    run = ember(
        "--set", "engine.kind=sglang",
        "--set", "rollout.partial_rollouts=true",
        "--set", "rollout.max_staleness=2",
        "--plugins", "r3_routing,ci_kl_checker",
        "--set", "ci.test=true",
        "--set", "algorithm.use_kl_loss=true",  # a reference model, for the reference checks
        "--set", "ci_kl_checker.audit_interval=4",
        # One request at a time, and answers of up to 64 tokens: a rollout's 16 requests then
        # take 2.6-3.3 s on a 2-core AMD EPYC (family 23), longer than a training step and its
        # push (about 1.2 s there), so each of the three pushes between the audits at 0 and 4
        # finds one running. (At the default 8 tokens the requests took a fraction of the push's
        # second and only some pushes found one.)
        "--set", "engine.sglang.max_concurrency=1",
        "--set", "rollout.max_response_len=64",
        "--set", "rollout.rollout_batch_size=8",
        "--set", "run.num_rollouts=5",
        "--set", "run.save_interval=0",
        "--set", "run.dump_rollouts=true",
        run_dir=tmp_path,
        timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    rollouts = records(tmp_path, "rollout")
    assert [r.get("rollout/audit") for r in rollouts] == [1.0, None, None, None, 1.0]
    multi_version = 0
    for rollout_id, r in enumerate(rollouts):
        dump = (tmp_path / "rollouts" / f"{rollout_id:06d}.jsonl").read_text().splitlines()
        for line in dump[1:]:  # after the dump's header
            versions = json.loads(line)["weight_versions"]
            numbers = [int(v) for _, v in versions]
            assert numbers == sorted(set(numbers)) and rollout_id - 1 - numbers[0] <= 2
            multi_version += len(versions) > 1
        assert r["rollout/staleness_max"] <= 2
    # Pushes landed mid-request: the server recorded spans of two versions in some samples.
    assert multi_version > 0
    assert sum(r["rollout/multi_version_samples"] * r["rollout/num_samples"] for r in rollouts) == (
        multi_version
    )
    for audit in rollouts[::4]:
        # An audit generates in turn, from the trainer's current weights: fp32 server and fp32
        # trainer, same weights, so the engine's log-probs are the trainer's to rounding, per
        # token, and the actor replayed exactly the experts SGLang chose.
        assert audit["rollout/staleness"] == 0.0
        assert audit["rollout/multi_version_samples"] == 0.0
        assert audit["rollout/train_rollout_logprob_max_abs_diff"] <= 1e-4
        assert audit["rollout/replay_agreement"] == 1.0
    # At rollout 0 the reference, replaying the actor's routing, is the actor.
    assert rollouts[0]["rollout/ref_replayed_log_probs_max_abs_diff"] < 1e-8
    steps = records(tmp_path, "train")
    assert steps and all(s["train/replay_agreement"] == 1.0 for s in steps)
    # The first step of each audited rollout starts exactly on-policy.
    firsts = {}
    for s in steps:
        firsts.setdefault(s["rollout_id"], s)
    assert [firsts[i]["train/ppo_kl"] for i in (0, 4)] == [0.0, 0.0]
    output = run.stderr + run.stdout
    checks = ("train_rollout_mismatch_max", "first_step_ppo_kl_max", "replay_agreement")
    for audit_id in (0, 4):
        for check in (*checks, "recorded_routing_agreement"):
            assert re.search(rf"audit rollout {audit_id}\b[^\n]*: {check} passed: ", output), (
                audit_id,
                check,
            )
    # The first rollout after audit 0 that holds stale samples is the off-policy audit.
    for check in ("recorded_versions", "replay_agreement"):
        found = re.search(rf"off-policy audit rollout [123]\b[^\n]*: {check} passed: ", output)
        assert found, check
    # The server logged to the run directory, took the pushes by broadcast and
    # paused for the pushes that found requests running.
    (log,) = (tmp_path / "sglang").glob("sglang-0-*.log")
    assert "update_weights_from_distributed" in log.read_text()
    assert "pause_generation" in log.read_text()
