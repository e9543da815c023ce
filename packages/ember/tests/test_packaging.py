"""Packaging: every workspace member builds its own wheel and works installed on its own.

Each member's wheel goes into a fresh virtual environment with nothing but what its metadata
declares: the workspace wheels it names (and theirs), and third-party packages at the versions
uv.lock pins, so uv takes them from its cache. Every module must import there, from the
environment; plugins must load through their entry points; and the `ember` command must list
exactly the plugins installed next to it. Members are read from the workspace definition, so a
new one is covered without changing this file.
"""

from __future__ import annotations

import configparser
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

from ember_core.hookspecs import NAME

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
TIMEOUT = 600


def canonical(name: str) -> str:
    """A distribution name in its normalised form (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    return canonical(Requirement(requirement).name)


def normalized(requirement: str) -> tuple[Any, ...]:
    """A requirement in a form where equal requirements compare equal."""
    req = Requirement(requirement)
    specifiers = frozenset(str(s) for s in req.specifier)
    return canonical(req.name), frozenset(req.extras), specifiers, str(req.marker or "")


def unconditional(requirements: list[str]) -> list[str]:
    """The requirements that do not belong to an extra."""
    return [r for r in requirements if "extra" not in str(Requirement(r).marker or "")]


# --------------------------------------------------------------------------------------------
# The workspace
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Member:
    """One workspace member: its directory and the [project] table of its pyproject.toml."""

    path: Path
    project: dict[str, Any]

    @property
    def name(self) -> str:
        return canonical(self.project["name"])

    @property
    def packages(self) -> list[str]:
        """Import packages: the directories under src/ with an __init__.py."""
        return sorted(p.parent.name for p in (self.path / "src").glob("*/__init__.py"))

    @property
    def plugins(self) -> dict[str, str]:
        """Entry points of the plugin group, by name."""
        return dict(self.project.get("entry-points", {}).get(NAME, {}))

    def source_files(self) -> set[str]:
        """Files of the import packages, relative to src/, plus the example run configs that
        the `ember` distribution's build hook ships as `ember/examples/` (what the wheel must
        hold)."""
        src = self.path / "src"
        files = {
            p.relative_to(src).as_posix()
            for package in self.packages
            for p in (src / package).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
        }
        if (self.path / "hatch_build.py").is_file():
            files |= {f"ember/examples/{p.name}" for p in (ROOT / "examples").glob("*.yaml")}
        return files

    def modules(self) -> set[str]:
        """Dotted names of every module of the import packages. A folder without an
        `__init__.py` is data, not a subpackage (the `sglang_cpu/site/` directory goes on a
        server's own path as top-level modules), so nothing under it is named."""
        src = self.path / "src"
        names = set()
        for path in self.source_files():
            if not path.endswith(".py"):
                continue
            parts = path.removesuffix(".py").split("/")
            folders = ["/".join(parts[:i]) for i in range(1, len(parts))]
            if all((src / folder / "__init__.py").is_file() for folder in folders):
                names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
        return names


def workspace_members() -> list[Member]:
    """The members named by [tool.uv.workspace] of the root pyproject.toml."""
    workspace = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["uv"]["workspace"]
    excluded = {p.resolve() for pattern in workspace.get("exclude", []) for p in ROOT.glob(pattern)}
    members = []
    for pattern in workspace["members"]:
        for path in sorted(ROOT.glob(pattern)):
            pyproject = path / "pyproject.toml"
            if pyproject.is_file() and path.resolve() not in excluded:
                members.append(Member(path, tomllib.loads(pyproject.read_text())["project"]))
    return members


MEMBERS = workspace_members()
BY_NAME = {m.name: m for m in MEMBERS}


# --------------------------------------------------------------------------------------------
# Wheels
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Wheel:
    path: Path
    metadata: Any
    """The parsed METADATA (an email.message.Message)."""
    entry_points: dict[str, dict[str, str]]
    files: set[str]

    @classmethod
    def read(cls, path: Path) -> Wheel:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
            metadata = Parser().parsestr(archive.read(f"{info}/METADATA").decode())
            parser = configparser.ConfigParser(delimiters=("=",), interpolation=None)
            parser.optionxform = str  # entry-point names are case-sensitive
            if f"{info}/entry_points.txt" in names:
                parser.read_string(archive.read(f"{info}/entry_points.txt").decode())
        entry_points = {group: dict(parser[group]) for group in parser.sections()}
        files = {n for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
        return cls(path, metadata, entry_points, files)

    @property
    def requires(self) -> list[str]:
        return unconditional(self.metadata.get_all("Requires-Dist") or [])


def workspace_closure(name: str, wheels: dict[str, Wheel]) -> list[str]:
    """`name` and every workspace member its wheel requires, directly or not."""
    seen: list[str] = []
    todo = [name]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.append(current)
        todo += [r for r in map(requirement_name, wheels[current].requires) if r in wheels]
    return seen


# --------------------------------------------------------------------------------------------
# uv and virtual environments
# --------------------------------------------------------------------------------------------


def find_uv() -> list[str] | None:
    """The uv command: $UV (set by `uv run`), uv on PATH, or the `uv` Python package's binary."""
    for candidate in (os.environ.get("UV"), shutil.which("uv")):
        if candidate and Path(candidate).is_file():
            return [candidate]
    try:
        from uv import find_uv_bin
    except ImportError:
        return None
    return [find_uv_bin()]


def clean_env() -> dict[str, str]:
    """This process's environment without the variables that point at the workspace's venv."""
    drop = {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "UV_PROJECT_ENVIRONMENT"}
    return {k: v for k, v in os.environ.items() if k not in drop}


def run(command: list[str], *, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        command, cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=TIMEOUT
    )
    if check and proc.returncode != 0:
        pytest.fail(
            f"{' '.join(map(str, command))} exited with {proc.returncode}\n"
            f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}",
            pytrace=False,
        )
    return proc


class Installer:
    """Builds wheels and installs them into fresh virtual environments with uv."""

    def __init__(self, uv: list[str], work: Path) -> None:
        self.uv = uv
        self.work = work
        self.dist = work / "dist"
        self.constraints = work / "constraints.txt"
        self.link_mode = "hardlink"
        self.envs: dict[str, Path] = {}

    def uv_run(self, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
        """A uv command from the local cache first, from the network only if that fails."""
        command = [*self.uv, *args]
        proc = run([*command, "--offline"], cwd=cwd or self.work, check=False)
        return proc if proc.returncode == 0 else run(command, cwd=cwd or self.work)

    def build(self) -> dict[str, Wheel]:
        self.uv_run("build", "--all-packages", "--wheel", "--out-dir", str(self.dist), cwd=ROOT)
        run(
            [*self.uv, "export", "--frozen", "--no-hashes", "--all-packages", "--all-extras"]
            + ["--no-emit-workspace", "--format", "requirements.txt"]
            + ["--output-file", str(self.constraints)],
            cwd=ROOT,
        )
        wheels = {}
        for path in sorted(self.dist.glob("*.whl")):
            wheel = Wheel.read(path)
            wheels[canonical(wheel.metadata["Name"])] = wheel
        return wheels

    def python(self, env: Path) -> Path:
        return env / "bin" / "python"

    def create(self, key: str, wheels: list[Wheel]) -> Path:
        """A fresh environment holding `wheels` and the third-party packages they require."""
        env = self.work / "envs" / key
        run([*self.uv, "venv", "--quiet", "--python", sys.executable, str(env)], cwd=self.work)
        self.install(env, wheels)
        self.envs[key] = env
        return env

    def install(self, env: Path, wheels: list[Wheel]) -> None:
        self.uv_run(
            "pip", "install", "--quiet", "--python", str(self.python(env)),
            "--link-mode", self.link_mode, "--constraints", str(self.constraints),
            *(str(w.path) for w in wheels),
        )  # fmt: skip

    def uninstall(self, env: Path, names: list[str]) -> None:
        run(
            [*self.uv, "pip", "uninstall", "--quiet", "--python", str(self.python(env)), *names],
            cwd=self.work,
        )


@contextlib.contextmanager
def work_dir(uv: list[str], tmp: Path) -> Iterator[Path]:
    """Where the environments go: on the uv cache's filesystem, so installing hardlinks files
    from the cache instead of copying them (torch and its CUDA libraries are gigabytes)."""
    cache = Path(run([*uv, "cache", "dir"], cwd=tmp).stdout.strip())
    if not cache.is_dir() or cache.stat().st_dev == tmp.stat().st_dev:
        yield tmp
        return
    try:
        # uv keeps its own temporary directories in the cache root for the same reason.
        path = Path(tempfile.mkdtemp(prefix=".ember-packaging-", dir=cache))
    except OSError:
        yield tmp  # a read-only cache: uv copies instead, slower but correct
        return
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def installer(tmp_path_factory) -> Iterator[Installer]:
    uv = find_uv()
    if uv is None:
        pytest.skip("needs uv (pip install uv)")
    with work_dir(uv, tmp_path_factory.mktemp("packaging")) as work:
        yield Installer(uv, work)


@pytest.fixture(scope="module")
def wheels(installer) -> dict[str, Wheel]:
    return installer.build()


# The probe runs inside an environment: it imports every module of the given packages and
# loads every plugin through its entry point, and reports what it found as JSON.
PROBE = r"""
import importlib, importlib.metadata as md, json, pkgutil, re, sys

args = json.loads(sys.argv[1])
out = {"imported": [], "errors": {}, "outside": [], "plugins": {}, "dists": []}


def failed(name):
    error = sys.exc_info()[1]
    out["errors"][name] = f"{type(error).__name__}: {error}"


for top in args["packages"]:
    try:
        package = importlib.import_module(top)
    except Exception:
        failed(top)
        continue
    names = [top] + [m.name for m in pkgutil.walk_packages(package.__path__, top + ".", failed)]
    for name in names:
        try:
            module = importlib.import_module(name)
        except Exception:
            failed(name)
            continue
        out["imported"].append(name)
        if not module.__file__.startswith(sys.prefix):
            out["outside"].append(f"{name}: {module.__file__}")
for entry_point in md.entry_points(group=args["group"]):
    try:
        from ember_core.plugins import EmberPlugins

        EmberPlugins.load([entry_point.name])
        out["plugins"][entry_point.name] = "ok"
    except Exception as error:
        out["plugins"][entry_point.name] = f"{type(error).__name__}: {error}"
out["dists"] = sorted(
    re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower() for d in md.distributions()
)
print(json.dumps(out))
"""


def probe(installer: Installer, env: Path, packages: list[str]) -> dict[str, Any]:
    # -I: no current directory or PYTHONPATH on sys.path, so nothing can come from the sources.
    args = json.dumps({"packages": packages, "group": NAME})
    proc = run([str(installer.python(env)), "-I", "-c", PROBE, args], cwd=installer.work)
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------


def test_workspace_has_the_members_the_design_names():
    expected = {"ember", "ember-core", "ember-megatron-backend", "ember-rollout"}
    assert expected <= set(BY_NAME)
    assert {"r3_routing", "ci_kl_checker"} <= {p for m in MEMBERS for p in m.plugins}


def test_every_member_builds_a_wheel_with_its_metadata(wheels):
    assert set(wheels) == set(BY_NAME)
    for name, member in BY_NAME.items():
        project, wheel = member.project, wheels[name]
        meta = wheel.metadata
        where = f"{name} ({member.path.relative_to(ROOT)})"
        assert meta["Version"] == project["version"], where
        assert project.get("description") and meta["Summary"] == project["description"], where
        license_ = project.get("license")
        assert license_ and meta["License-Expression"] == license_, where
        assert meta["Requires-Python"] == project["requires-python"], where
        declared = {normalized(r) for r in project.get("dependencies", [])}
        assert {normalized(r) for r in wheel.requires} == declared, where
        assert wheel.entry_points.get(NAME, {}) == member.plugins, where
        assert wheel.entry_points.get("console_scripts", {}) == project.get("scripts", {}), where
        assert member.packages, f"{where}: no import package under src/"
        assert wheel.files == member.source_files(), f"{where}: wheel files differ from src/"


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_member_installs_alone_and_imports(installer, wheels, name):
    member = BY_NAME[name]
    closure = workspace_closure(name, wheels)
    env = installer.create(name, [wheels[n] for n in closure])
    packages = sorted({p for n in closure for p in BY_NAME[n].packages})
    found = probe(installer, env, packages)

    assert found["errors"] == {}, "\n".join(f"{k}: {v}" for k, v in found["errors"].items())
    assert found["outside"] == []
    assert member.modules() <= set(found["imported"])
    # Nothing of the workspace but what the metadata asks for.
    assert {d for d in found["dists"] if d in BY_NAME} == set(closure)
    plugins = {p: "ok" for n in closure for p in BY_NAME[n].plugins}
    assert found["plugins"] == plugins, found["plugins"]


def test_installed_ember_finds_its_example_configs(installer, wheels):
    """`ember train` with no config runs the default example, also outside the checkout."""
    env = installer.envs.get("ember") or installer.create(
        "ember", [wheels[n] for n in workspace_closure("ember", wheels)]
    )
    code = "from ember.config import resolve_config_path as r; print(r(None)); print(r('ppo'))"
    proc = run([str(installer.python(env)), "-I", "-c", code], cwd=installer.work)
    default, ppo = (Path(line) for line in proc.stdout.split())
    for path, name in ((default, "default.yaml"), (ppo, "ppo.yaml")):
        assert path.is_relative_to(env.resolve()) and path.name == name, path
        assert path.read_text() == (ROOT / "examples" / name).read_text()


def test_ember_lists_exactly_the_installed_plugins(installer, wheels):
    (cli,) = [m for m in MEMBERS if "ember" in m.project.get("scripts", {})]
    env = installer.envs.get(cli.name) or installer.create(
        cli.name, [wheels[n] for n in workspace_closure(cli.name, wheels)]
    )
    present = set(workspace_closure(cli.name, wheels))

    def listed() -> list[list[str]]:
        proc = run([str(env / "bin" / "ember"), "plugins"], cwd=installer.work)
        return [line.split() for line in proc.stdout.splitlines()]

    assert not any(BY_NAME[n].plugins for n in present), "the CLI must not require a plugin"
    assert listed() == [["no", "plugins", "installed"]]
    plugins = [m for m in MEMBERS if m.plugins]
    assert plugins
    for plugin in plugins:
        added = [n for n in workspace_closure(plugin.name, wheels) if n not in present]
        installer.install(env, [wheels[n] for n in added])
        try:
            version = plugin.project["version"]
            expected = [
                [entry, "disabled", plugin.project["name"], version]
                for entry in sorted(plugin.plugins)
            ]
            assert listed() == expected, plugin.name
        finally:
            installer.uninstall(env, added)
