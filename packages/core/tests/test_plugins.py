"""Plugin discovery through real entry-point metadata, and every hook through the facade."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import sys
import textwrap
from pathlib import Path

import pluggy
import pytest

from ember_core import hookspecs
from ember_core.hookspecs import (
    ConfigSection,
    ExemptionScope,
    GenerateSettings,
    KLExemption,
    Phase,
    Role,
    hookimpl,
)
from ember_core.plugins import EmberPlugins, installed_plugins
from ember_core.types import Sample


def make_distribution(
    root: Path, dist: str, plugins: dict[str, str], version: str = "0.3.1"
) -> None:
    """Write an installed distribution (module files + dist-info with entry points) under root."""
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = ["[ember]"] + [f"{name} = {name}_module" for name in plugins]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    for name, source in plugins.items():
        (root / f"{name}_module.py").write_text(textwrap.dedent(source))


GOOD_PLUGIN = """
    from ember_core.hookspecs import hookimpl

    @hookimpl
    def ember_rollout_request_fields(engine):
        return {"return_routed_experts": True, "asked_by": engine}
"""

MISSPELT_PLUGIN = """
    from ember_core.hookspecs import hookimpl

    @hookimpl
    def ember_rollout_request_feilds(engine):
        return {"x": 1}
"""


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A directory on sys.path holding two test distributions with `ember` entry points."""
    make_distribution(tmp_path, "ember-testplug", {"testplug": GOOD_PLUGIN})
    make_distribution(tmp_path, "ember-misspelt", {"misspelt": MISSPELT_PLUGIN})
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for module in ("testplug_module", "misspelt_module"):
        sys.modules.pop(module, None)


def test_installed_plugins_are_discovered_from_entry_points(site):
    found = installed_plugins()
    assert found["testplug"].distribution == "ember-testplug"
    assert found["testplug"].version == "0.3.1"
    assert found["testplug"].value == "testplug_module"
    assert "misspelt" in found


def test_enabled_plugin_is_loaded_and_called(site):
    plugins = EmberPlugins.load(["testplug"])
    assert plugins.enabled == ["testplug"]
    assert plugins.rollout_request_fields("sglang") == {
        "return_routed_experts": True,
        "asked_by": "sglang",
    }


def test_installed_but_not_enabled_plugin_changes_nothing(site):
    plugins = EmberPlugins.load([])
    assert plugins.enabled == []
    assert plugins.rollout_request_fields("sglang") == {}
    assert "testplug_module" not in sys.modules


def test_unknown_plugin_lists_installed_ones(site):
    with pytest.raises(ValueError, match=r"'nope' not installed; installed plugins: .*testplug"):
        EmberPlugins.load(["testplug", "nope"])


def test_a_built_in_plugin_is_loaded_by_name_without_an_entry_point(site):
    (site / "own_module.py").write_text(textwrap.dedent(GOOD_PLUGIN))
    try:
        plugins = EmberPlugins.load(["testplug", "own"], built_in={"own": "own_module"})
        assert plugins.enabled == ["testplug", "own"]
        assert "own" not in installed_plugins()
        assert len(plugins.pm.hook.ember_rollout_request_fields(engine="hf")) == 2
        with pytest.raises(ValueError, match="'own' not installed"):
            EmberPlugins.load(["own"])  # only the package that has it enables it
    finally:
        sys.modules.pop("own_module", None)


def test_misspelt_hookimpl_fails_check_pending(site):
    with pytest.raises(pluggy.PluginValidationError, match="ember_rollout_request_feilds"):
        EmberPlugins.load(["misspelt"])


def test_trace_env_writes_hook_calls(site, monkeypatch, capsys):
    monkeypatch.setenv("EMBER_TRACE_HOOKS", "1")
    plugins = EmberPlugins.load(["testplug"])
    plugins.rollout_request_fields("hf")
    assert "ember_rollout_request_fields" in capsys.readouterr().err


# -- one test per hook, through the facade, with explicitly registered plugins ------------------


@pytest.fixture
def plugins():
    host = EmberPlugins()
    registered: list[str] = []

    def register(obj: object, name: str) -> None:
        host.register(obj, name)
        registered.append(name)

    host.add = register  # type: ignore[attr-defined]
    try:
        yield host
    finally:
        for name in registered:
            host.unregister(name)


class SectionPlugin:
    def __init__(self, name: str):
        self.name = name
        self.seen: dict = {}

    @hookimpl
    def ember_config_section(self):
        return ConfigSection(self.name, dict)

    @hookimpl
    def ember_configure(self, config, sections, plugins):
        self.seen = {"config": config, "mine": sections.get(self.name), "plugins": plugins}


def test_hook_ember_config_section(plugins):
    plugins.add(SectionPlugin("alpha"), "alpha")
    plugins.add(SectionPlugin("beta"), "beta")
    assert plugins.config_sections() == {"alpha": dict, "beta": dict}
    plugins.add(SectionPlugin("alpha"), "alpha2")
    with pytest.raises(ValueError, match="'alpha' is declared by two plugins"):
        plugins.config_sections()


