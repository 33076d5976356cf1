"""Environments for multi-turn rollouts, by name: `ENVIRONMENTS`, `register_env`, `get_env`.

A built-in environment is one module of this package that registers its class (``@register_env("name")``):
``shapes_feedback``, ``tool_zoom``, ``judge``. The registry finds them at its first lookup (`vlrl.registry.Registry`'s
``discover``), so this package imports none of them; the protocol and typed loading are `vlrl.rollout.env`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vlrl.registry import Registry

ENVIRONMENTS: Registry[Callable[..., Any]] = Registry(
    "environment", signature="cls(**typed_kwargs) -> Environment (reset, step, format_observation)", discover=__name__
)


def register_env(name: str):
    """Decorator: register an environment class under ``name``."""
    return ENVIRONMENTS.register(name)


def get_env(name: str) -> Callable[..., Any]:
    """An environment class by registered name or dotted path ``pkg.mod:Class``."""
    return ENVIRONMENTS.get(name)
