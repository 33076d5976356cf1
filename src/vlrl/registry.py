"""One registry mechanism for every plug-in point (advantages, losses, rewards, environments, rollouts).

A registry maps a short name to a callable. Every entry of one registry has the same signature (stated
by the registry's ``signature`` text and checked by the contract tests). A lookup accepts a registered
name or a dotted path ``package.module:attribute``, so a researcher can plug in their own function from
config without touching vlrl. Registering a name twice is an error: silent shadowing is how two plug-ins
end up fighting over one name.

Built-ins are found, not listed: a registry created with ``discover=<package>`` imports every public module of that
package at its first lookup, so a built-in reward, environment or task suite is one file in its package that
registers itself (`vlrl.rewards`, `vlrl.rollout.envs`, `vlrl.data.tasks`; model families do the same,
`vlrl.models.families`). The package names no module, and its modules import the registry: no circle of imports.
An entry may also be registered by location (`Registry.register_path`, ``pkg.mod:attr``): the module is imported at
the first lookup. The structure test reads such a string as an import, so a registration never points to a higher
room.

Options. A plug-in's options are its keyword-only parameters (``fn(inputs, *, eps=1e-6, norm_by_std=True)``);
the recipe binds them from config. `option_problems` checks a config's options against that signature — unknown
names, missing required options, wrong types — before anything loads, each problem naming the config field. A
plug-in whose options are a pydantic model declares it as ``fn.options_model``; that model validates them instead.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

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

    def __init__(self, kind: str, *, signature: str = "", discover: str | None = None) -> None:
        self.kind = kind
        self.signature = signature
        self.discover = discover  # the package whose public modules hold the built-ins (imported at the first lookup)
        self._entries: dict[str, F] = {}
        self._paths: dict[str, str] = {}  # name → "pkg.mod:attr", imported at the first lookup
        self._found = discover is None

    def _find_builtins(self) -> None:
        """Import every public module of the ``discover`` package once (each registers its entries)."""
        if self._found:
            return
        self._found = True
        package = importlib.import_module(self.discover)
        for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda info: info.name):
            if not info.name.startswith("_"):
                importlib.import_module(f"{self.discover}.{info.name}")

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator: add ``fn`` under ``name``; a second registration of the same name raises."""

        def decorator(fn: F) -> F:
            if name in self._paths or (name in self._entries and self._entries[name] is not fn):
                owner = self._paths.get(name) or _qualname(self._entries[name])
                raise RegistryError(f"{self.kind} {name!r} is already registered (by {owner}); "
                                    f"pick another name for {_qualname(fn)}")
            self._entries[name] = fn
            return fn

        return decorator

    def register_path(self, name: str, path: str) -> None:
        """Register ``name`` as the object at ``path`` (``pkg.mod:attr``), imported at the first `get`."""
        if name in self._entries or self._paths.get(name, path) != path:
            raise RegistryError(f"{self.kind} {name!r} is already registered; pick another name for {path}")
        self._paths[name] = path

    def get(self, name: str) -> F:
        """Return the entry for a registered ``name`` or a dotted path ``pkg.mod:attr``."""
        self._find_builtins()
        if name in self._entries:
            return self._entries[name]
        if name in self._paths:
            self._entries[name] = self._import(name, self._paths[name])
            return self._entries[name]
        if ":" in name:
            return self._import(name, name)
        known = ", ".join(self.names()) or "(none)"
        raise RegistryError(f"unknown {self.kind} {name!r}; registered: {known}; or give a dotted path 'pkg.mod:fn'")

    def _import(self, name: str, path: str) -> F:
        module_name, _, attr = path.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise RegistryError(f"{self.kind} {name!r}: cannot import module {module_name!r} ({err})") from err
        try:
            return getattr(module, attr)
        except AttributeError as err:
            raise RegistryError(f"{self.kind} {name!r}: module {module_name!r} has no {attr!r}") from err

    def __contains__(self, name: str) -> bool:
        self._find_builtins()
        return name in self._entries or name in self._paths

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def names(self) -> list[str]:
        self._find_builtins()
        return sorted({*self._entries, *self._paths})

    def items(self) -> list[tuple[str, F]]:
        return [(name, self.get(name)) for name in self.names()]


# ----------------------------------------------------------------------------------------------- options
def option_problems(fn: Callable, options: Mapping[str, Any], *, where: str, name: str,
                    bound: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """(config field, message) of every option in ``options`` that plug-in ``fn`` cannot take.

    ``where`` is the config field holding the options (``algo.advantage_options``), ``name`` the plug-in's
    name as configured, ``bound`` the keyword parameters the recipe itself passes (name → the config field or
    the part of vlrl that sets them). Options are ``fn``'s keyword-only parameters (a class: its constructor's),
    or ``fn.options_model`` (a pydantic model) when it declares one; a ``**kwargs`` parameter takes any name.
    """
    bound = dict(bound or {})
    model = getattr(fn, "options_model", None)
    if model is not None:
        return _model_problems(model, options, where=where, name=name)
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable without a signature: nothing to check against
        return []
    keyword = {p.name: p for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    known = sorted(k for k in keyword if k not in bound)
    problems = []
    for key in options:
        if key in bound:
            problems.append((f"{where}.{key}", f"set by {bound[key]}, not an option of {name}"))
        elif key not in keyword and not open_ended:
            problems.append((f"{where}.{key}", f"unknown option of {name}; known: {', '.join(known) or 'none'}"))
    for key, p in keyword.items():
        if p.default is inspect.Parameter.empty and key not in options and key not in bound:
            problems.append((f"{where}.{key}", f"required option of {name} is missing"))
    hints = _type_hints(fn)
    for key, value in options.items():
        if key in keyword and key not in bound and key in hints:
            message = _type_problem(hints[key], value)
            if message:
                problems.append((f"{where}.{key}", f"{message} (option of {name})"))
    return problems


def _model_problems(model: Any, options: Mapping[str, Any], *, where: str, name: str) -> list[tuple[str, str]]:
    from pydantic import ValidationError

    try:
        model(**options)
    except ValidationError as err:
        return [(".".join([where, *(str(p) for p in e["loc"])]),
                 f"unknown option of {name}; known: {', '.join(sorted(model.model_fields))}"
                 if e["type"] == "extra_forbidden" else f"{e['msg']} (option of {name})") for e in err.errors()]
    except ValueError as err:  # a model_validator's own check
        return [(where, f"{err} (options of {name})")]
    return []


def _type_hints(fn: Callable) -> dict[str, Any]:
    target = fn.__init__ if inspect.isclass(fn) else fn
    try:
        return typing.get_type_hints(target)
    except Exception:  # an annotation that does not resolve here: check names only
        return {}


def _type_problem(hint: Any, value: Any) -> str | None:
    """Pydantic's complaint about ``value`` as a ``hint`` (lax mode: "0.5" is a float), or None."""
    from pydantic import ConfigDict, TypeAdapter, ValidationError

    try:
        adapter = TypeAdapter(hint, config=ConfigDict(arbitrary_types_allowed=True))
    except Exception:  # a type pydantic cannot build a validator for: leave it to the plug-in
        return None
    try:
        adapter.validate_python(value)
    except ValidationError as err:
        return err.errors()[0]["msg"]
    return None


def _qualname(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