def test_hook_ember_configure(plugins):
    alpha, beta = SectionPlugin("alpha"), SectionPlugin("beta")
    plugins.add(alpha, "alpha")
    plugins.add(beta, "beta")
    plugins.configure(config="run", sections={"alpha": 1, "beta": 2})
    assert alpha.seen == {"config": "run", "mine": 1, "plugins": plugins}
    assert beta.seen == {"config": "run", "mine": 2, "plugins": plugins}


def test_configure_hookimpls_may_take_a_subset_of_arguments(plugins):
    seen: dict = {}

    class ConfigOnly:
        @hookimpl
        def ember_configure(self, config):
            seen["config"] = config

    class Querying:
        @hookimpl
        def ember_configure(self, plugins):
            # What other plugins report is asked later, once every plugin is configured.
            seen["exemptions"] = plugins.kl_check_exemptions

    plugins.add(ConfigOnly(), "config_only")
    plugins.add(Querying(), "querying")
    plugins.configure(config="run", sections={})
    assert seen["config"] == "run"
    assert seen["exemptions"]() == []


def test_hook_ember_model_config(plugins):
    class Replay:
        @hookimpl
        def ember_model_config(self, role, model_config):
            if role == Role.ACTOR:
                model_config["replay"] = True

    plugins.add(Replay(), "replay")
    actor, ref = {}, {}
    plugins.model_config("actor", actor)
    plugins.model_config(Role.REF, ref)
    assert actor == {"replay": True} and ref == {}


def test_hook_ember_rollout_request_fields(plugins):
    class A:
        @hookimpl
        def ember_rollout_request_fields(self, engine):
            return {"return_routed_experts": True}

    class B:
        @hookimpl
        def ember_rollout_request_fields(self, engine):
            return {"return_routed_experts": False} if engine == "sglang" else {"extra": engine}

    plugins.add(A(), "a")
    plugins.add(B(), "b")
    assert plugins.rollout_request_fields("hf") == {"return_routed_experts": True, "extra": "hf"}
    with pytest.raises(ValueError, match="'return_routed_experts' set to both"):
        plugins.rollout_request_fields("sglang")


def test_hook_ember_rollout_server_args(plugins):
    class A:
        @hookimpl
        def ember_rollout_server_args(self, engine):
            return ["--enable-return-routed-experts"] if engine == "sglang" else None

    class B:
        @hookimpl
        def ember_rollout_server_args(self):
            return ["--b"]

    plugins.add(A(), "a")
    plugins.add(B(), "b")
    assert plugins.rollout_server_args("sglang") == ["--enable-return-routed-experts", "--b"]
    assert plugins.rollout_server_args("hf") == ["--b"]


def test_hook_ember_process_sample(plugins):
    class Decoder:
        @hookimpl
        def ember_process_sample(self, sample, meta_info, engine):
            sample.metadata["decoded"] = (meta_info["routed_experts"], engine)

    plugins.add(Decoder(), "decoder")
    sample = Sample(tokens=[1, 2, 3], response_length=1)
    plugins.process_sample(sample, {"routed_experts": "AAAA"}, "sglang")
    assert sample.metadata["decoded"] == ("AAAA", "sglang")


def test_hook_ember_generate(plugins):
    settings = GenerateSettings(
        n=2, max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=-1, stop_token_ids=(0,)
    )

    class Client:
        """Stands in for the engine: answers every call with the token 7."""

        kind, tokenizer = "hf", None

        async def generate(self, input_ids, *, sample, **_):
            return [*input_ids, 7][-1]

    def run(host):
        return asyncio.run(
            host.generate(
                client=Client(), record="rec", prompt_ids=[1, 2], sampling=settings,
                routed_experts=False,
            )
        )  # fmt: skip

    class TwoTurns:
        @hookimpl
        async def ember_generate(self, client, record, prompt_ids, sampling):
            samples = []
            for j in range(sampling.n):
                first = await client.generate(prompt_ids, sample=j)
                second = await client.generate([*prompt_ids, first, 3], sample=j)
                samples.append(
                    Sample(
                        tokens=[*prompt_ids, first, 3, second],
                        response_length=3,
                        loss_mask=[1, 0, 1],
                        rollout_log_probs=[-0.5, 0.0, -0.5],
                        metadata={"record": record},
                    )
                )
            return samples

    class Declines:
        @hookimpl
        def ember_generate(self, record):
            return None

    assert not plugins.has_generate()
    assert run(plugins) is None
    plugins.add(Declines(), "declines")
    assert plugins.has_generate() and run(plugins) is None
    plugins.add(TwoTurns(), "two_turns")
    samples = run(plugins)
    assert [s.tokens for s in samples] == [[1, 2, 7, 3, 7]] * 2
    assert samples[0].loss_mask == [1, 0, 1] and samples[0].metadata == {"record": "rec"}

    class Sync:
        @hookimpl
        def ember_generate(self, prompt_ids):
            return [Sample(tokens=[*prompt_ids, 5], response_length=1)]

    plugins.add(Sync(), "sync")  # registered last, asked first: the first answer wins
    assert [s.tokens for s in run(plugins)] == [[1, 2, 5]]


