"""Rewards: pure verifier functions in one registry, and their composition.

Call a verifier as ``get_reward(name)(response, answer, **meta)``; see the README for the registered names.
"""

from vlrl.rewards import basic  # noqa: F401  (registers the built-in verifiers)
from vlrl.rewards.base import (
    REWARDS,
    RewardOutput,
    ScoreReport,
    compose,
    get_reward,
    register_reward,
    score_trajectories,
)
from vlrl.rewards.extract import extract_answer

__all__ = [
    "REWARDS", "RewardOutput", "ScoreReport", "compose", "extract_answer", "get_reward", "register_reward",
    "score_trajectories",
]
