"""Plugin discovery (entry-point group `ember`) and the typed facade all hook calls go through."""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import inspect
import logging
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pluggy

from ember_core import hookspecs
from ember_core.hookspecs import (
    NAME,
    ConfigSection,
    EngineClient,
    GenerateSettings,
    KLExemption,
    Phase,
    Role,
)
from ember_core.types import Sample

logger = logging.getLogger(__name__)

TRACE_ENV = "EMBER_TRACE_HOOKS"


@dataclass(frozen=True, slots=True)
class InstalledPlugin:
    """A plugin found through entry-point metadata."""

    name: str
    value: str
    """The entry point's target, `module` or `module:object`."""
    distribution: str | None
    version: str | None


def installed_plugins() -> dict[str, InstalledPlugin]:
    """Every plugin registered under the `ember` entry-point group, by name (sorted)."""
    found: dict[str, InstalledPlugin] = {}
    for ep in importlib.metadata.entry_points(group=NAME):
        dist = getattr(ep, "dist", None)
        found.setdefault(
            ep.name,
            InstalledPlugin(
                name=ep.name,
                value=ep.value,
                distribution=dist.metadata["Name"] if dist is not None else None,
                version=dist.version if dist is not None else None,
            ),
        )
    return dict(sorted(found.items()))


def _load_entry_point(name: str) -> ModuleType | object:
    entry_point = next(ep for ep in importlib.metadata.entry_points(group=NAME) if ep.name == name)
    return entry_point.load()


