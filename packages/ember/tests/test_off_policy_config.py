"""`algorithm.off_policy_correction` in a run config: resolved before the checks that read its
flags, written so that every actor parses it back the same, and named in the start line."""

from __future__ import annotations

import pytest
import yaml

from ember.config import describe_loop, load_config

NAMES = ["behaviour_clip", "decoupled", "tis", "seq_tis", "mis"]
FLAGS = {
    # name: (use_rollout_log_probs, use_tis, tis_mode, tis_level)
    "behaviour_clip": (True, False, "truncate", "token"),
    "decoupled": (False, True, "truncate", "token"),
    "tis": (True, True, "truncate", "token"),
    "seq_tis": (True, True, "truncate", "sequence"),
    "mis": (True, True, "mask", "token"),
}


@pytest.fixture
def own(tmp_path):
    """A config file of one's own: the dataclass defaults plus an async loop."""
    path = tmp_path / "mine.yaml"
    path.write_text("rollout:\n  async: true\n")
    return path


def flags(config) -> tuple:
    a = config.algorithm
    return (a.use_rollout_log_probs, a.use_tis, a.tis_mode, a.tis_level)


@pytest.mark.parametrize("name", NAMES)
def test_the_resolved_config_parses_back_to_the_same_run(own, name):
    config, _ = load_config(own, overrides=[f"algorithm.off_policy_correction={name}"])
    assert flags(config) == FLAGS[name]
    # What the driver writes to the run directory and each actor parses again.
    written = yaml.safe_load(yaml.safe_dump(config.to_dict(), sort_keys=False))
    assert written["algorithm"]["off_policy_correction"] == name
    again, _ = load_config(written)
    assert again.to_dict() == config.to_dict()
    assert again.algorithm == config.algorithm


def test_async_does_not_turn_tis_on_over_a_named_correction(own):
    # rollout.async turns an unset use_tis on (trainer's old log-probs); a correction has set
    # it first, so behaviour_clip stays without weight even with the trainer's defaults.
    config, _ = load_config(own)
    assert config.algorithm.use_tis is True and config.algorithm.use_rollout_log_probs is False
    config, _ = load_config(own, overrides=["algorithm.off_policy_correction=behaviour_clip"])
    assert config.algorithm.use_tis is False and config.algorithm.use_rollout_log_probs is True
    config, _ = load_config(
        own, overrides=["rollout.async=false", "algorithm.off_policy_correction=decoupled"]
    )
    assert config.algorithm.use_tis is True


def test_an_override_replaces_the_files_correction_whichever_way_either_says_it(tmp_path):
    """examples/default.yaml says behaviour_clip with its flag (use_rollout_log_probs: true):
    `--set algorithm.off_policy_correction=NAME` replaces it, decoupled included, and a flag
    set on the command line replaces a file's correction name. A name and a flag that
    disagree in one layer stay refused."""
    for name in NAMES:
        config, _ = load_config("default", overrides=[f"algorithm.off_policy_correction={name}"])
        assert flags(config) == FLAGS[name]
    named = tmp_path / "named.yaml"
    named.write_text("algorithm:\n  off_policy_correction: decoupled\n")
    config, _ = load_config(named, overrides=["algorithm.use_rollout_log_probs=true"])
    assert config.algorithm.off_policy_correction is None
    assert config.algorithm.use_rollout_log_probs is True
    with pytest.raises(ValueError) as info:
        load_config(
            "default",
            overrides=[
                "algorithm.off_policy_correction=decoupled",
                "algorithm.use_rollout_log_probs=true",
            ],
        )
    assert str(info.value) == (
        "algorithm.off_policy_correction='decoupled' sets use_rollout_log_probs=false, but "
        "use_rollout_log_probs=true was given; drop use_rollout_log_probs (or set it to "
        "false), or set off_policy_correction=null"
    )
    both = tmp_path / "both.yaml"
    both.write_text("algorithm:\n  off_policy_correction: mis\n  tis_mode: truncate\n")
    assert flags(load_config(both)[0]) == FLAGS["mis"]  # truncate: the default, gives way
    both.write_text("algorithm:\n  off_policy_correction: tis\n  tis_level: sequence\n")
    with pytest.raises(ValueError, match="off_policy_correction='tis' sets tis_level=token"):
        load_config(both)


@pytest.mark.parametrize("name", ["behaviour_clip", "decoupled", "tis", "seq_tis", "mis"])
def test_every_correction_takes_a_filtered_sampler(own, name):
    """The engine's log-probs mean log softmax(logits / T) under top-p too, as the trainer's do."""
    config, _ = load_config(
        own, overrides=[f"algorithm.off_policy_correction={name}", "rollout.top_p=0.9"]
    )
    assert config.algorithm.off_policy_correction == name and config.rollout.top_p == 0.9


def test_the_start_line_names_the_correction(own):
    base = (
        "loop: overlapped (rollout.max_staleness=1: rollout i+1 generates from weights one "
        "update old); off-policy correction: "
    )
    expected = {
        "behaviour_clip": "behaviour_clip (algorithm.off_policy_correction): the PPO clip "
        "anchored at the engine's log-probs (the behaviour policy), no importance weight",
        "decoupled": "decoupled (algorithm.off_policy_correction): decoupled PPO: the clip "
        "anchored at the trainer's scoring forward (the proximal policy), each token weighted "
        "by pi_prox / pi_rollout truncated to [0.5, 3]",
        "tis": "tis (algorithm.off_policy_correction): token TIS: the ratio anchored at the "
        "training forward itself (never clipped), each token weighted by pi_theta / "
        "pi_rollout truncated to [0.5, 3]",
        "seq_tis": "seq_tis (algorithm.off_policy_correction): sequence TIS: the ratio anchored "
        "at the training forward itself (never clipped), each sample weighted by "
        "pi_theta(y) / pi_rollout(y) truncated to [0.5, 3]",
        "mis": "mis (algorithm.off_policy_correction): masked IS: the ratio anchored at the "
        "training forward itself (never clipped), each token weighted by pi_theta / "
        "pi_rollout inside [0.5, 3], masked outside",
    }
    for name, line in expected.items():
        config, _ = load_config(
            own,
            overrides=[
                f"algorithm.off_policy_correction={name}",
                "algorithm.tis_clip=3",
                "algorithm.tis_clip_low=0.5",
            ],
        )
        assert describe_loop(config) == base + line
