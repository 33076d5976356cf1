"""The reward registry, the `RewardOutput` record, how a verifier runs (`RewardSpec`), and composition.

A verifier is a pure function ``f(response: str, answer, **meta) -> float | RewardOutput``: ``response``
is the model's text, ``answer`` the sample's ground truth, ``meta`` the sample's metadata. A verifier that
checks correctness reports an ``accuracy`` part (1.0 correct / 0.0 wrong), which evaluation uses; one that
scores something else (e.g. format) does not.

Each registered verifier also carries a `RewardSpec`: where the batch scorer runs it (``inline`` in the
caller's thread — only for verifiers whose cost is bounded by construction — or ``pool``, a worker
process with a hard per-item deadline), its deadline, and the range of its ``overall`` score.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from vlrl.registry import Registry

RewardFn = Callable[..., "float | RewardOutput"]
# the built-in verifiers are the modules of vlrl.rewards that register one (found at the first lookup)
REWARDS: Registry[RewardFn] = Registry("reward", signature="f(response: str, answer, **meta) -> float | RewardOutput",
                                       discover="vlrl.rewards")


@dataclass(frozen=True)
class RewardSpec:
    """How the batch scorer runs a verifier.

    Attributes:
        mode: ``inline`` — called in the scoring thread (cheap, bounded-time pure Python);
            ``pool`` — run in a worker process killed at ``deadline`` (untrusted or possibly slow work:
            SymPy, rendering, running code); ``judge`` — scored in one batched call to a judge engine.
        deadline: seconds one item may take. Enforced for ``pool``; for ``inline`` measured, and an
            item over it is counted as slow.
        low, high: the range of ``overall``.
    """

    mode: Literal["inline", "pool", "judge"] = "inline"
    deadline: float = 1.0
    low: float = 0.0
    high: float = 1.0


DEFAULT_SPEC = RewardSpec()  # a user's function without a spec runs inline (documented in the README)


def register_reward(name: str, *, mode: Literal["inline", "pool", "judge"] = "inline", deadline: float | None = None,
                    low: float = 0.0, high: float = 1.0):
    """Decorator: register a verifier under ``name`` (``@register_reward("bbox_iou")``) with its `RewardSpec`."""
    spec = RewardSpec(mode=mode, deadline=deadline if deadline is not None else (1.0 if mode == "inline" else 10.0),
                      low=low, high=high)

    def decorator(fn: RewardFn) -> RewardFn:
        fn.reward_spec = spec  # type: ignore[attr-defined]
        return REWARDS.register(name)(fn)

    return decorator


def get_reward(name: str) -> RewardFn:
    """Look up a verifier by registered name or dotted path ``pkg.mod:fn``."""
    return REWARDS.get(name)


def spec_of(name: str) -> RewardSpec:
    """The `RewardSpec` of a registered verifier or dotted path (`DEFAULT_SPEC` when it declares none)."""
    return getattr(get_reward(name), "reward_spec", DEFAULT_SPEC)


@dataclass
class RewardOutput:
    """A reward with named sub-scores. ``overall`` is what RL optimises; ``parts`` are logged."""

    overall: float
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def accuracy(self) -> float | None:
        return self.parts.get("accuracy")


def as_output(value: float | RewardOutput) -> RewardOutput:
    if isinstance(value, RewardOutput):
        return value
    return RewardOutput(overall=float(value))


def reward_weights(reward: str | Mapping[str, float]) -> dict[str, float]:
    """``"number"`` → ``{"number": 1.0}``; a mapping of names to weights is copied."""
    return {reward: 1.0} if isinstance(reward, str) else {k: float(v) for k, v in reward.items()}


def combine(weights: Mapping[str, float], outputs: Mapping[str, RewardOutput]) -> RewardOutput:
    """overall = Σ_i w_i · overall_i (e.g. 0.8 · accuracy + 0.2 · format, as in the embodied seed).

    Parts: with one verifier, its parts; with several, each verifier's ``overall`` under its name and its
    parts under ``name/part``. ``accuracy`` = the weight-normalised mean of the accuracies reported.
    """
    overall, parts, acc_sum, acc_weight = 0.0, {}, 0.0, 0.0
    for name, weight in weights.items():
        out = outputs[name]
        overall += weight * out.overall
        if len(weights) > 1:
            parts[name] = out.overall
            parts.update({f"{name}/{k}": v for k, v in out.parts.items()})
        else:
            parts.update(out.parts)
        if out.accuracy is not None:
            acc_sum += weight * out.accuracy
            acc_weight += weight
    if acc_weight > 0:
        parts["accuracy"] = acc_sum / acc_weight
    return RewardOutput(overall=overall, parts=parts)


def compose(response: str, answer: Any, reward: str | Mapping[str, float], meta: Mapping[str, Any]) -> RewardOutput:
    """Score ``response`` with one verifier or a weighted sum of several, in this thread (see `combine`).

    No deadline: use `RewardExecutor` / `score_trajectories` for untrusted verifiers.
    """
    weights = reward_weights(reward)
    outputs = {name: as_output(get_reward(name)(response, answer, **meta)) for name in weights}
    return combine(weights, outputs)