class EmberPlugins:
    """The plugin manager for one run, with one typed method per hook.

    Only plugins enabled by name are registered: installing a plugin changes nothing until a run
    config (or `--plugins`) enables it.
    """

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(NAME)
        self.pm.add_hookspecs(hookspecs)
        self._enabled: list[str] = []
        if os.environ.get(TRACE_ENV, "") not in ("", "0"):
            self.pm.trace.root.setwriter(lambda line: sys.stderr.write(line))
            self.pm.enable_tracing()

    @classmethod
    def load(
        cls, enabled: Iterable[str], built_in: Mapping[str, str] | None = None
    ) -> EmberPlugins:
        """Load and register the enabled plugins from entry-point metadata.

        Args:
            enabled: Plugin names (entry-point names) to switch on, in order.
            built_in: Plugins that are part of the caller's own package, by name: the module
                to import. They are not installed plugins (`installed_plugins` and `ember
                plugins` do not list them); a command of that package enables them.

        Raises:
            ValueError: A name is not installed; the message lists the installed plugins.
            pluggy.PluginValidationError: A plugin implements a hook that does not exist (for
                example a misspelt name) or with arguments the spec does not have.
        """
        plugins = cls()
        names = list(dict.fromkeys(enabled))
        built_in = dict(built_in or {})
        installed = installed_plugins()
        unknown = [n for n in names if n not in installed and n not in built_in]
        if unknown:
            listing = ", ".join(installed) or "none"
            raise ValueError(
                f"plugins: {', '.join(map(repr, unknown))} not installed; installed plugins: "
                f"{listing}"
            )
        for name in names:
            if name in built_in:
                plugins.register(importlib.import_module(built_in[name]), name)
            else:
                plugins.register(_load_entry_point(name), name)
        plugins.check_pending()
        return plugins

    def register(self, plugin: ModuleType | object, name: str) -> None:
        """Register a plugin object under `name` (tests use this directly)."""
        self.pm.register(plugin, name=name)
        self._enabled.append(name)

    def unregister(self, name: str) -> None:
        self.pm.unregister(name=name)
        self._enabled.remove(name)

    def check_pending(self) -> None:
        """Fail if any registered hookimpl matches no hookspec."""
        self.pm.check_pending()

    @property
    def enabled(self) -> list[str]:
        """Names of the registered plugins, in registration order."""
        return list(self._enabled)

    # -- setup ---------------------------------------------------------------------------------

    def config_sections(self) -> dict[str, type]:
        """Each enabled plugin's config section class, by section name."""
        sections: dict[str, type] = {}
        results: list[ConfigSection] = self.pm.hook.ember_config_section()
        for section in reversed(results):
            if section.name in sections:
                raise ValueError(f"config section {section.name!r} is declared by two plugins")
            sections[section.name] = section.cls
        return sections

    def configure(self, config: Any, sections: dict[str, Any]) -> None:
        """Hand every plugin the run config, its section and this facade (to query later)."""
        self.pm.hook.ember_configure(config=config, sections=sections, plugins=self)

    def model_config(self, role: Role, model_config: Any) -> None:
        self.pm.hook.ember_model_config(role=Role(role), model_config=model_config)

    # -- rollout -------------------------------------------------------------------------------

    def rollout_request_fields(self, engine: str) -> dict[str, Any]:
        """The merged extra request fields of all plugins.

        Raises:
            ValueError: Two plugins set one field to different values.
        """
        merged: dict[str, Any] = {}
        for fields in reversed(self.pm.hook.ember_rollout_request_fields(engine=engine)):
            for key, value in fields.items():
                if key in merged and merged[key] != value:
                    raise ValueError(
                        f"request field {key!r} set to both {merged[key]!r} and {value!r} by "
                        "enabled plugins"
                    )
                merged[key] = value
        return merged

    def rollout_server_args(self, engine: str) -> list[str]:
        args: list[str] = []
        for extra in reversed(self.pm.hook.ember_rollout_server_args(engine=engine)):
            args.extend(extra)
        return args

    def process_sample(self, sample: Any, meta_info: dict[str, Any], engine: str) -> None:
        self.pm.hook.ember_process_sample(sample=sample, meta_info=meta_info, engine=engine)

    def has_generate(self) -> bool:
        """Whether an enabled plugin implements `ember_generate` (else every group takes the
        built-in generation, without asking)."""
        return bool(self.pm.hook.ember_generate.get_hookimpls())

    async def generate(
        self,
        client: EngineClient,
        record: Any,
        prompt_ids: list[int],
        sampling: GenerateSettings,
        routed_experts: bool,
    ) -> list[Sample] | None:
        """The first plugin's samples for one prompt group (awaited when it is `async def`), or
        None when no plugin takes the group. The caller checks the samples."""
        result = self.pm.hook.ember_generate(
            client=client,
            record=record,
            prompt_ids=list(prompt_ids),
            sampling=sampling,
            routed_experts=routed_experts,
        )
        if inspect.isawaitable(result):
            result = await result
        return result

    # -- training ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def forward_context(self, role: Role, phase: Phase, batch: Any = None) -> Iterator[None]:
        """Hold every plugin's context for one pass, entered in registration order."""
        managers: list[AbstractContextManager[None]] = self.pm.hook.ember_forward_context(
            role=Role(role), phase=Phase(phase), batch=batch
        )
        with contextlib.ExitStack() as stack:
            for manager in reversed(managers):
                stack.enter_context(manager)
            yield

    def kl_check_exemptions(self) -> list[KLExemption]:
        return list(reversed(self.pm.hook.ember_kl_check_exemptions()))

    def replayed_reference_forward(self, rollout_id: int) -> bool:
        """Whether any plugin asks for the check-only, routing-replayed reference forward."""
        return any(self.pm.hook.ember_replayed_reference_forward(rollout_id=rollout_id))

    def rebuilt_reference_forward(self, rollout_id: int) -> bool:
        """Whether any plugin asks for the check-only forward of a reference rebuilt from its
        source."""
        return any(self.pm.hook.ember_rebuilt_reference_forward(rollout_id=rollout_id))

    def audit_rollout(self, rollout_id: int) -> bool:
        """Whether any plugin asks for an audit iteration at this rollout."""
        return any(self.pm.hook.ember_audit_rollout(rollout_id=rollout_id))

    # -- logging -------------------------------------------------------------------------------

    def after_train_step(
        self, rollout_id: int, step_id: int, accumulated_step_id: int, metrics: dict[str, float]
    ) -> None:
        self.pm.hook.ember_after_train_step(
            rollout_id=rollout_id,
            step_id=step_id,
            accumulated_step_id=accumulated_step_id,
            metrics=metrics,
        )

    def after_log_rollout_data(self, rollout_id: int, metrics: dict[str, float]) -> None:
        self.pm.hook.ember_after_log_rollout_data(rollout_id=rollout_id, metrics=metrics)
