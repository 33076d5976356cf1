"""Sampling filters of DAPO (pure tensor functions; the recipe does the sampling):

- dynamic sampling (DAPO §3.2.2, eq. 11): keep only groups whose rewards are not all equal,
  0 < |{o_i correct}| < G — a group that is all right or all wrong has zero advantage and no gradient;
- overlong filtering (DAPO §3.2.4): truncated responses get no loss (their reward is noise: a sound
  reasoning cut off by the budget).

The soft overlong punishment (DAPO eq. 13) is a reward shaper: ``overlong_penalty`` in `vlrl.algos.shaping`.
"""

from __future__ import annotations

import torch


def informative_groups(scores: torch.Tensor, group_index: torch.Tensor, *, atol: float = 0.0) -> torch.Tensor:
    """(B,) bool: True for the members of groups whose ``scores`` are not all equal (max − min > ``atol``).

    DAPO eq. 11's constraint 0 < |{o_i | is_equivalent(a, o_i)}| < G, for any reward: a group with one
    distinct value has zero group-relative advantage.
    """
    _, inverse = torch.unique(group_index, return_inverse=True)
    G = int(inverse.max()) + 1 if len(inverse) else 0
    high = torch.full((G,), -torch.inf, dtype=scores.dtype).scatter_reduce(0, inverse, scores, "amax")
    low = torch.full((G,), torch.inf, dtype=scores.dtype).scatter_reduce(0, inverse, scores, "amin")
    return (high - low)[inverse] > atol


def mask_truncated(loss_mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """Overlong filtering (DAPO §3.2.4): the loss mask (B, T) with the rows of truncated responses zeroed.
    The responses still count in their group's reward statistics; they only contribute no gradient."""
    return loss_mask * (~truncated.bool()).unsqueeze(-1).to(loss_mask.dtype)
