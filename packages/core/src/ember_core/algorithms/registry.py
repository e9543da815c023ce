"""A small name -> object registry, so callers choose implementations by registered name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps registered names (and aliases) to objects.

    Components that a run config picks by name (KL kinds, advantage estimators, loss
    reductions, reward functions, ...) live in a `Registry` instead of an if/elif chain on
    a string: adding one is a registration, and a misspelt name fails with the list of
    known names.

    Example:
        >>> KINDS: Registry[Callable[[int], int]] = Registry("doubler")
        >>> @KINDS.register("twice", "x2")
        ... def _twice(x: int) -> int:
        ...     return 2 * x
        >>> KINDS.get("x2")(3)
        6
    """

    def __init__(self, kind: str) -> None:
        """Creates an empty registry.

        Args:
            kind: What the entries are, in words ("KL kind", "advantage estimator"); it
                names the registry in error messages.
        """
        self.kind = kind
        self._entries: dict[str, T] = {}

    def add(self, name: str, obj: T, *aliases: str) -> T:
        """Registers `obj` under `name` and every alias, and returns it.

        Raises:
            ValueError: A name is empty, not a string, or already registered.
        """
        for key in (name, *aliases):
            if not isinstance(key, str) or not key:
                raise ValueError(f"{self.kind} name must be a non-empty string, got {key!r}")
            if key in self._entries:
                raise ValueError(f"{self.kind} {key!r} is already registered")
        for key in (name, *aliases):
            self._entries[key] = obj
        return obj

    def register(self, name: str, *aliases: str) -> Callable[[T], T]:
        """Decorator form of `add`: registers the decorated object and returns it unchanged."""

        def decorator(obj: T) -> T:
            return self.add(name, obj, *aliases)

        return decorator

    def get(self, name: str) -> T:
        """Returns the object registered under `name`.

        Raises:
            ValueError: `name` is not registered; the message lists the known names.
        """
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            known = ", ".join(self.names())
            raise ValueError(f"unknown {self.kind} {name!r}; known: {known}") from None

    def names(self) -> list[str]:
        """All registered names and aliases, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        try:
            return name in self._entries
        except TypeError:  # unhashable: certainly not a registered name
            return False

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"
