"""Algorithms: pure tensor functions — advantages, policy losses, aggregation, KL estimators, shaping."""

from vlrl.algos.advantages import (
    ADVANTAGES,
    AdvantageInputs,
    AdvantageOutput,
    get_advantage,
    register_advantage,
)
from vlrl.algos.kl import KL_ESTIMATORS, kl_estimate
from vlrl.algos.losses import (
    AGGREGATIONS,
    POLICY_LOSSES,
    LossOutput,
    PolicyLossInputs,
    aggregate,
    get_policy_loss,
    masked_mean,
    normaliser_for,
    register_policy_loss,
)
from vlrl.algos.shaping import (
    ADVANTAGE_SHAPING,
    REWARD_SHAPING,
    AdvantageShapingInputs,
    RewardShapingInputs,
    ShapingOutput,
    get_advantage_shaping,
    get_reward_shaping,
    register_advantage_shaping,
    register_reward_shaping,
)

__all__ = [
    "ADVANTAGES", "ADVANTAGE_SHAPING", "AGGREGATIONS", "KL_ESTIMATORS", "POLICY_LOSSES", "REWARD_SHAPING",
    "AdvantageInputs", "AdvantageOutput", "AdvantageShapingInputs", "LossOutput", "PolicyLossInputs",
    "RewardShapingInputs", "ShapingOutput", "aggregate", "get_advantage", "get_advantage_shaping", "get_policy_loss",
    "get_reward_shaping", "kl_estimate", "masked_mean", "normaliser_for", "register_advantage",
    "register_advantage_shaping", "register_policy_loss", "register_reward_shaping",
]
