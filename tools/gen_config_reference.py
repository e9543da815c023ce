"""Write docs/config-reference.md: every run-config key with its type, default and docstring.

Sections are found the way `ember.config.load_config` builds a run config: the fields of
`RunConfig` (the sections of ember, ember-core, ember-rollout and ember-megatron-backend, nested
ones included), then the section each plugin of this repository declares through its
`ember_config_section` hook. Descriptions are the docstrings under the dataclass fields
(`ember_core.config.field_docs`): edit those, not the generated file, then run

    uv run python tools/gen_config_reference.py           # rewrite docs/config-reference.md
    uv run python tools/gen_config_reference.py --check   # exit 1 if the file is stale
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import re
import sys
import tomllib
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ember.config import RunConfig
from ember_core.config import config_key, field_docs
from ember_core.hookspecs import NAME
from ember_core.plugins import EmberPlugins, installed_plugins
from ember_megatron_backend.config import BackendConfig
from ember_megatron_backend.model import PRESETS, ModelConfig

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "config-reference.md"
COMMAND = "uv run python tools/gen_config_reference.py"
PLUGIN_PROJECTS = ("plugins/*/pyproject.toml", "examples/plugins/*/pyproject.toml")
"""Where this repository's plugin distributions live, in the order the reference lists them."""

INTERNAL_FIELDS = {(RunConfig, "plugin_sections")}
"""Fields that are not keys of a config file (load_config fills this one from plugin sections)."""
MAPPING_FIELDS = {(BackendConfig, "model_overrides"): ModelConfig}
"""Free-form mappings whose keys are the fields of a dataclass: documented as a section too."""


class PluginNotInstalled(LookupError):
    """A plugin of this repository is not installed in the running environment."""


@dataclass(frozen=True, slots=True)
class Section:
    """One table of the reference: the keys of dataclass `cls` under dotted `path`."""

    path: str
    cls: type
    plugin: str = ""
    """The declaring plugin, as a Markdown fragment; empty for the packages' own sections."""


# --------------------------------------------------------------------------------------------
# Finding the sections
# --------------------------------------------------------------------------------------------


def distribution_of(cls: type) -> str:
    """The distribution that ships `cls`: the project whose pyproject.toml sits above its file."""
    for directory in Path(inspect.getfile(cls)).resolve().parents:
        pyproject = directory / "pyproject.toml"
        if pyproject.is_file():
            project = tomllib.loads(pyproject.read_text()).get("project")
            if project:
                return project["name"]
    raise ValueError(
        f"{cls.__module__}.{cls.__qualname__}: not inside a project of this repository"
    )


def config_fields(cls: type) -> Iterator[tuple[dataclasses.Field[Any], Any]]:
    """The fields of `cls` a config file can set, with their resolved type hints."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.init and (cls, f.name) not in INTERNAL_FIELDS:
            yield f, hints[f.name]


def nested_sections(cls: type, path: str, plugin: str = "") -> Iterator[Section]:
    """`cls` as the section at `path`, followed by its nested sections, depth first."""
    yield Section(path, cls, plugin)
    for f, hint in config_fields(cls):
        child = f"{path}.{f.name}"
        if dataclasses.is_dataclass(hint):
            yield from nested_sections(hint, child, plugin)
        elif (cls, f.name) in MAPPING_FIELDS:
            yield Section(child, MAPPING_FIELDS[cls, f.name], plugin)


def workspace_plugins() -> Iterator[tuple[str, str, Path]]:
    """(entry-point name, distribution, project directory) of each plugin in this repository."""
    for pattern in PLUGIN_PROJECTS:
        for pyproject in sorted(ROOT.glob(pattern)):
            project = tomllib.loads(pyproject.read_text())["project"]
            for name in project.get("entry-points", {}).get(NAME, {}):
                yield name, project["name"], pyproject.parent


def plugin_sections() -> Iterator[Section]:
    """Each repository plugin's config section, asked through its own `ember_config_section`.

    Raises:
        PluginNotInstalled: a plugin of this repository is missing from the environment.
    """
    installed = installed_plugins()
    for name, dist, directory in workspace_plugins():
        if name not in installed or installed[name].distribution != dist:
            raise PluginNotInstalled(
                f"plugin {name!r} of {dist} ({directory.relative_to(ROOT)}) is not installed "
                f"here; run `{COMMAND}` from the repository root, where uv installs every "
                "workspace member"
            )
        where = directory.relative_to(ROOT)
        kind = "the example plugin" if where.parts[0] == "examples" else "the plugin"
        plugin = f"{kind} `{name}` ([{where}](../{where / 'README.md'}))"
        for section, cls in EmberPlugins.load([name]).config_sections().items():
            yield from nested_sections(cls, section, plugin)


def all_sections() -> list[Section]:
    """The top level; RunConfig's own sections, then those it inherits; then plugin sections."""
    own = RunConfig.__annotations__
    keys = sorted(config_fields(RunConfig), key=lambda item: item[0].name not in own)
    sections = [Section("", RunConfig)]
    for f, hint in keys:
        if dataclasses.is_dataclass(hint):
            sections.extend(nested_sections(hint, f.name))
    return sections + list(plugin_sections())


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------


def anchor(path: str) -> str:
    """The GitHub anchor of a `## path` heading."""
    return re.sub(r"[^a-z0-9 _-]", "", path.lower()).replace(" ", "-")


