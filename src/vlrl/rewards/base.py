"""The reward registry, the `RewardOutput` record, and composition of several verifiers.

A verifier is a pure function ``f(response: str, answer, **meta) -> float | RewardOutput``: ``response``
is the model's text, ``answer`` the sample's ground truth, ``meta`` the sample's metadata. A verifier that
checks correctness reports an ``accuracy`` part (1.0 correct / 0.0 wrong), which evaluation uses; one that
scores something else (e.g. format) does not.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vlrl.registry import Registry

log = logging.getLogger(__name__)

RewardFn = Callable[..., "float | RewardOutput"]
REWARDS: Registry[RewardFn] = Registry("reward", signature="f(response: str, answer, **meta) -> float | RewardOutput")


def register_reward(name: str):
    """Decorator: register a verifier under ``name`` (``@register_reward("bbox_iou")``)."""
    return REWARDS.register(name)


def get_reward(name: str) -> RewardFn:
    """Look up a verifier by registered name or dotted path ``pkg.mod:fn``."""
    return REWARDS.get(name)


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


def compose(response: str, answer: Any, reward: str | Mapping[str, float], meta: Mapping[str, Any]) -> RewardOutput:
    """Score ``response`` with one verifier or a weighted sum of several.

    overall = Σ_i w_i · overall_i. Parts: each verifier's ``overall`` under its name, its own parts under
    ``name/part``, and ``accuracy`` = the weight-normalised mean of the accuracies that verifiers report.
    """
    weights = {reward: 1.0} if isinstance(reward, str) else dict(reward)
    overall, parts, acc_sum, acc_weight = 0.0, {}, 0.0, 0.0
    for name, weight in weights.items():
        out = as_output(get_reward(name)(response, answer, **meta))
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


@dataclass
class ScoreReport:
    """Outcome of scoring a batch: failures are counted and kept, never silently zeroed."""

    failures: list[tuple[str, str]] = field(default_factory=list)  # (sample id, error)


def score_trajectories(trajectories: list, *, fallback: float = 0.0) -> ScoreReport:
    """Fill ``reward`` and ``reward_parts`` of each trajectory; a verifier that raises gets ``fallback``,
    and the failure is recorded in the returned report (and logged)."""
    report = ScoreReport()
    for trajectory in trajectories:
        sample = trajectory.sample
        try:
            out = compose(trajectory.response_text, sample.answer, sample.reward, sample.metadata)
        except Exception as err:  # a verifier bug must not kill the run, nor vanish
            report.failures.append((sample.id, f"{type(err).__name__}: {err}"))
            out = RewardOutput(overall=fallback, parts={"reward_failed": 1.0})
        trajectory.reward = out.overall
        trajectory.reward_parts = out.parts
    if report.failures:
        log.warning("%d reward failure(s); first: %s: %s", len(report.failures), *report.failures[0])
    return report
