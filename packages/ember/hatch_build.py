"""Ship the repository's example run configs inside the `ember` wheel (as `ember/examples/`).

In a checkout they live at the repository root (`examples/*.yaml`), outside this package, so a
plain wheel would lack them and `ember train` with no config would fail once installed. Built
from the checkout, the hook copies them in (into `src/ember/examples/` of a source
distribution); built from such a source distribution, they are already inside the package.
"""

from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class ExamplesHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict) -> None:
        if version == "editable":
            return  # an editable install reads the checkout's examples/ directly
        root = Path(self.root).resolve()
        examples = root.parents[1] / "examples"
        if root.parent.name != "packages" or not (examples / "default.yaml").is_file():
            return  # not the checkout: a source distribution that already holds them
        prefix = "ember/examples" if self.target_name == "wheel" else "src/ember/examples"
        for config in sorted(examples.glob("*.yaml")):
            build_data["force_include"][str(config)] = f"{prefix}/{config.name}"
