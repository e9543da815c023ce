"""Run config loading: examples, overrides, plugin sections and one-line errors."""

from __future__ import annotations

import pytest
import yaml

from ember.cli import main
from ember.config import load_config, write_resolved


def test_default_example_loads():
    config, plugins = load_config(None)
    assert config.run.name == "default"
    assert config.algorithm.advantage_estimator == "grpo"
    assert config.engine.kind == "hf"
    assert plugins.enabled == []


def test_overrides_and_plugins_flag():
    config, plugins = load_config(
        None,
        overrides=["rollout.temperature=0.7", "ci.test=true", "ci_kl_checker.disable=true"],
        plugins=["ci_kl_checker"],
    )
    assert config.rollout.temperature == 0.7
    assert config.ci.test is True
    assert plugins.enabled == ["ci_kl_checker"]
    assert config.plugin_sections["ci_kl_checker"].disable is True


def test_global_kl_checker_switch_alias():
    config, _ = load_config(
        None, overrides=["ci_disable_kl_checker=true"], plugins=["ci_kl_checker"]
    )
    assert config.plugin_sections["ci_kl_checker"].disable is True


def test_resolved_config_round_trips(tmp_path):
    config, _ = load_config(None, overrides=["rollout.temperature=0.8"], plugins=["ci_kl_checker"])
    path = write_resolved(config, tmp_path)
    again, plugins = load_config(yaml.safe_load(path.read_text()))
    assert again.to_dict() == config.to_dict()
    assert plugins.enabled == ["ci_kl_checker"]


def test_section_of_installed_but_disabled_plugin_is_ignored():
    config, plugins = load_config({"ci_kl_checker": {"disable": True}})
    assert plugins.enabled == [] and config.plugin_sections == {}


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["--set", "rollout.temperature=-1"],
            "rollout.temperature=-1.0: expected a finite number > 0",
        ),
        (
            ["--set", "algorithm.advantage_estimator=grpx"],
            "advantage_estimator='grpx': expected one of",
        ),
        (["--set", "rollout.temprature=1"], "rollout.temprature: unknown key; known keys here:"),
        (["--set", "bogus.key=1"], "bogus: unknown top-level key; known:"),
        (["--set", "rollout.temperature"], "expected KEY=VALUE"),
        (["no-such-config"], "config 'no-such-config': no such file, and no example of that name"),
    ],
)
def test_bad_input_is_one_line_naming_key_and_value(argv, expected, capsys):
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert expected in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_unknown_plugin_lists_the_installed_ones(capsys):
    assert main(["train", "--plugins", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'nope' not installed; installed plugins: " in err
    listed = err.split("installed plugins: ")[1].strip().split(", ")
    assert {"ci_kl_checker", "r3_routing"} <= set(listed)
    assert listed == sorted(listed)


def test_plugins_command_lists_installed_and_enabled(capsys):
    assert main(["plugins", "--plugins", "r3_routing"]) == 0
    lines = capsys.readouterr().out.splitlines()
    by_name = {line.split()[0]: line.split() for line in lines}
    assert by_name["r3_routing"][1] == "enabled"
    assert by_name["ci_kl_checker"][1] == "disabled"
    assert by_name["ci_kl_checker"][2] == "ember-ci-kl-checker"
