"""One registry mechanism for every plug-in point (advantages, losses, rewards, environments, rollouts).

A registry maps a short name to a callable. Every entry of one registry has the same signature (stated
by the registry's ``signature`` text and checked by the contract tests). A lookup accepts a registered
name or a dotted path ``package.module:attribute``, so a researcher can plug in their own function from
config without touching vlrl. Registering a name twice is an error: silent shadowing is how two plug-ins
end up fighting over one name.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class RegistryError(KeyError):
    """A name that is not registered, not importable, or registered twice."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it readable
        return str(self.args[0]) if self.args else ""


class Registry(Generic[F]):
    """A named table of callables that share one signature.

    >>> ADV = Registry("advantage", signature="fn(token_rewards, loss_mask, group_index, values, **options)")
    >>> @ADV.register("zero")
    ... def zero(token_rewards, loss_mask, group_index, values=None):
    ...     return token_rewards * 0
    >>> ADV.get("zero") is zero
    True
    """

    def __init__(self, kind: str, *, signature: str = "") -> None:
        self.kind = kind
        self.signature = signature
        self._entries: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator: add ``fn`` under ``name``; a second registration of the same name raises."""

        def decorator(fn: F) -> F:
            if name in self._entries and self._entries[name] is not fn:
                raise RegistryError(
                    f"{self.kind} {name!r} is already registered (by {_qualname(self._entries[name])}); "
                    f"pick another name for {_qualname(fn)}"
                )
            self._entries[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> F:
        """Return the entry for a registered ``name`` or a dotted path ``pkg.mod:attr``."""
        if name in self._entries:
            return self._entries[name]
        if ":" in name:
            module_name, _, attr = name.partition(":")
            try:
                module = importlib.import_module(module_name)
            except ImportError as err:
                raise RegistryError(f"{self.kind} {name!r}: cannot import module {module_name!r} ({err})") from err
            try:
                return getattr(module, attr)
            except AttributeError as err:
                raise RegistryError(f"{self.kind} {name!r}: module {module_name!r} has no {attr!r}") from err
        known = ", ".join(sorted(self._entries)) or "(none)"
        raise RegistryError(f"unknown {self.kind} {name!r}; registered: {known}; or give a dotted path 'pkg.mod:fn'")

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))

    def names(self) -> list[str]:
        return sorted(self._entries)

    def items(self) -> list[tuple[str, F]]:
        return sorted(self._entries.items())


def _qualname(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
