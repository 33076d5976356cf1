"""KL estimators between the policy and a frozen reference, per token (Schulman, "Approximating KL").

With δ = log π_ref − log π_θ (per token, on samples from π_θ):
- k1 = −δ                      unbiased, high variance, can be negative
- k2 = ½ δ²                    biased, low variance
- k3 = exp(δ) − δ − 1          unbiased, low variance, always ≥ 0 (GRPO's choice)
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL(π_θ ‖ π_ref) estimate, (B, T)."""
    delta = (ref_logp - logp).clamp(-20.0, 20.0)
    if kind == "k1":
        return -delta
    if kind == "k2":
        return 0.5 * delta**2
    if kind == "k3":
        return torch.exp(delta) - delta - 1.0
    raise ValueError(f"unknown KL estimator {kind!r}; choose from {KL_ESTIMATORS}")


def kl_reward_penalty(token_rewards: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor, loss_mask: torch.Tensor,
                      *, coef: float, kind: str = "k1") -> tuple[torch.Tensor, torch.Tensor]:
    """KL to the reference as a per-token reward penalty (InstructGPT; verl ``use_kl_in_reward``):

        r_t ← r_t − β · KL_t(π_old ‖ π_ref)          on model tokens (mask 1); β = ``coef``

    ``logp`` is the sampling-time policy π_old (no gradient flows: the penalty is part of the reward, and
    so of the advantage). Returns ``(shaped token rewards, per-token KL)``, each (B, T).
    """
    kl = kl_estimate(logp.detach(), ref_logp.detach(), kind) * loss_mask.to(logp.dtype)  # (B, T)
    return token_rewards - coef * kl, kl
