"""``none``: the verifier of data that has none — every response scores 0 and reports no accuracy. A run that
learns from something else than a verifier names it (``data.reward: none``): on-policy distillation alone
(``algo.distill`` with ``reward_weight: 0``), whose signal is the teacher's log-probs."""

from __future__ import annotations

from typing import Any

from vlrl.rewards.base import register_reward


@register_reward("none", low=0.0, high=0.0)
def no_verifier(response: str, answer: Any = None, **meta: Any) -> float:
    """0 for every response (no answer is checked; nothing counts as accuracy)."""
    return 0.0
