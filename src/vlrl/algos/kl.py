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
