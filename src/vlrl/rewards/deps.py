"""Optional dependencies of verifiers: which verifier needs which module, and the command that installs it.

A verifier whose modules are not in vlrl's core dependencies declares them with `requires` (``math`` needs
math-verify, latex2sympy2 and SymPy; ``svg`` needs CairoSVG and scikit-image — all in the ``rewards``
extra). `missing_dependency` answers, for a reward name, whether it can run here, without running it: what
``vlrl check`` asks for every reward a run names. `ensure_dependencies` is what the verifier itself calls
first, so a missing module fails with the install command instead of a bare ``ModuleNotFoundError``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

_FOUND: set[str] = set()  # modules seen importable (a module does not disappear while we run)


class MissingDependencyError(ImportError):
    """A verifier's optional dependency is not installed; the message names the install command."""


def requires(*modules: str, extra: str = "rewards") -> Callable[[Any], Any]:
    """Decorator: the verifier needs the top-level modules ``modules``, installed by ``pip install 'vlrl[extra]'``.

    Put it under ``@register_reward`` (it only annotates the function: ``fn.reward_requires``)."""

    def decorator(fn: Any) -> Any:
        fn.reward_requires = (tuple(modules), extra)
        return fn

    return decorator


def _missing(fn: Any, name: str) -> str | None:
    modules, extra = getattr(fn, "reward_requires", ((), ""))
    absent = []
    for module in modules:
        if module in _FOUND:
            continue
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if found:
            _FOUND.add(module)
        else:
            absent.append(module)
    if not absent:
        return None
    return (f"the '{name}' verifier needs {', '.join(absent)}, which {'is' if len(absent) == 1 else 'are'} not "
            f"installed: pip install 'vlrl[{extra}]'")


def missing_dependency(reward_name: str) -> str | None:
    """None if the verifier ``reward_name`` (a registered name or ``pkg.mod:fn``) has every optional module it
    declares, else one line naming the missing modules and the install command (``pip install 'vlrl[rewards]'``).
    An unknown name raises the registry's error."""
    from vlrl.rewards.base import get_reward

    return _missing(get_reward(reward_name), reward_name)


def ensure_dependencies(fn: Any, name: str) -> None:
    """Raise `MissingDependencyError` (naming the install command) if ``fn`` lacks a module it declares."""
    message = _missing(fn, name)
    if message is not None:
        raise MissingDependencyError(message)
