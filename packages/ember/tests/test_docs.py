"""The documentation: the generated config reference is current, and links, paths and code hold."""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.util
import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from ember.config import RunConfig
from ember_core import hookspecs
from ember_core.config import from_dict
from ember_core.plugins import EmberPlugins

ROOT = Path(__file__).resolve().parents[3]
DOCS = ROOT / "docs"
GENERATOR = ROOT / "tools" / "gen_config_reference.py"
MARKDOWN = sorted(
    [ROOT / "README.md", *DOCS.glob("*.md")]
    + [
        p
        for pattern in ("packages", "plugins", "examples/plugins")
        for p in ROOT.glob(f"{pattern}/*/README.md")
    ]
)
"""Every Markdown file whose links are checked."""
REPO_PATH = re.compile(r"^(?:packages|plugins|examples|tools|docs|integration_tests)/[\w./*-]*$")
PYTHON_NAME = re.compile(r"^ember(?:_[a-z0-9_]+)?(?:\.[A-Za-z_][A-Za-z0-9_]*)+$")
WORKSPACE_PACKAGES = {
    p.name for pattern in ("*/*/src/*", "examples/plugins/*/src/*") for p in ROOT.glob(pattern)
}
"""Import packages of this repository's distributions, installed here or not."""
HOOKS = sorted(n for n, obj in vars(hookspecs).items() if hasattr(obj, f"{hookspecs.NAME}_spec"))


