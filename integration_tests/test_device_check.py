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
MEMBERS = {
    "ember-core": "packages/core",
    "ember-megatron-backend": "packages/megatron_backend",
    "ember-rollout": "packages/rollout",
    "ember-r3-routing": "plugins/r3_routing",
    "ember-ci-kl-checker": "plugins/ci_kl_checker",
}
"""Ember's own distributions the device check builds, and where each one's project lives."""
PARTS = [
    "environment",
    "train",
    "critic",
    "export",
    "r3",
    "true_on_policy",
    "offload_checkpoint",
    "ipc",
    "broadcast_hf",
    "tied_llama",
    "upcycled_mixtral",
    "pp_tied",
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
    # The script's summary (each part's figures and failed expectations), or its whole tail.
    summary = run.stdout[max(0, run.stdout.find("device check (cpu-dry-run)")) :]
    assert run.returncode == 0, summary[-5000:] + run.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["mode"] == "cpu-dry-run" and results["finished"] and results["passed"]
    assert list(results["parts"]) == PARTS
    for name, part in results["parts"].items():
        assert part["passed"] and not part["failures"] and part["error"] is None, name
        assert part["skipped"] is None, name  # the CPU runs every part, two stages included
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
    steps = train["steps"]
    assert [len(rollout) for rollout in steps] == [2, 2]
    # Each rollout's first step runs the actor on the weights that scored the old log-probs
    # (prepare) with the same kernels: the ratio is exactly 1, so ppo_kl is exactly 0. On
    # rollout 0 the reference is the actor too, so the KL loss is exactly 0 and the loss is the
    # policy-gradient loss alone.
    first, second = steps[0][0], steps[1][0]
    assert train["first_step_ppo_kl"] == first["train/ppo_kl"] == 0.0
    assert train["first_step_kl_loss"] == first["train/kl_loss"] == 0.0
    assert first["train/loss"] == first["train/pg_loss"]
    assert train["rollout_1_first_step_ppo_kl"] == second["train/ppo_kl"] == 0.0
    # Two optimizer steps moved the actor away from the reference (low_var_kl is > 0 off it).
    assert train["rollout_1_first_step_kl_loss"] == second["train/kl_loss"] > 0.0
    for rollout in steps:
        # The second step of a rollout runs on weights one step past its old log-probs.
        assert rollout[1]["train/ppo_kl"] != 0.0 and rollout[1]["train/kl_loss"] > 0.0
        for step in rollout:
            assert all(math.isfinite(v) for v in step.values()) and step["train/grad_norm"] > 0
            # gpu_support.megatron_worker: kl_loss_coef=0.1, no entropy term. fp32 sums of
            # terms near 1e-3: a relative tolerance far above float32's 1.2e-7 rounding.
            assert step["train/loss"] == pytest.approx(
                step["train/pg_loss"] + 0.1 * step["train/kl_loss"], rel=1e-5, abs=1e-9
            )

    exact = figures["true_on_policy"]
    assert exact["dtype"] == "float32" and exact["response_tokens"] > 0
    assert exact["differing_log_probs"] == 0 and exact["max_abs_logprob_diff"] == 0.0

    critic = figures["critic"]
    assert critic["max_abs_value_diff"] == 0.0 and critic["mean_abs_value"] > 0
    assert critic["max_abs_actor_logprob_diff"] > 0

    export = figures["export"]
    assert export["architecture"] == ["Qwen3MoeForCausalLM"] and export["dtype"] == "float32"
    # Megatron and transformers both in float32 on this CPU, but different kernels (fused vs
    # eager attention, other summation orders): gaps of float32 rounding (eps 1.2e-7) through a
    # two-layer model and a log-softmax over logits of order 10, about 1e-6 as measured on
    # AVX2 and AVX-512 machines. 1e-4 leaves a hundredfold margin and still fails on any real
    # mismatch (a wrong weight or a transposed projection moves log-probs by far more).
    assert export["max_abs_logprob_diff"] < 1e-4
    assert export["max_abs_logit_diff_sample_0"] < 1e-4
    assert export["mean_abs_logprob_diff"] <= export["max_abs_logprob_diff"]
    assert export["tolerance_mean"] == 1e-3  # the dry run's own bar (CPU_SIZES), above ours

    r3 = figures["r3"]
    assert r3["samples"] == 4 * 4 and 0 < r3["response_tokens"] <= 4 * 4 * 8
    # The engine generates in bfloat16 and the actor scores in float32, so some tokens route
    # to other experts there: without replay the agreement is below 1 (what makes the replay
    # checks below mean something), and the flipped tokens are the ones that disagree.
    assert 0.0 < r3["routing_agreement_without_replay"] < 1.0
    assert r3["flipped_token_fraction"] > 0.0
    # With replay every router takes the recorded experts, scoring and training alike: counts
    # of agreeing routings over all routings, equal as integers.
    assert r3["routing_agreement_with_replay_scoring"] == 1.0
    assert r3["routing_agreement_with_replay_training"] == 1.0
    assert r3["replay_agreement_metric"] == 1.0
    for key in ("without_replay", "with_replay"):
        assert math.isfinite(r3[f"train_rollout_logprob_abs_diff_{key}"])
    # bf16 engine against the fp32 actor: the gaps are bf16-sized (eps 7.8e-3), not zero.
    assert 0 < r3["train_rollout_logprob_abs_diff_without_replay"] < 0.05
    assert 0 < r3["train_rollout_logprob_abs_diff_with_replay"] < 0.05

    # The hand-off parts, cross-checked: the ipc bucket holds the whole actor in fp32 (the dry
    # run's model fits in it), the offload freed the actor's and the reference's weights (two
    # copies of those bytes), and the broadcast carried them in bf16 (half).
    offload, ipc, broadcast = (figures[k] for k in ("offload_checkpoint", "ipc", "broadcast_hf"))
    actor_bytes = ipc["bucket_bytes"]
    assert offload["optimizer"] == "torch_adamw" and offload["offload_device"] == "cpu"
    # The CPU's AdamW went through megatron-core's ChainedOptimizer, as a GPU run's optimizer
    # does: its two moments and step for every actor parameter were perturbed through it.
    assert offload["optimizer_class"] == "ChainedOptimizer"
    assert offload["optimizer_state_tensors_perturbed"] == 3 * offload["parameters"]
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
    # The receiver sums the very bytes the sender summed, in float64, with the same kernel on
    # the same machine: exactly equal.
    assert ipc["max_abs_sum_diff"] == 0.0
    assert ipc["sender_device"] == ipc["receiver_device"] == "cpu"
    assert ipc["sender_uuid"] is None and ipc["receiver_uuid"] is None
    assert "meta cannot reach a separately launched SGLang server" in ipc["meta_bucket_refusal"]
    assert broadcast["broadcast_bytes"] * 2 == actor_bytes
    assert broadcast["buckets"] >= max(2, -(-broadcast["broadcast_bytes"] // (256 << 10)))
    assert broadcast["served_version"] == "1" and broadcast["mismatched"] == []
    assert broadcast["engine_device"] == "cpu"

    # The model parts: tiny-llama (vocabulary 256, tied) and its upcycle, float32 on both sides.
    # Their log-prob gaps are float32 rounding through two layers of different kernels, about
    # 3e-6 as measured; 1e-4 (the parts' own bar) fails on any wrong or stale weight, which
    # moves them by 1e-3 and more (the stale engine below: about 0.5).
    tied, moe, pp = (figures[k] for k in ("tied_llama", "upcycled_mixtral", "pp_tied"))
    assert tied["model"] == "llama" and tied["optimizer"] == "torch_adamw"
    # One shared parameter: no output-layer weight, and on one stage megatron-core marks it for
    # the DDP hook to take its summed gradient (zero_out_wgrad).
    assert tied["share_embeddings_and_output_weights"] is True
    assert tied["output_layer_parameters"] == [] and tied["zero_out_wgrad"] is True
    assert tied["pushed_lm_head"] is False and tied["pushed_embedding"] is True
    assert tied["tie_word_embeddings"] is True and tied["checkpoint_lm_head"] is False
    # Tokens below 64 in the step: the other 192 rows moved through the output layer alone.
    assert tied["unseen_rows"] == tied["unseen_rows_moved"] == 256 - 64
    assert tied["engine_head_tied"] is True and tied["engine_head_is_trained_embedding"] is True
    assert tied["served_version"] == "1" and tied["broadcast_buckets"] >= 2
    assert 0 < tied["response_tokens"] <= 4 * 4 * 8
    assert tied["max_abs_logprob_diff"] < 1e-4
    assert tied["max_abs_logprob_diff_stale_engine"] > 1e-2

    assert (moe["model"], moe["experts"], moe["topk"]) == ("mixtral", 4, 2)
    # Identical experts compute the dense MLP whatever the router picks.
    assert moe["zero_noise_max_abs_logprob_diff"] < 1e-4
    assert moe["tie_word_embeddings"] is False and moe["pushed_lm_head"] is True
    assert moe["lm_head_starts_as_embedding"] is True
    assert moe["lm_head_and_embedding_apart_after_step"] is True
    assert moe["engine_head_is_pushed_head"] and moe["engine_embedding_is_pushed_embedding"]
    assert moe["served_version"] == "1" and moe["samples"] == 4 * 4
    assert moe["routed_experts_returned"] is True and moe["replay_agreement"] == 1.0
    assert 0.0 <= moe["routing_agreement_without_replay"] <= 1.0
    assert moe["max_abs_logprob_diff_with_replay"] < 1e-4

    assert pp["stages"] == [[True, False], [False, True]] and pp["devices"] == ["cpu", "cpu"]
    assert pp["copies_equal_at_build"] is True and pp["copies_equal_after_step"] is True
    # The first stage's unseen rows get their gradient from the last stage's output layer.
    assert pp["unseen_rows"] == pp["first_stage_unseen_rows_moved"] == 256 - 64
    assert pp["last_stage_unseen_rows_moved"] == 256 - 64
    # Both stages push what the one-stage model pushes: the embedding once, no lm_head.
    assert pp["pushed_tensors"] == tied["pushed_tensors"] and pp["pushed_embedding_times"] == 1
    assert pp["pushed_lm_head"] is False and pp["same_names_on_both_stages"] is True
    assert pp["tie_word_embeddings"] is True and pp["checkpoint_lm_head"] is False
    assert pp["same_log_probs_on_both_stages"] is True
    assert pp["max_abs_logprob_diff_export"] < 1e-4


def load_device_check_parts():
    load_device_check()  # puts tools/ on sys.path
    import device_check_parts

    return device_check_parts


def test_the_offload_part_reaches_optimizer_state_as_megatron_cores_optimizer_offers_it():
    """On a GPU the optimizer is megatron-core 0.16.1's `ChainedOptimizer`
    (`get_megatron_optimizer`, optimizer/__init__.py 689), whose `state` is a `ProxyDict`
    with `items()` and no `values()` (optimizer/optimizer.py 1038-1073, 1125-1131). The real
    class, built here on the CPU around torch's AdamW as the dry run builds it, must take the
    offload part's perturbation and hand its state dict through unchanged."""
    import torch
    from megatron.core.optimizer.optimizer import ChainedOptimizer, ProxyDict

    parts = load_device_check_parts()
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2, 2))]
    adamw = torch.optim.AdamW(params, lr=0.1)
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    adamw.step()
    chained = parts.as_chained_optimizer(adamw)
    assert isinstance(chained, ChainedOptimizer) and parts.as_chained_optimizer(chained) is chained
    assert isinstance(chained.state, ProxyDict) and not hasattr(chained.state, "values")
    before = {id(p): {k: v.clone() for k, v in adamw.state[p].items()} for p in params}

    # step, exp_avg and exp_avg_sq of both parameters (torch keeps `step` as a float tensor).
    assert parts.perturb_optimizer_state(chained, by=1.0) == 3 * len(params)
    for p in params:
        for key, value in adamw.state[p].items():
            assert torch.equal(value, before[id(p)][key] + 1.0), key
    # One chained optimizer: its state dict is the inner one's, and loads back into it.
    assert chained.state_dict().keys() == adamw.state_dict().keys() == {"state", "param_groups"}
    assert chained.param_groups == adamw.param_groups


