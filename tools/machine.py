"""The machine a figure came from (the tools import it from here): `ember.machine`."""

from ember.machine import describe_machine, processor, processor_name

__all__ = ["describe_machine", "processor", "processor_name"]
