"""Algorithms: pure tensor functions — advantages, policy losses, aggregation, KL estimators, filters, shaping."""

from vlrl.algos.advantages import (
    ADVANTAGES,
    AdvantageInputs,
    AdvantageOutput,
    advantage_needs,
    get_advantage,
    group_stats,
    group_variance,
    register_advantage,
)
from vlrl.algos.diversity import DiversityState, diversity_reward, select_descriptions, syn_diversity
from vlrl.algos.entropy_methods import (  # registers entropy_bonus, entropy_advantage, clip_cov, kl_cov
    clip_cov_selection,
    kl_cov_selection,
    token_covariance,
)
from vlrl.algos.filters import informative_groups, mask_truncated
from vlrl.algos.kl import KL_ESTIMATORS, kl_estimate, kl_reward_penalty
from vlrl.algos.losses import (
    AGGREGATIONS,
    POLICY_LOSSES,
    BoundLoss,
    LossOutput,
    PolicyLoss,
    PolicyLossInputs,
    aggregate,
    applies_behaviour_weight,
    bind_policy_loss,
    get_policy_loss,
    masked_mean,
    minibatch_selection,
    normaliser_for,
    policy_loss_needs,
    register_policy_loss,
    value_loss,
)
from vlrl.algos.rollout_correction import RolloutCorrection, rollout_correction
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
    "AdvantageInputs", "AdvantageOutput", "AdvantageShapingInputs", "BoundLoss", "DiversityState", "LossOutput",
    "PolicyLoss", "PolicyLossInputs", "bind_policy_loss",
    "RewardShapingInputs", "ShapingOutput", "advantage_needs", "aggregate", "applies_behaviour_weight",
    "diversity_reward", "get_advantage", "get_advantage_shaping", "get_policy_loss", "get_reward_shaping",
    "group_stats", "group_variance", "informative_groups", "kl_estimate", "kl_reward_penalty", "mask_truncated",
    "masked_mean", "normaliser_for", "register_advantage", "register_advantage_shaping", "register_policy_loss",
    "register_reward_shaping", "select_descriptions", "syn_diversity", "value_loss",
    "RolloutCorrection", "clip_cov_selection", "kl_cov_selection", "minibatch_selection", "policy_loss_needs", "rollout_correction",
    "token_covariance",
]
