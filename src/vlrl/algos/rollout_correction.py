"""Rollout–trainer mismatch correction — pure tensor functions (Yao et al. 2025, "Your Efficient RL Framework
Secretly Brings You Off-Policy RL Training"; verl's rollout correction, Liu, Li et al. 2025 "When Speed Kills
Stability").

When the sampler is not the trainer's own forward pass (an HTTP server such as SGLang or `vlrl serve`, the
threaded engine, a bfloat16 sampler beside a float32 trainer), the tokens come from π_sampler while the loss
treats them as samples of the trainer's π_old. The per-token ratio

    ρ_t = π_old(y_t) / π_sampler(y_t) = exp(log π_old − log π_sampler)          π_old: the trainer's recomputation

corrects for it, in one of three ways (B sequences, T response tokens, valid tokens = ``loss_mask``):

- **TIS** (truncated IS, Yao et al.): weight each token's loss by w_t = min(ρ_t, C), no gradient — or, at
  ``level="sequence"``, every token of response i by min(Π_t ρ_t, C);
- **MIS** (masked IS): drop the tokens (``level="token"``) or whole responses whose ratio leaves [1/C, C] —
  ``sequence``: ρ_i = Π_t ρ_t; ``geometric``: ρ_i = (Π_t ρ_t)^{1/|y_i|}, length-invariant (verl's Geo-RS) —
  from the loss *and* from the normaliser (a rejected token is not a sample; verl's rejection sampling);
- both: the mask, then the truncated weights on the tokens kept. Token-level MIS and TIS with the same C
  give Yao et al.'s MIS estimator ρ_t · 𝟙[1/C ≤ ρ_t ≤ C] (on a kept token min(ρ_t, C) = ρ_t).

**How ρ relates to the decoupled loss's behaviour weight.** The decoupled loss (and the async recipe's
behaviour weight) uses w_t = π_prox / π_behave, where π_prox is the trainer's policy at the start of the step
and π_behave the log-probs *recorded by the sampler* — so w already is this ratio: it corrects staleness
(sampler weights of version w vs trainer version v) and numerical mismatch (sampler vs trainer kernels) in one
factor; ``behaviour_weight_mode: clamp`` is token-level TIS with C = ``cap``, ``drop`` is upper-only token MIS.
In a synchronous step π_prox = π_old and ρ_t = w_t exactly. Hence:

| combination                                                          | verdict                                    |
| -------------------------------------------------------------------- | ------------------------------------------ |
| TIS with a non-decoupled loss, synchronous recipe                    | correct: the one correction                |
| MIS (any level) with or without the behaviour weight                 | correct: a filter, no second weight        |
| TIS together with the behaviour weight (``decoupled`` or async)      | **double-counts** (w_t · min(ρ_t, C) ≈ ρ²) |
| TIS with ``gspo`` / ``gmpo`` / ``gspo_token``                        | allowed; a token weight on a per-sequence loss gives L_i · mean_t w_t under ``seq_mean_token_mean`` |

The recipe refuses the double-counting row. The ratio must be taken against π_old recomputed by the trainer
*before* the update (not against the update's own forward pass, which moves within the step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

MISMATCH_LEVELS = ("token", "sequence", "geometric")
TIS_LEVELS = ("token", "sequence")


@dataclass
class RolloutCorrection:
    """The correction of one batch. Shapes: B sequences, T response tokens."""

    weights: torch.Tensor  # (B, T) multiply each token's loss; 1 without TIS, 0 outside loss_mask; no grad
    loss_mask: torch.Tensor  # (B, T) the loss mask with the MIS-rejected tokens zeroed (aggregate and normalise with it)
    log_ratio: torch.Tensor  # (B, T) log ρ_t = log π_old − log π_sampler, 0 outside loss_mask
    metrics: dict[str, float] = field(default_factory=dict)  # rollout_is_mean / _clipped_frac / _masked_frac


def rollout_log_ratio(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """log ρ_t = log π_old(y_t) − log π_sampler(y_t), clamped to [−20, 20], 0 outside ``loss_mask``; (B, T), no grad."""
    log_ratio = (trainer_logp.detach() - sampler_logp.detach()).clamp(-20.0, 20.0)
    return log_ratio * loss_mask.to(log_ratio.dtype)


def _sequence_log_ratio(log_ratio: torch.Tensor, loss_mask: torch.Tensor, level: str) -> torch.Tensor:
    """log of the sequence ratio Π_t ρ_t (``sequence``) or its geometric mean (``geometric``), (B,)."""
    total = log_ratio.sum(-1)  # masked entries are 0
    if level == "geometric":
        return total / loss_mask.sum(-1).clamp(min=1)
    return total


def truncated_is_weights(log_ratio: torch.Tensor, loss_mask: torch.Tensor, *, cap: float = 2.0,
                         level: str = "token") -> torch.Tensor:
    """TIS weights, (B, T), 0 outside ``loss_mask``:

        token:     w_t = min(ρ_t, C)
        sequence:  w_t = min(Π_{t′ ∈ y_i} ρ_t′, C) on every token of response i

    Yao et al. truncate at C = 2 (the default); verl's ``rollout_is_threshold`` is 2.0 as well."""
    if cap <= 1:
        raise ValueError(f"rollout correction: the TIS cap C must be > 1, got {cap}")
    if level not in TIS_LEVELS:
        raise ValueError(f"rollout correction: unknown TIS level {level!r}; choose from {TIS_LEVELS}")
    if level == "sequence":
        log_ratio = _sequence_log_ratio(log_ratio, loss_mask, level).clamp(-20.0, 20.0).unsqueeze(-1).expand_as(log_ratio)
    weights = torch.exp(log_ratio.clamp(max=math.log(cap)))
    return weights * loss_mask.to(weights.dtype)


