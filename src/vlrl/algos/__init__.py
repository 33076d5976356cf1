"""Algorithms: pure tensor functions — advantages, policy losses, aggregation, KL estimators."""

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

__all__ = [
    "ADVANTAGES", "AGGREGATIONS", "AdvantageInputs", "AdvantageOutput", "KL_ESTIMATORS", "LossOutput", "POLICY_LOSSES",
    "PolicyLossInputs", "aggregate", "get_advantage", "get_policy_loss", "kl_estimate", "masked_mean",
    "normaliser_for", "register_advantage", "register_policy_loss",
]