def test_two_pipeline_stages_on_one_gpu_are_skipped_with_the_reason(monkeypatch):
    """NCCL puts one rank per GPU, so pp_tied cannot run its two stages on a one-GPU runner:
    it says so and starts nothing (the run would otherwise record the stages' figures)."""
    import torch

    device_check = load_device_check()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    sizes = device_check.Sizes(
        device="cuda",
        dtype="bfloat16",
        prompts=1,
        samples_per_prompt=1,
        response_len=1,
        logprob_tolerance=1.0,
    )
    result = device_check.run_part(device_check.PARTS["pp_tied"], sizes)
    assert result["passed"] and result["error"] is None and result["figures"] == {}
    assert result["skipped"].startswith("PP = 2 needs two GPUs, one rank each")
    assert "1 visible" in result["skipped"]
    lines = device_check.summary_lines({"mode": "gpu", "passed": True, "parts": {"pp": result}})
    assert lines[1].startswith("  skip pp (") and lines[2] == f"    skipped: {result['skipped']}"


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


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _image_versions() -> dict[str, str | None]:
    """tools/device_image.txt: each package of the runner's image, with its version where one
    was read there (NAME==VERSION), else None."""
    image = {}
    for line in (ROOT / "tools/device_image.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.strip().partition("==")
            image[_canonical(name)] = version or None
    return image


def _carried_versions() -> tuple[list[str], dict[str, str]]:
    """The names tools/device_wheels.sh downloads at their uv.lock versions, and the version of
    every wheel it carries (locked ones from uv.lock, the build backend's as pinned there)."""
    script = (ROOT / "tools/device_wheels.sh").read_text()
    arrays = dict(re.findall(r"^(LOCKED|BUILD_BACKEND)=\((.*)\)$", script, re.MULTILINE))
    lock = {p["name"]: p for p in tomllib.loads((ROOT / "uv.lock").read_text())["package"]}
    locked = [_canonical(w) for w in shlex.split(arrays["LOCKED"])]
    carried = {name: lock[name]["version"] for name in locked}
    for pin in shlex.split(arrays["BUILD_BACKEND"]):
        name, _, version = pin.partition("==")
        carried[_canonical(name)] = version
    return locked, carried


HATCHLING_REQUIRES = (
    "packaging>=24.2",
    "pathspec>=0.10.1",
    "pluggy>=1.0.0",
    "tomli>=1.2.2; python_version < '3.11'",
    "tomlkit>=0.11.1",
    "trove-classifiers",
)
"""hatchling 1.33.0's Requires-Dist (its wheel's METADATA). It builds Ember's packages on the
runner before any requirement can be checked there, so each of these must be met by a version
known here; packaging >= 24.2 for `packaging.licenses` (hatchling metadata/core.py 702)."""
RUNNER = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "os_name": "posix",
    "extra": "",
}
"""Marker environment of the runner's Python."""


