"""Advantage estimators: one registry, one signature.

Every estimator is ``fn(inputs: AdvantageInputs, **options) -> AdvantageOutput``. Options are keyword-only
and bound by the recipe from ``algo.advantage_options``. Outcome estimators read the sequence reward as
``token_rewards.sum(-1)`` (the outcome reward sits on the last response token; per-token shaping such as a
KL penalty adds to it) and broadcast the advantage to every response token through ``loss_mask``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlrl.registry import Registry


@dataclass
class AdvantageInputs:
    """What an estimator may use. Shapes: B sequences, T response tokens."""

    token_rewards: torch.Tensor  # (B, T) reward per response token
    loss_mask: torch.Tensor  # (B, T) 1 = the model's token
    group_index: torch.Tensor  # (B,) prompt id; the n samples of one prompt share it
    values: torch.Tensor | None = None  # (B, T) critic values (PPO/GAE)
    baseline_rewards: torch.Tensor | None = None  # (B,) e.g. the greedy rollout's reward (ReMax)


@dataclass
class AdvantageOutput:
    advantages: torch.Tensor  # (B, T), zero where loss_mask is 0
    returns: torch.Tensor  # (B, T) regression targets of a critic (= advantages for critic-free estimators)


ADVANTAGES: Registry = Registry("advantage", signature="fn(inputs: AdvantageInputs, **options) -> AdvantageOutput")


def register_advantage(name: str):
    return ADVANTAGES.register(name)


def get_advantage(name: str):
    """Look up an estimator by name (``grpo``) or dotted path ``pkg.mod:fn``."""
    return ADVANTAGES.get(name)


def group_stats(scores: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-element group mean, unbiased group std (0 for singleton groups) and group size, each (B,)."""
    _, inverse, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=scores.dtype).index_add_(0, inverse, scores)
    mean = (sums / counts)[inverse]
    sq = torch.zeros(len(counts), dtype=scores.dtype).index_add_(0, inverse, (scores - mean) ** 2)
    dof = (counts - 1).clamp(min=1).to(scores.dtype)
    std = torch.where(counts > 1, (sq / dof).sqrt(), torch.zeros_like(sq))[inverse]
    return mean, std, counts[inverse]


@register_advantage("grpo")
def grpo(inputs: AdvantageInputs, *, eps: float = 1e-6, norm_by_std: bool = True) -> AdvantageOutput:
    """GRPO group-normalised advantage (DeepSeekMath; LLaVA-OV-1.5 RL seed, "Advantage").

        Â_i = (r_i − mean(r_group)) / (std(r_group) + ε)      broadcast to every response token of i

    ``std`` is the unbiased group standard deviation (the seed's worked example: rewards
    1, 1, 1, .5, 0 → mean 0.70, std 0.45 → Â = +0.67 for a correct answer). With ``norm_by_std=False``
    only the mean is subtracted (Dr.GRPO's fix for the difficulty bias). A group whose rewards are all
    equal gets Â = 0: no learning signal, as intended.
    """
    scores = inputs.token_rewards.sum(-1)  # (B,)
    mean, std, _ = group_stats(scores, inputs.group_index)
    advantage = scores - mean
    if norm_by_std:
        advantage = advantage / (std + eps)
    advantages = advantage.unsqueeze(-1) * inputs.loss_mask  # (B, T)
    return AdvantageOutput(advantages=advantages, returns=advantages)
