"""Dumped rollouts read back as the samples that were written, with the provenance of the run
that wrote them; a dump another run cannot train on, or a bad one, gets one line before any
process starts."""

from __future__ import annotations

import json

import pytest
import torch

from ember.config import check_debug_halves, check_inputs, dump_path, dump_provenance, load_config
from ember.dumps import experts_path, read_dump, write_dump
from ember_core.types import Sample, SampleStatus

PROVENANCE = {"rollout.temperature": 1.0, "rollout.n_samples_per_prompt": 2, "tokenizer": "toy"}


def _samples(version: str = "-1", dtype: torch.dtype = torch.uint8) -> list[Sample]:
    experts = torch.tensor([[[0, 1]], [[2, 3]], [[1, 0]], [[3, 2]]], dtype=dtype)
    return [
        Sample(
            tokens=[3, 4, 5, 6, 7],
            response_length=2,
            index=0,
            group_index=0,
            prompt="copy 34 =",
            response="67",
            label="34",
            reward=0.5,
            loss_mask=[1, 0],
            rollout_log_probs=[-0.25, -1.5],
            rollout_routed_experts=experts,
            status=SampleStatus.COMPLETED,
            weight_version=version,
            weight_versions=[(0, version), (1, str(int(version) + 1))],
            metadata={"source": "toy:3", "finish_reason": "stop", "difficulty": [1, 2]},
        ),
        Sample(tokens=[3, 4, 9], response_length=1, index=1, reward=0.0, weight_version=version),
    ]


def _equal(got: list[Sample], want: list[Sample]) -> None:
    for g, w in zip(got, want, strict=True):
        if w.rollout_routed_experts is None:
            assert g.rollout_routed_experts is None
        else:
            assert g.rollout_routed_experts.dtype == w.rollout_routed_experts.dtype
            assert torch.equal(g.rollout_routed_experts, w.rollout_routed_experts)
        g.rollout_routed_experts = w.rollout_routed_experts = None
        w.loss_mask = w.effective_loss_mask()
        assert g == w


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32])
def test_a_dump_reads_back_as_the_samples_written_experts_in_a_binary_side_file(tmp_path, dtype):
    path = tmp_path / "rollouts" / "000003.jsonl"
    write_dump(path, _samples(dtype=dtype), PROVENANCE)
    side = experts_path(path)
    assert side.name == "000003.experts.safetensors" and side.is_file()
    # The ids live in the side file, not as JSON integers in the sample lines.
    header, *lines = path.read_text().splitlines()
    assert json.loads(header)["provenance"] == PROVENANCE
    assert [json.loads(line)["rollout_routed_experts"] for line in lines] == ["0", None]
    _equal(read_dump(path, PROVENANCE), _samples(dtype=dtype))
    # Written again without experts, the side file goes with them.
    write_dump(path, _samples()[1:], PROVENANCE)
    assert not side.exists() and len(read_dump(path)) == 1


def test_an_interrupted_write_leaves_no_file_under_the_dumps_name(tmp_path):
    class Interrupted:
        def __str__(self) -> str:
            raise KeyboardInterrupt  # the process stopped while the dump was being written

    path = tmp_path / "000000.jsonl"
    samples = _samples()
    samples[1].metadata["note"] = Interrupted()
    with pytest.raises(KeyboardInterrupt):
        write_dump(path, samples, PROVENANCE)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    # Over a complete dump, the complete dump stays.
    write_dump(path, _samples(), PROVENANCE)
    before = path.read_bytes(), experts_path(path).read_bytes()
    with pytest.raises(KeyboardInterrupt):
        write_dump(path, samples, PROVENANCE)
    assert (path.read_bytes(), experts_path(path).read_bytes()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "000000.experts.safetensors",
        "000000.jsonl",
    ]


def _edit_line(number: int, **changes):
    def edit(lines: list[str]) -> list[str]:
        row = json.loads(lines[number - 1])
        row.update(changes)
        for key in [k for k, v in changes.items() if v is _DROP]:
            del row[key]
        return [*lines[: number - 1], json.dumps(row), *lines[number:]]

    return edit


_DROP = object()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda rows: [rows[0], "{not json"], r"000000.jsonl:2: malformed JSON"),
        (lambda rows: [rows[0], rows[1][:40]], r"000000.jsonl:2: malformed JSON"),
        (lambda rows: [rows[0], json.dumps([1])], r"000000.jsonl:2: expected a JSON object"),
        (_edit_line(2, tokens=_DROP), r"000000.jsonl:2: no 'tokens' key"),
        (_edit_line(3, response_length=9), r"000000.jsonl:3: sample 1 .* response_length=9"),
        (_edit_line(2, rollout_routed_experts="7"), r"000000.jsonl:2: routed experts '7' are not"),
        (lambda rows: rows[:2], r"000000.jsonl: 1 sample line, and its header announces 2"),
        (lambda rows: rows[1:], r"000000.jsonl:1: no dump header .* dump the rollouts again"),
        (_edit_line(1, ember_dump=9), r"000000.jsonl:1: dump format 9; this Ember reads 2"),
        (lambda rows: [""], r"000000.jsonl: no dump header"),
    ],
)
def test_a_bad_dump_names_its_file_and_line(tmp_path, edit, message):
    path = tmp_path / "000000.jsonl"
    write_dump(path, _samples(), PROVENANCE)
    path.write_text("\n".join(edit(path.read_text().splitlines())) + "\n")
    with pytest.raises(ValueError, match=message) as info:
        read_dump(path)
    assert "\n" not in str(info.value)