def load_generator() -> Any:
    spec = importlib.util.spec_from_file_location("gen_config_reference", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while decorating
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generator() -> Any:
    return load_generator()


@pytest.fixture(scope="module")
def reference(generator) -> str:
    """The reference as the generator renders it now. Every plugin of the workspace is in the
    dev environment, so a plugin that is missing (`PluginNotInstalled`) fails the test."""
    return generator.render()


# --------------------------------------------------------------------------------------------
# Markdown helpers
# --------------------------------------------------------------------------------------------


def without_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", without_code_blocks(text))


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file (repeats get -1, -2, ...)."""
    seen: Counter[str] = Counter()
    anchors = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*$", without_code_blocks(text), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")
        anchors.add(f"{slug}-{seen[slug]}" if seen[slug] else slug)
        seen[slug] += 1
    return anchors


def links(text: str) -> list[str]:
    return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", without_code_blocks(text))


def reference_tables(text: str) -> dict[str, dict[str, str]]:
    """Section path -> key -> default cell, read back from the generated reference."""
    tables: dict[str, dict[str, str]] = {}
    section = None
    for line in text.splitlines():
        if line.startswith("## "):
            section = "" if line == "## Top level" else line[3:]
            tables[section] = {}
        elif section is not None and line.startswith("| `"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            tables[section][cells[0].strip("`")] = cells[2].strip("`")
    return tables


# --------------------------------------------------------------------------------------------
# The generated configuration reference
# --------------------------------------------------------------------------------------------


def test_config_reference_is_up_to_date(generator, reference):
    on_disk = generator.OUTPUT.read_text() if generator.OUTPUT.exists() else ""
    if on_disk != reference:
        diff = difflib.unified_diff(
            on_disk.splitlines(), reference.splitlines(), "on disk", "generated", lineterm="", n=1
        )
        pytest.fail(
            "docs/config-reference.md does not match the config dataclasses; regenerate it with "
            f"`{generator.COMMAND}`\n" + "\n".join(list(diff)[:40]),
            pytrace=False,
        )


RESOLVED_FROM_NULL = {"rollout.max_staleness"}
"""Keys whose default is null and that the section resolves at once from another key
(`max_staleness` from `rollout.async`)."""


def test_config_reference_has_every_key_and_default_of_a_resolved_config(generator, reference):
    names = [name for name, _, _ in generator.workspace_plugins()]
    assert {"r3_routing", "ci_kl_checker", "truncation_mask"} <= set(names)
    config = from_dict(RunConfig, {})
    config.plugin_sections = {
        section: from_dict(cls, {}, prefix=section)
        for section, cls in EmberPlugins.load(names).config_sections().items()
    }
    tables = reference_tables(reference)

    def compare(path: str, resolved: dict[str, Any]) -> None:
        assert set(tables[path]) == set(resolved), f"section {path or 'top level'!r}"
        for key, value in resolved.items():
            child = f"{path}.{key}" if path else key
            if isinstance(value, dict) and value:
                compare(child, value)
            elif tables[path][key]:  # a section's own row links to its table instead
                documented = json.loads(tables[path][key])
                if child in RESOLVED_FROM_NULL:  # null documents "derived from another key"
                    assert documented is None and value is not None, child
                else:
                    assert documented == value, child

    compare("", config.to_dict())
    # train.model_overrides is a free mapping; its table lists exactly the keys it accepts.
    overrides = set(tables["train.model_overrides"])
    assert from_dict(RunConfig, {"train": {"model_overrides": dict.fromkeys(overrides, 2)}})
    with pytest.raises(ValueError, match="model_overrides.nope: unknown ModelConfig field"):
        from_dict(RunConfig, {"train": {"model_overrides": {"nope": 1}}})


def test_config_keys_named_in_the_docs_exist(reference):
    tables = reference_tables(reference)
    named, unknown = 0, []
    for page in [*DOCS.glob("*.md"), *ROOT.glob("examples/plugins/*/README.md")]:
        for span in code_spans(page.read_text()):
            section, dot, key = span.rpartition(".")
            if dot and section.split(".")[0] in tables[""] and re.fullmatch(r"[a-z_.]+", span):
                named += 1
                if key not in tables.get(section, {}):
                    unknown.append(f"{page.relative_to(ROOT)}: `{span}`")
    assert named > 20, "the key pattern found almost nothing; is it still right?"
    assert not unknown, "config keys that do not exist:\n" + "\n".join(unknown)


def test_generator_rewrites_a_stale_file_and_check_mode_reports_it(
    generator, reference, tmp_path, capsys
):
    stale = tmp_path / "config-reference.md"
    stale.write_text("# Configuration reference\n")
    original = generator.OUTPUT
    generator.OUTPUT = stale
    try:
        assert generator.main(["--check"]) == 1
        assert f"is stale; run `{generator.COMMAND}`" in capsys.readouterr().err
        assert generator.main([]) == 0
        assert "## truncation_mask" in stale.read_text()
        assert generator.main(["--check"]) == 0
    finally:
        generator.OUTPUT = original


def test_a_field_without_a_docstring_is_refused(generator):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Undocumented:
        """A section someone forgot to document."""

        documented: int = 1
        """Has a docstring."""
        forgotten: int = 2

    with pytest.raises(ValueError, match=r"Undocumented\.forgotten has no docstring"):
        generator.render_section(generator.Section("undocumented", Undocumented), {})


# --------------------------------------------------------------------------------------------
# Links, paths and names the documentation mentions
# --------------------------------------------------------------------------------------------


def test_relative_links_resolve_to_files_and_headings():
    broken = []
    checked = 0
    for page in MARKDOWN:
        for target in links(page.read_text()):
            if re.match(r"^[a-z]+:", target):
                continue  # http(s), mailto: outside this repository
            checked += 1
            path, _, fragment = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}: ({target})"
            if not resolved.is_relative_to(ROOT) or not resolved.exists():
                broken.append(f"{where} -> no such file")
            elif fragment and resolved.suffix == ".md":
                if fragment not in heading_anchors(resolved.read_text()):
                    broken.append(f"{where} -> no heading #{fragment}")
    assert checked > 40, "the link pattern found almost nothing; is it still right?"
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_repository_paths_in_docs_exist():
    missing = []
    for page in MARKDOWN:
        for span in code_spans(page.read_text()):
            candidate = span.split(" ")[0].rstrip("/")
            if REPO_PATH.match(candidate) and not any(ROOT.glob(candidate)):
                missing.append(f"{page.relative_to(ROOT)}: `{span}`")
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)


def resolves(name: str) -> bool:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def test_python_names_in_docs_resolve():
    unknown = []
    for page in sorted(DOCS.glob("*.md")) + sorted(ROOT.glob("examples/plugins/*/README.md")):
        for span in code_spans(page.read_text()):
            if not PYTHON_NAME.match(span):
                continue
            top = span.split(".")[0]
            if top in WORKSPACE_PACKAGES and importlib.util.find_spec(top) is None:
                continue  # a distribution of this repository that is not installed here
            if not resolves(span):
                unknown.append(f"{page.relative_to(ROOT)}: `{span}`")
    assert not unknown, "names that do not import:\n" + "\n".join(unknown)


@pytest.mark.parametrize("page", ["architecture.md", "plugins.md"])
def test_every_hook_is_documented_and_every_documented_hook_exists(page):
    text = (DOCS / page).read_text()
    assert len(HOOKS) >= 10
    missing = [hook for hook in HOOKS if f"`{hook}`" not in text and f" {hook}" not in text]
    assert not missing, f"docs/{page} does not mention these hooks: {missing}"
    named = set(re.findall(r"\bember_[a-z_]+\b", text))
    invented = sorted(named - set(HOOKS) - WORKSPACE_PACKAGES)
    assert not invented, f"docs/{page} names hooks that do not exist: {invented}"


def test_plugin_guide_excerpts_match_the_example_plugin():
    text = (DOCS / "plugins.md").read_text()
    excerpts = re.findall(r"<!-- excerpt: (\S+) -->\n```\w*\n(.*?)^```", text, flags=re.S | re.M)
    assert {path for path, _ in excerpts} == {
        "examples/plugins/truncation_mask/pyproject.toml",
        "examples/plugins/truncation_mask/src/ember_truncation_mask/plugin.py",
        "examples/plugins/calc_tool/src/ember_calc_tool/plugin.py",
    }
    stale = [path for path, code in excerpts if code not in (ROOT / path).read_text()]
    assert not stale, f"docs/plugins.md quotes code that is no longer in {stale}; update it"