def type_name(hint: Any) -> str:
    """A type as a config file author reads it: YAML `null`, literal choices, `mapping`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        return "null"
    if hint is Any:
        return "any"
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (list, tuple):
        return f"list[{type_name(args[0])}]" if args else "list"
    if origin is dict or hint is dict:
        return "mapping"
    if dataclasses.is_dataclass(hint):
        return "section"
    return getattr(hint, "__name__", str(hint))


def value_text(value: Any) -> str:
    return json.dumps(dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value)


def default_text(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        return f"`{value_text(f.default)}`"
    if f.default_factory is not dataclasses.MISSING:
        return f"`{value_text(f.default_factory())}`"
    return "required"


def cell(text: str) -> str:
    """Markdown table-cell text: pipes escaped, angle brackets kept outside code spans."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # even parts lie outside code spans
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts).replace("|", "\\|")


def first_paragraph(cls: type) -> str:
    return " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())


def descriptions(cls: type) -> dict[str, str]:
    """Field docstrings of `cls` and of the dataclasses it inherits fields from."""
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base) and base is not object:
            docs.update(field_docs(base))
    return docs


def render_section(section: Section, children: dict[str, str]) -> list[str]:
    """One section's heading, origin line and key table (a preset table for MAPPING_FIELDS)."""
    cls = section.cls
    docs = descriptions(cls)
    heading = section.path or "Top level"
    lines = [f"## {heading}", "", cell(first_paragraph(cls)), ""]
    origin = f"Dataclass `{cls.__module__}.{cls.__qualname__}` (`{distribution_of(cls)}`)"
    if section.plugin:
        origin += f", declared by {section.plugin}; read only when the plugin is enabled"
    lines += [f"{origin}.", ""]
    presets = cls is ModelConfig
    if presets:
        names = sorted(PRESETS)
        lines += [
            "Keys of this mapping replace the chosen preset's values (`train.model`); the "
            "columns show each preset.",
            "",
            "| key | type | " + " | ".join(f"`{n}`" for n in names) + " | description |",
            "| --- | --- | " + " | ".join("---" for _ in names) + " | --- |",
        ]
    else:
        lines += ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    rows = config_fields(cls)
    if not section.path:
        rows = sorted(rows, key=lambda item: item[0].name not in cls.__annotations__)
    for f, hint in rows:
        if f.name not in docs:
            raise ValueError(
                f"{cls.__module__}.{cls.__qualname__}.{f.name} has no docstring; write one on "
                "the line under the field"
            )
        description = cell(docs[f.name])
        child = f"{section.path}.{f.name}" if section.path else f.name
        if child in children:
            description += f" See [{child}](#{anchor(child)})."
            default = ""
        else:
            default = default_text(f)
        if presets:
            values = " | ".join(f"`{value_text(getattr(PRESETS[n], f.name))}`" for n in names)
            lines.append(
                f"| `{config_key(f)}` | `{cell(type_name(hint))}` | {values} | {description} |"
            )
        else:
            row = f"| `{config_key(f)}` | `{cell(type_name(hint))}` | {default} | {description} |"
            lines.append(row)
    return lines + [""]


def render() -> str:
    """The whole reference, as written to docs/config-reference.md."""
    sections = all_sections()
    paths = {s.path: s for s in sections if s.path}
    top = [s for s in sections if s.path and "." not in s.path]
    core_names = {f.name for f, _ in config_fields(RunConfig)}
    lines = [
        "# Configuration reference",
        "",
        f"<!-- Generated by `{COMMAND}` from the config dataclasses' field docstrings. "
        "Edit those and regenerate; do not edit this file. -->",
        "",
        "Every key of an Ember run config, with its type, default and meaning. A run config is a",
        "YAML file with one section per component (`examples/default.yaml` is the default run);",
        "`ember train CONFIG --set section.key=value` overrides any key, and `--plugins a,b`",
        "replaces the `plugins` list. YAML `null` is Python `None`. Every section is parsed",
        "into the dataclass named under its heading, which checks its values; an unknown key is",
        "an error that lists the known ones. A plugin's section is read only when the plugin is",
        "enabled (`plugins: [name]`); without that it is ignored with an INFO line.",
        "",
        "Sections:",
        "",
    ]
    lines.append("- [Top level](#top-level)")
    for s in sections[1:]:
        depth = s.path.count(".")
        lines.append(f"{'  ' * depth}- [{s.path}](#{anchor(s.path)})")
    lines.append("")
    # The top level: RunConfig's own keys, then one row per plugin section.
    top_level = render_section(sections[0], paths)
    lines += top_level[:-1]
    for s in top:
        if s.path not in core_names:
            summary = cell(first_paragraph(s.cls))
            link = f"See [{s.path}](#{anchor(s.path)})."
            lines.append(f"| `{s.path}` | `section` |  | Section of {s.plugin}. {summary} {link} |")
    lines.append("")
    for s in sections[1:]:
        lines += render_section(s, paths)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    args = parser.parse_args(argv)
    try:
        text = render()
    except (PluginNotInstalled, ValueError) as exc:
        print(f"gen_config_reference: error: {exc}", file=sys.stderr)
        return 2
    shown = OUTPUT.relative_to(ROOT) if OUTPUT.is_relative_to(ROOT) else OUTPUT
    current = OUTPUT.read_text() if OUTPUT.exists() else ""
    if args.check:
        if current != text:
            print(f"{shown} is stale; run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    if current != text:
        OUTPUT.write_text(text)
    print(shown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