def test_a_truncated_or_missing_experts_file_is_named(tmp_path):
    path = tmp_path / "000000.jsonl"
    write_dump(path, _samples(), PROVENANCE)
    side = experts_path(path)
    side.write_bytes(side.read_bytes()[:-3])
    with pytest.raises(ValueError, match=r"000000.experts.safetensors: cannot read the routed"):
        read_dump(path)
    side.unlink()
    with pytest.raises(ValueError, match=r"000000.experts.safetensors: no such file"):
        read_dump(path)


# -- the run that trains on a dump ----------------------------------------------------------

BASE = ["run.num_rollouts=2"]


def _dumped(directory, overrides=(), versions=("-1", "-1")):
    """A dump of len(versions) rollouts with the provenance of the default config plus
    `overrides`; rollout i's samples from weight version versions[i]."""
    config, _ = load_config(None, overrides=[*BASE, *overrides])
    for rollout_id, version in enumerate(versions):
        write_dump(dump_path(directory, rollout_id), _samples(version), dump_provenance(config))
    return directory


def _from(directory, overrides=(), plugins=None):
    return load_config(
        None,
        overrides=[*BASE, f"run.train_from_rollouts={directory}", *overrides],
        plugins=plugins,
    )


@pytest.mark.parametrize(
    ("override", "field", "dumped", "run"),
    [
        ("rollout.temperature=0.5", "rollout.temperature", "1.0", "0.5"),
        ("rollout.top_p=0.9", "rollout.top_p", "1.0", "0.9"),
        ("rollout.top_k=5", "rollout.top_k", "-1", "5"),
        ("rollout.n_samples_per_prompt=4", "rollout.n_samples_per_prompt", "8", "4"),
        ("train.model=tiny-mixtral", "train.model", '"tiny-moe"', '"tiny-mixtral"'),
        (
            "train.model_overrides.num_layers=2",
            "train.model_overrides",
            '{"vocab_size": 17}',
            '{"num_layers": 2, "vocab_size": 17}',
        ),
        ("train.seed=7", "train.seed", "1234", "7"),
        ("data.tokenizer_path=TOK", "tokenizer", '"toy"', '"TOK'),
    ],
)
def test_a_dump_of_other_settings_is_refused_naming_the_field_and_both_values(
    tmp_path, override, field, dumped, run
):
    directory = _dumped(tmp_path / "rollouts")
    tokenizer = tmp_path / "tokenizer"
    config, _ = _from(directory, [override.replace("TOK", str(tokenizer))])
    run = run.replace("TOK", str(tokenizer.resolve()))
    with pytest.raises(ValueError) as info:
        check_debug_halves(config)
    message = str(info.value)
    assert "\n" not in message
    assert f"000000.jsonl was dumped with {field}={dumped}" in message, message
    assert f"this run has {field}={run}" in message, message
    check_debug_halves(_from(directory)[0])  # the dump's own settings train on it


def test_a_dump_truncated_mid_line_is_found_when_the_inputs_are_checked(tmp_path):
    directory = _dumped(tmp_path / "rollouts")
    last = dump_path(directory, 1)
    last.write_bytes(last.read_bytes()[:-25])  # the copy stopped inside the last sample
    config, _ = _from(directory)
    with pytest.raises(ValueError, match=r"run.train_from_rollouts: .*000001.jsonl:3: malformed"):
        check_inputs(config)


CHECKER = ["ci.test=true", "ci_kl_checker.audit_interval=1"]


def test_a_dump_the_checkers_cannot_pass_is_refused_up_front(tmp_path):
    """A rollout-only run's dump comes from the initial weights. Under the CI checker, its
    audit of rollout 1 (the trainer then holds version 0) cannot compare the engine's log-probs
    with the trainer's on the same weights, and rollout 2 is staler than the default
    rollout.max_staleness=1 the checker holds every rollout to: the run is refused before any
    process starts. What the checks can pass trains."""
    rollout_only = _dumped(tmp_path / "rollout_only", versions=("-1", "-1", "-1"))
    for overrides, num, said in (
        (CHECKER, 2, "rollout 1 is audited (a plugin asks for an audit iteration there"),
        (["ci.test=true"], 3, "more than rollout.max_staleness=1 behind"),
    ):
        config, plugins = _from(
            rollout_only, [*overrides, f"run.num_rollouts={num}"], plugins=["ci_kl_checker"]
        )
        with pytest.raises(ValueError) as info:
            check_inputs(config, plugins)
        message = str(info.value)
        assert "\n" not in message
        last = num - 1
        assert (
            f"{last:06d}.jsonl: 2 of the 2 samples of rollout {last} come from weight " in message
        )
        assert f"version -1, older than the trainer's {last - 1}; " in message, message
        assert said in message and f"(run.num_rollouts={last})" in message, message
        config, plugins = _from(
            rollout_only, [*overrides, f"run.num_rollouts={last}"], plugins=["ci_kl_checker"]
        )
        check_inputs(config, plugins)  # the rollouts before it
    # Without the checker, the dump trains (off-policy, with a warning at each rollout).
    check_inputs(*_from(rollout_only, ["run.num_rollouts=3"]))
    # A training run's dump: rollout i came from the weights trained on rollout i - 1.
    trained = _dumped(tmp_path / "trained", versions=("-1", "0"))
    config, plugins = _from(trained, CHECKER, plugins=["ci_kl_checker"])
    check_inputs(config, plugins)