def mismatch_mask(log_ratio: torch.Tensor, loss_mask: torch.Tensor, *, cap: float = 2.0,
                  level: str = "token") -> torch.Tensor:
    """MIS: (B, T) bool, True for the valid tokens whose ratio lies in [1/C, C] — ρ_t (``token``), Π_t ρ_t of its
    response (``sequence``), or (Π_t ρ_t)^{1/|y_i|} (``geometric``); a rejected response loses all its tokens."""
    if cap <= 1:
        raise ValueError(f"rollout correction: the MIS bound C must be > 1, got {cap}")
    if level not in MISMATCH_LEVELS:
        raise ValueError(f"rollout correction: unknown MIS level {level!r}; choose from {MISMATCH_LEVELS}")
    bound = math.log(cap)
    if level == "token":
        inside = log_ratio.abs() <= bound  # (B, T)
    else:
        inside = (_sequence_log_ratio(log_ratio, loss_mask, level).abs() <= bound).unsqueeze(-1).expand_as(log_ratio)
    return inside & loss_mask.bool()


def rollout_correction(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, loss_mask: torch.Tensor, *,
                       tis_cap: float | None = 2.0, tis_level: str = "token", mis_cap: float | None = None,
                       mis_level: str = "token") -> RolloutCorrection:
    """Both corrections for one batch (each off when its cap is None): the MIS mask first, then the TIS weights.

    Metrics, over the valid tokens of ``loss_mask``:
    - ``rollout_is_mean``: mean weight of the tokens that still train (1 without TIS);
    - ``rollout_is_clipped_frac``: share of kept tokens whose TIS weight was truncated (ratio above C);
    - ``rollout_is_masked_frac``: share MIS removed.
    """
    log_ratio = rollout_log_ratio(trainer_logp, sampler_logp, loss_mask)  # (B, T)
    valid = loss_mask.bool()
    kept = mismatch_mask(log_ratio, loss_mask, cap=mis_cap, level=mis_level) if mis_cap is not None else valid
    if tis_cap is not None:
        weights = truncated_is_weights(log_ratio, loss_mask, cap=tis_cap, level=tis_level) * kept
        clipped = (_untruncated_ratio(log_ratio, loss_mask, tis_level) > tis_cap) & kept
    else:
        weights = kept.to(log_ratio.dtype)
        clipped = torch.zeros_like(valid)
    n_valid, n_kept = max(int(valid.sum()), 1), int(kept.sum())
    metrics = {
        "rollout_is_mean": float(weights[kept].sum()) / n_kept if n_kept else 0.0,
        "rollout_is_clipped_frac": float(clipped.sum()) / n_valid,
        "rollout_is_masked_frac": float((valid & ~kept).sum()) / n_valid,
    }
    return RolloutCorrection(weights=weights, loss_mask=loss_mask * kept.to(loss_mask.dtype), log_ratio=log_ratio,
                             metrics=metrics)


def _untruncated_ratio(log_ratio: torch.Tensor, loss_mask: torch.Tensor, level: str) -> torch.Tensor:
    """ρ_t (token) or Π_t ρ_t on each token of its response (sequence), (B, T)."""
    if level == "sequence":
        log_ratio = _sequence_log_ratio(log_ratio, loss_mask, level).unsqueeze(-1).expand_as(log_ratio)
    return torch.exp(log_ratio.clamp(max=20.0))
