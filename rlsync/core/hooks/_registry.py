"""A name -> factory map for pluggable pieces, with errors that list the alternatives."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from rlsync.core._errors import PluginError

T = TypeVar("T")


class Registry(Generic[T]):
    """Named factories of one kind (``"transport"``, ``"buffer backend"``, ``"gate"``)."""

    __slots__ = ("_factories", "kind")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._factories: dict[str, Callable[..., T]] = {}

    def add(self, name: str, factory: Callable[..., T]) -> None:
        """Register ``factory`` under ``name``; the first registration of a name wins."""
        self._factories.setdefault(name, factory)

    def get(self, name: str) -> Callable[..., T]:
        try:
            return self._factories[name]
        except KeyError:
            known = ", ".join(sorted(self._factories)) or "none"
            raise PluginError(
                f"unknown {self.kind} {name!r}; registered: {known}. "
                f"Install the plugin that provides it (entry-point group 'rlsync_plugins') "
                f"or pick one of the registered names."
            ) from None

    def create(self, name: str, /, *args: Any, **kwargs: Any) -> T:
        return self.get(name)(*args, **kwargs)

    def names(self) -> list[str]:
        return sorted(self._factories)

    def __contains__(self, name: object) -> bool:
        return name in self._factories

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
