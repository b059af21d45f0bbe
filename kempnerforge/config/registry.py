"""A small generic name -> builder registry for choices that users extend."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from kempnerforge.core.errors import ConfigError, closest_name

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps a config value (``optimizer.name``) to the thing it selects.

    ``field`` is the dotted config field the name comes from, so an unknown name raises a
    ConfigError that says where it was set and lists the choices.
    """

    def __init__(self, field: str) -> None:
        self.field = field
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(entry: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.field}: {name!r} is registered twice")
            self._entries[name] = entry
            return entry

        return decorator

    def unregister(self, name: str) -> None:
        """Remove what ``register`` added under ``name`` (a test's own entry, after the test)."""
        del self._entries[name]

    def get(self, name: str) -> T:
        if name not in self._entries:
            suggestion = closest_name(name, self._entries)
            hint = f"did you mean {suggestion!r}?" if suggestion else ""
            raise ConfigError(self.field, name, "one of " + ", ".join(self.names()), hint)
        return self._entries[name]

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries
