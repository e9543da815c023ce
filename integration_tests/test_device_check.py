"""The device check on the CPU: `tools/device_check.sh --cpu-dry-run` runs every part of the GPU
check in CI-sized form, so the script that only a GPU runner runs for real cannot rot."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARTS = [
    "environment",
    "train",
    "critic",
    "export",
    "r3",
    "offload_checkpoint",
    "ipc",
    "broadcast_hf",
]


def load_device_check():
    spec = importlib.util.spec_from_file_location("device_check", ROOT / "tools/device_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while decorating
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_cpu_dry_run_passes_every_part_with_its_figures(tmp_path):
    out = tmp_path / "check" / "device_check.json"
    run = subprocess.run(
        ["bash", str(ROOT / "tools/device_check.sh"), "--cpu-dry-run", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-5000:]
    results = json.loads(out.read_text())
    assert results["mode"] == "cpu-dry-run" and results["finished"] and results["passed"]
    assert list(results["parts"]) == PARTS
    for name, part in results["parts"].items():
        assert part["passed"] and not part["failures"] and part["error"] is None, name
        assert part["seconds"] > 0, name
    log = (tmp_path / "check" / "device_check.log").read_text()
    assert "device check (cpu-dry-run): PASSED" in log

    figures = {name: part["figures"] for name, part in results["parts"].items()}
    env = figures["environment"]
    assert env["cuda_available"] is False and env["transformer_engine"] is False
    assert {"r3_routing", "ci_kl_checker"} <= set(env["entry_point_plugins"])
    assert env["unmet_requirements"] == []
    assert env["versions"]["megatron-core"] == "0.16.1"

    train = figures["train"]
    assert train["optimizer"] == "torch_adamw" and train["param_dtype"] == "float32"
    assert train["first_step_ppo_kl"] == 0.0 and train["first_step_kl_loss"] == 0.0
    assert train["rollout_1_first_step_ppo_kl"] == 0.0
    assert train["rollout_1_first_step_kl_loss"] > 0.0
    assert [len(steps) for steps in train["steps"]] == [2, 2]
    for step in (s for steps in train["steps"] for s in steps):
        assert all(math.isfinite(v) for v in step.values()) and step["train/grad_norm"] > 0

    critic = figures["critic"]
    assert critic["max_abs_value_diff"] == 0.0 and critic["mean_abs_value"] > 0
    assert critic["max_abs_actor_logprob_diff"] > 0

    export = figures["export"]
    assert export["architecture"] == ["Qwen3MoeForCausalLM"]
    assert export["mean_abs_logprob_diff"] < export["tolerance_mean"]
    assert export["max_abs_logprob_diff"] < 1e-3 and export["max_abs_logit_diff_sample_0"] < 1e-3

    r3 = figures["r3"]
    assert r3["samples"] == 4 * 4 and r3["response_tokens"] > 0
    assert r3["routing_agreement_with_replay_scoring"] == 1.0
    assert r3["routing_agreement_with_replay_training"] == 1.0
    assert r3["replay_agreement_metric"] == 1.0
    assert 0.0 <= r3["routing_agreement_without_replay"] <= 1.0
    for key in ("without_replay", "with_replay"):
        assert math.isfinite(r3[f"train_rollout_logprob_abs_diff_{key}"])

    # The hand-off parts, cross-checked: the ipc bucket holds the whole actor in fp32 (the dry
    # run's model fits in it), the offload freed the actor's and the reference's weights (two
    # copies of those bytes), and the broadcast carried them in bf16 (half).
    offload, ipc, broadcast = (figures[k] for k in ("offload_checkpoint", "ipc", "broadcast_hf"))
    actor_bytes = ipc["bucket_bytes"]
    assert offload["optimizer"] == "torch_adamw" and offload["offload_device"] == "cpu"
    assert offload["freed_weight_bytes"] == 2 * actor_bytes
    # AdamW's two moments and the fp32 gradient buffer: three actor-sized storages, plus steps.
    assert 3 * actor_bytes <= offload["freed_training_state_bytes"] < 3 * actor_bytes + 4096
    assert offload["restored_bytes"] == (
        offload["freed_weight_bytes"] + offload["freed_training_state_bytes"]
    )
    assert offload["parameters_empty_while_saving"] is True
    assert offload["parameters_differing_after_load"] == 0
    assert offload["optimizer_state_differences"] == []
    assert offload["checkpoint_bytes"] > 2 * actor_bytes  # weights of both roles + moments
    assert ipc["tensors"] == broadcast["tensors"] and ipc["names_received"] is True
    assert ipc["max_abs_sum_diff"] == 0.0 and ipc["receiver_device"] == "cpu"
    assert "CUDA tensors only" in ipc["cpu_bucket_refusal"]
    assert broadcast["broadcast_bytes"] * 2 == actor_bytes
    assert broadcast["buckets"] >= -(-broadcast["broadcast_bytes"] // (256 << 10))
    assert broadcast["served_version"] == "1" and broadcast["mismatched"] == []
    assert broadcast["engine_device"] == "cpu"


def test_a_failing_part_is_recorded_and_the_others_still_run(tmp_path, monkeypatch, capsys):
    device_check = load_device_check()

    def boom(part, sizes):
        part.record(before="recorded")
        raise RuntimeError("boom")

    def unmet(part, sizes):
        part.record(value=2)
        part.expect(False, "value 2 is not 3")

    def fine(part, sizes):
        part.record(device=sizes.device)

    monkeypatch.setattr(device_check, "PARTS", {"boom": boom, "unmet": unmet, "fine": fine})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # main() hides CUDA; restored afterwards
    out = tmp_path / "device_check.json"

    assert device_check.main(["--cpu-dry-run", "--out", str(out)]) == 1
    results = json.loads(out.read_text())
    assert results["finished"] and not results["passed"]
    parts = results["parts"]
    assert list(parts) == ["boom", "unmet", "fine"]
    assert not parts["boom"]["passed"] and parts["boom"]["figures"] == {"before": "recorded"}
    assert "RuntimeError: boom" in parts["boom"]["error"]
    assert not parts["unmet"]["passed"] and parts["unmet"]["failures"] == ["value 2 is not 3"]
    assert parts["unmet"]["error"] is None
    assert parts["fine"]["passed"] and parts["fine"]["figures"] == {"device": "cpu"}
    printed = capsys.readouterr().out
    assert "FAIL boom" in printed and "failed: value 2 is not 3" in printed


def _name(requirement: str) -> str:
    return re.split(r"[\s;<>=!~\[(]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_the_carried_wheels_complete_the_runner_image():
    """Every requirement of what the GPU form installs is in the runner's image or carried by
    device_wheels.sh: the environment part fails on any unmet one, and the runner has no
    network. (`tools/device_check.sh --requirements-only` checks the same on a built copy of
    the image; the README's GPU section says how.)"""
    device_check = load_device_check()
    image = {
        _name(line)
        for line in (ROOT / "tools/device_image.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    script = (ROOT / "tools/device_wheels.sh").read_text()
    arrays = dict(re.findall(r"^(LOCKED|BUILD_BACKEND)=\((.*)\)$", script, re.MULTILINE))
    locked = [_name(w) for w in shlex.split(arrays["LOCKED"])]
    carried = set(locked) | {_name(w) for w in shlex.split(arrays["BUILD_BACKEND"])}
    lock = {p["name"]: p for p in tomllib.loads((ROOT / "uv.lock").read_text())["package"]}
    members = {
        "ember-core": "packages/core",
        "ember-megatron-backend": "packages/megatron_backend",
        "ember-rollout": "packages/rollout",
        "ember-r3-routing": "plugins/r3_routing",
        "ember-ci-kl-checker": "plugins/ci_kl_checker",
    }
    assert set(members) <= set(device_check.DISTRIBUTIONS)
    needed: dict[str, str] = {}
    for member, folder in members.items():
        project = tomllib.loads((ROOT / folder / "pyproject.toml").read_text())["project"]
        for requirement in project["dependencies"]:
            needed.setdefault(_name(requirement), member)
    for name in locked:  # what a carried wheel needs, as uv.lock resolved it
        for dependency in lock[name].get("dependencies", []):
            if (
                "marker" not in dependency
                or "python_full_version < '3.12'" not in dependency["marker"]
            ):
                needed.setdefault(dependency["name"], name)
    missing = sorted(
        f"{name} (for {by})"
        for name, by in needed.items()
        if name not in image | carried | set(members)
    )
    assert missing == [], f"neither in the runner's image nor carried: {missing}"
