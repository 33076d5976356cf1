"""Rewards: pure verifier functions in one registry, their composition, and deadline-safe batch scoring.

A verifier is one module of this package that registers itself (``@register_reward("name")``); the registry finds
the modules at its first lookup (`vlrl.registry.Registry`'s ``discover``). Call a verifier as
``get_reward(name)(response, answer, **meta)``; score a batch with `score_trajectories`
(the RL loop) or `RewardExecutor` (anything else). See the README ("Rewards") for the registered names.

Modules: ``extract`` (answer extraction), ``answers`` (number, multiple_choice, bool, string_match, ocr),
``math_equiv`` (math), ``boxes`` (bbox_iou, ovd_map), ``markup`` (html, svg), ``code_exec`` + ``sandbox``
(code), ``format`` (format, answer_format, cot_format, overlong), ``plan`` (json_plan, plan_prefix),
``judge`` (critic), ``kitchen`` (the embodied kitchen's rules, for plan_success), ``syn`` (Syn-GRPO template:
syn_format), ``execution`` (the batch scorer), ``cli`` (``vlrl reward score``),
``deps`` (optional dependencies: `missing_dependency`).
"""

from vlrl.rewards.base import (
    REWARDS,
    RewardOutput,
    RewardSpec,
    combine,
    compose,
    get_reward,
    register_reward,
    spec_of,
)
from vlrl.rewards.deps import MissingDependencyError, missing_dependency
from vlrl.rewards.execution import RewardExecutor, RewardItem, ScoreReport, score_trajectories, summarize
from vlrl.rewards.extract import extract_answer, final_answer
from vlrl.rewards.judge import Judge

__all__ = [
    "REWARDS", "Judge", "MissingDependencyError", "RewardExecutor", "RewardItem", "RewardOutput", "RewardSpec", "ScoreReport",
    "combine", "compose", "extract_answer", "final_answer", "get_reward", "missing_dependency", "register_reward",
    "score_trajectories",
    "spec_of", "summarize",
]
