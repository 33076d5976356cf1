"""Reward shaping and advantage shaping: two registries of functions the recipe applies in config order.

One RL step, between scoring and the update (both recipes, `vlrl.train.batch.prepare_batch`):

    rewards r (B,)  ──► reward shaping, in order  ──► r′ (B,) on the last model token  ──► estimator  ──►
    advantages Â (B, T)  ──► advantage shaping, in order  ──► Â′ (B, T)  ──► policy loss

- A **reward shaper** is ``fn(inputs: RewardShapingInputs, **options) -> ShapingOutput`` whose ``values`` are
  the new scalar rewards (B,): rescaling (LLaVA-OV-1.5 r′ = (r − 0.5) × 10), DAPO's soft overlong punishment,
  a per-group diversity reward (Syn-GRPO), ...
- An **advantage shaper** is ``fn(inputs: AdvantageShapingInputs, **options) -> ShapingOutput`` whose
  ``values`` are the new token advantages (B, T), zero where ``loss_mask`` is 0: step-level credit of an
  embodied plan, ...

Both are selected by config (``algo.reward_shaping: [{name: reward_scale, options: {scale: 10, bias: -0.5}}]``),
by registered name or dotted path ``pkg.mod:fn``; options are keyword-only. A shaper that keeps state across
steps (e.g. an exponential moving average) receives what it returned as ``state`` at the previous step
(``None`` at the first) and returns the new state: the state is explicit data that the recipe holds (and a
checkpoint can save), never a global. ``context`` is an opaque object from the training loop (the policy, the
reference model, the sampling temperature, the step) for shapers that must score responses with a model; the
pure ones ignore it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vlrl.registry import Registry


@dataclass
class RewardShapingInputs:
    """What a reward shaper may use. B responses; the n responses of one prompt share a ``group_index``."""

    rewards: torch.Tensor  # (B,) scalar reward of each response (after the shapers before this one)
    group_index: torch.Tensor  # (B,) prompt id within the batch
    response_length: torch.Tensor  # (B,) model tokens of each response
    truncated: torch.Tensor  # (B,) bool: the response hit the token budget
    max_new_tokens: int  # the rollout's response budget (L_max of DAPO's overlong punishment by default)
    trajectories: Sequence[Any] = ()  # the rollout records (text, reward_parts, ...), read-only
    step: int = 0  # RL step (0-based) of this batch
    state: Any = None  # what this shaper returned as ``state`` at the previous step; None at the first
    context: Any = None  # the training loop's `StepContext` (policy, reference, temperature); may be None


@dataclass
class AdvantageShapingInputs:
    """What an advantage shaper may use. Shapes: B sequences, T response tokens."""

    advantages: torch.Tensor  # (B, T) the estimator's (or the previous shaper's) advantages
    loss_mask: torch.Tensor  # (B, T) 1 = the model's token
    group_index: torch.Tensor  # (B,)
    rewards: torch.Tensor  # (B,) shaped scalar rewards the estimator saw
    token_rewards: torch.Tensor  # (B, T) per-token rewards the estimator saw
    trajectories: Sequence[Any] = ()
    step: int = 0
    state: Any = None
    context: Any = None


@dataclass
class ShapingOutput:
    values: torch.Tensor  # (B,) new rewards, or (B, T) new advantages
    metrics: dict[str, float] = field(default_factory=dict)  # logged as ``shaping/<name>/<key>``
    state: Any = None  # handed back as ``inputs.state`` at the next step


REWARD_SHAPING: Registry = Registry(
    "reward shaping", signature="fn(inputs: RewardShapingInputs, **options) -> ShapingOutput  (values: (B,) rewards)"
)
ADVANTAGE_SHAPING: Registry = Registry(
    "advantage shaping",
    signature="fn(inputs: AdvantageShapingInputs, **options) -> ShapingOutput  (values: (B, T) advantages)",
)


def register_reward_shaping(name: str):
    return REWARD_SHAPING.register(name)


def register_advantage_shaping(name: str):
    return ADVANTAGE_SHAPING.register(name)


def get_reward_shaping(name: str):
    """Look up a reward shaper by name (``reward_scale``) or dotted path ``pkg.mod:fn``."""
    return REWARD_SHAPING.get(name)


def get_advantage_shaping(name: str):
    """Look up an advantage shaper by name or dotted path ``pkg.mod:fn``."""
    return ADVANTAGE_SHAPING.get(name)


@register_reward_shaping("reward_scale")
def reward_scale(inputs: RewardShapingInputs, *, scale: float = 10.0, bias: float = -0.5) -> ShapingOutput:
    """Affine reward rescaling of the LLaVA-OV-1.5 RL seed (AReaL's ``reward_scaling`` / ``reward_bias``):

        r′ = (r + bias) × scale          seed: Scale = 10.0, Bias = −0.5  →  r′ = (r − 0.5) × 10

    A 0/1 accuracy reward becomes ±5. Group-normalised advantages (grpo) are invariant to it; estimators
    without a std normalisation (dr_grpo, rloo, remax, gae) and a KL-in-reward penalty are not.
    """
    return ShapingOutput(values=(inputs.rewards + bias) * scale)