def test_carried_and_image_versions_meet_every_bounded_requirement():
    """Each requirement of what the GPU form builds and installs (hatchling, ember's packages,
    the carried wheels), with its version bounds, against the version the runner will hold:
    the carried wheel's, else the image's as read there. A bound on an image package whose
    version was never read is left to `tools/device_check.sh --requirements-only`, the GPU
    run's first command, only where that check covers it: stated by one of
    device_check.DISTRIBUTIONS (today aiohttp, pyyaml, regex and tqdm), never by the build
    backend, which runs before it. Without packaging carried, hatchling 1.33 (packaging >=
    24.2) would rest on the image's unread packaging and the build would stop there."""
    from importlib import metadata

    from packaging.requirements import Requirement

    device_check = load_device_check()
    image = _image_versions()
    locked, carried = _carried_versions()
    members = MEMBERS
    requirements = [("hatchling", Requirement(line)) for line in HATCHLING_REQUIRES]
    for member, folder in members.items():
        project = tomllib.loads((ROOT / folder / "pyproject.toml").read_text())["project"]
        requirements += [(member, Requirement(r)) for r in project["dependencies"]]
    for name in locked:  # the locked environment holds the very versions carried
        assert metadata.version(name) == carried[name], name
        requirements += [(name, Requirement(r)) for r in metadata.requires(name) or []]

    checked_there = set(device_check.DISTRIBUTIONS)
    unmet, unread = [], []
    for by, req in requirements:
        name = _canonical(req.name)
        if name in members or (req.marker is not None and not req.marker.evaluate(RUNNER)):
            continue
        version = carried.get(name) or image.get(name)
        if version is None:
            if str(req.specifier) and by not in checked_there:
                unread.append(f"{by} needs {req}")
        elif not req.specifier.contains(version, prereleases=True):
            unmet.append(f"{by} needs {req}: {version} on the runner")
    assert unmet == []
    # Record the image's version in tools/device_image.txt, or carry the package.
    assert unread == [], "bounds on image packages of unread version, checked nowhere first"


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
    members = MEMBERS
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
