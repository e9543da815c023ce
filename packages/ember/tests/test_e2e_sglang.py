"""`ember train` with the real SGLang server on CPU (`engine.kind=sglang`): the server launches
from the trainer's export, weights reach it by broadcast over gloo, and the seed scenario (R3
with the CI checks) holds with SGLang's own routed experts."""

from __future__ import annotations

import pytest
from test_e2e import ON_POLICY, ember, records

from ember_rollout import sglang_cpu

pytestmark = [
    pytest.mark.slow,
    pytest.mark.sglang,
    pytest.mark.skipif(
        not sglang_cpu.sglang_installed(), reason=f"needs SGLang: {sglang_cpu.EXTRA_HINT}"
    ),
]

SGLANG = ("--set", "engine.kind=sglang")
CI_R3 = ("--plugins", "r3_routing,ci_kl_checker", "--set", "ci.test=true")


def test_r3_and_the_ci_checks_on_the_real_sglang_engine_then_a_wrong_reference(tmp_path):
    right = ember(
        *SGLANG,
        *CI_R3,
        *ON_POLICY,
        "--set", "algorithm.use_kl_loss=true",  # a reference model, for the reference checks
        "--set", "run.num_rollouts=2",
        "--set", "run.save_interval=0",
        run_dir=tmp_path / "right",
        timeout=900,
    )  # fmt: skip
    assert right.returncode == 0, right.stderr[-3000:]
    rollouts = records(tmp_path / "right", "rollout")
    assert [r["rollout_id"] for r in rollouts] == [0, 1]
    # The actor replayed exactly the experts SGLang's routers chose, in scoring and training.
    assert all(r["rollout/replay_agreement"] == 1.0 for r in rollouts)
    steps = records(tmp_path / "right", "train")
    assert steps[0]["train/ppo_kl"] == 0.0
    # fp32 server and fp32 trainer: the engine's log-probs are the trainer's to rounding.
    assert rollouts[0]["rollout/train_rollout_logprob_abs_diff"] < 1e-5
    logs = sorted((tmp_path / "right" / "sglang").glob("sglang-0-*.log"))
    assert logs and "update_weights_from_distributed" in logs[0].read_text()

    # The reference from other weights than the actor's: the checker stops the run at rollout 0.
    wrong = ember(
        *SGLANG,
        *CI_R3,
        *ON_POLICY,
        "--set", "algorithm.use_kl_loss=true",
        "--set", f"train.ref_load={tmp_path / 'right' / 'hf_init'}",
        "--set", "train.seed=1",
        "--set", "run.num_rollouts=2",
        "--set", "run.save_interval=0",
        run_dir=tmp_path / "wrong",
        timeout=900,
    )  # fmt: skip
    assert wrong.returncode != 0
    assert "ref_replayed_log_probs failed at rollout 0" in wrong.stderr, wrong.stderr[-3000:]
    assert records(tmp_path / "wrong", "train") == []