def test_hook_ember_forward_context(plugins):
    events: list[str] = []

    def tracker(tag: str):
        class Tracker:
            @hookimpl
            def ember_forward_context(self, role, phase, batch):
                if role != Role.ACTOR:
                    return None

                @contextlib.contextmanager
                def hold():
                    events.append(f"enter {tag} {phase} {batch}")
                    yield
                    events.append(f"exit {tag}")

                return hold()

        return Tracker()

    plugins.add(tracker("first"), "first")
    plugins.add(tracker("second"), "second")
    with plugins.forward_context("actor", Phase.BACKWARD, batch=7):
        events.append("pass")
    with plugins.forward_context(Role.REF, "log_prob"):
        events.append("ref pass")
    assert events == [
        "enter first backward 7",
        "enter second backward 7",
        "pass",
        "exit second",
        "exit first",
        "ref pass",
    ]
    with pytest.raises(ValueError):
        with plugins.forward_context("teacher", "train"):
            pass


def test_hook_ember_kl_check_exemptions(plugins):
    class Exempt:
        @hookimpl
        def ember_kl_check_exemptions(self):
            return KLExemption("r3_routing", "actor replays rollout routing")

    class Quiet:
        @hookimpl
        def ember_kl_check_exemptions(self):
            return None

    assert plugins.kl_check_exemptions() == []
    plugins.add(Quiet(), "quiet")
    assert plugins.kl_check_exemptions() == []
    plugins.add(Exempt(), "exempt")
    assert plugins.kl_check_exemptions() == [
        KLExemption("r3_routing", "actor replays rollout routing")
    ]
    # An exemption excuses any difference unless it says routing only.
    assert plugins.kl_check_exemptions()[0].scope == ExemptionScope.ANY


def test_hook_ember_replayed_reference_forward(plugins):
    asked = []

    class Asks:
        @hookimpl
        def ember_replayed_reference_forward(self, rollout_id):
            asked.append(rollout_id)
            return rollout_id == 0

    class Quiet:
        @hookimpl
        def ember_replayed_reference_forward(self):
            return None

    assert plugins.replayed_reference_forward(0) is False
    plugins.add(Quiet(), "quiet")
    assert plugins.replayed_reference_forward(0) is False
    plugins.add(Asks(), "asks")
    assert plugins.replayed_reference_forward(0) is True
    assert plugins.replayed_reference_forward(3) is False
    assert asked == [0, 3]


def test_hook_ember_rebuilt_reference_forward(plugins):
    class Asks:
        @hookimpl
        def ember_rebuilt_reference_forward(self, rollout_id):
            return rollout_id == 4

    assert plugins.rebuilt_reference_forward(4) is False
    plugins.add(Asks(), "asks")
    assert plugins.rebuilt_reference_forward(4) is True
    assert plugins.rebuilt_reference_forward(2) is False


def test_hook_ember_audit_rollout(plugins):
    asked = []

    class Audits:
        @hookimpl
        def ember_audit_rollout(self, rollout_id):
            asked.append(rollout_id)
            return rollout_id % 3 == 0

    class Quiet:
        @hookimpl
        def ember_audit_rollout(self):
            return None

    assert plugins.audit_rollout(0) is False
    plugins.add(Quiet(), "quiet")
    assert plugins.audit_rollout(0) is False
    plugins.add(Audits(), "audits")
    assert [plugins.audit_rollout(i) for i in range(4)] == [True, False, False, True]
    assert asked == [0, 1, 2, 3]


def test_hook_ember_after_train_step(plugins):
    seen = []

    class Watcher:
        @hookimpl
        def ember_after_train_step(self, rollout_id, step_id, accumulated_step_id, metrics):
            seen.append((rollout_id, step_id, accumulated_step_id, metrics["train/ppo_kl"]))

    plugins.add(Watcher(), "watcher")
    plugins.after_train_step(3, 1, 7, {"train/ppo_kl": 0.5})
    assert seen == [(3, 1, 7, 0.5)]


def test_hook_ember_after_log_rollout_data(plugins):
    seen = []

    class Watcher:
        @hookimpl
        def ember_after_log_rollout_data(self, rollout_id, metrics):
            seen.append((rollout_id, dict(metrics)))

    plugins.add(Watcher(), "watcher")
    plugins.after_log_rollout_data(0, {"rollout/log_probs": -1.0})
    assert seen == [(0, {"rollout/log_probs": -1.0})]


def test_every_hookspec_has_a_test():
    specs = {
        name
        for name, obj in vars(hookspecs).items()
        if name.startswith("ember_") and inspect.isfunction(obj)
    }
    tests = {name.removeprefix("test_hook_") for name in globals() if name.startswith("test_hook_")}
    assert specs, "no hookspecs found"
    assert specs == tests, f"hookspecs without a test: {sorted(specs - tests)}"


def test_facade_has_a_method_for_every_hookspec():
    specs = [n for n in vars(hookspecs) if n.startswith("ember_")]
    names = [n.removeprefix("ember_") for n in specs]
    missing = [n for n in names if not (hasattr(EmberPlugins, n) or hasattr(EmberPlugins, n + "s"))]
    assert not missing
