"""Staleness and off-policy correction for asynchronous RL — pure tensor functions.

Asynchronous training (AReaL; the LLaVA-OV-1.5 RL seed, "AReaL Async Training" and "Decoupled PPO") has
three policies: π_behave sampled the response with the weights of version ``w`` (the sample's
``weight_version``), π_prox is the trainer's policy at the start of the step (version ``v``, recomputed
by one teacher-forced pass), π_θ is the policy being updated. This module holds every piece of maths that
the version gap needs, so that the recipe only calls it:

- staleness            s = v − w: gradient steps between the weights that sampled and those that train
- the η filter         a sample with s > η is discarded before any loss sees it (``max_head_offpolicyness``,
                       η = 4 in the seed)
- behaviour IS weight  w_t = min(exp(log π_prox − log π_behave), cap)        (cap 5.0 in the seed)
                       the decoupled loss is  L_t = w_t · L_clip(π_θ / π_prox)
- metrics              staleness histogram, behaviour-weight mean/max/capped fraction, and the
                       train–inference drift |log π_behave − log π_θ| on samples with s = 0 (same weights:
                       any gap is numerical mismatch between the sampler and the trainer)

Shapes: B sequences, T response tokens. Versions are integer tensors (B,).
"""

from __future__ import annotations

import math

import torch


class StalenessError(RuntimeError):
    """A sample older than η (or from a version the trainer has not reached) was about to reach a loss."""


def staleness(weight_version: torch.Tensor, current_version: int) -> torch.Tensor:
    """s_i = v − w_i, (B,) long. A sample from a future version (s < 0) cannot exist: raise."""
    s = current_version - weight_version.long()  # (B,)
    if (s < 0).any():
        bad = int((s < 0).nonzero()[0])
        raise StalenessError(
            f"sample {bad} carries weight_version {int(weight_version[bad])} but the trainer is at version "
            f"{current_version}: versions are mis-tagged"
        )
    return s


def fresh_mask(weight_version: torch.Tensor, current_version: int, *, eta: int) -> torch.Tensor:
    """(B,) bool: True where s_i ≤ η (the sample may be trained on)."""
    return staleness(weight_version, current_version) <= eta


def assert_fresh(weight_version: torch.Tensor, current_version: int, *, eta: int) -> None:
    """Raise `StalenessError` naming the first sample with s > η; the last line of defence before a loss."""
    s = staleness(weight_version, current_version)
    if (s > eta).any():
        bad = int((s > eta).nonzero()[0])
        raise StalenessError(
            f"sample {bad} is {int(s[bad])} versions old (weight_version {int(weight_version[bad])}, trainer "
            f"version {current_version}) but η = {eta}: it must have been discarded"
        )


def behaviour_weights(
    proximal_logp: torch.Tensor, behaviour_logp: torch.Tensor, loss_mask: torch.Tensor, *, cap: float = 5.0
) -> torch.Tensor:
    """Behaviour importance weight of the decoupled PPO objective (AReaL; seed "BehavWeight"), (B, T):

        w_t = min(exp(log π_prox − log π_behave), cap)       0 where ``loss_mask`` is 0

    Computed as exp(min(Δ, log cap)) so a huge Δ never overflows. No gradient flows through w.
    """
    if cap <= 0:
        raise ValueError(f"behaviour weight cap must be > 0, got {cap}")
    delta = (proximal_logp - behaviour_logp).detach()  # (B, T)
    weights = torch.exp(delta.clamp(max=math.log(cap)))
    return weights * loss_mask.to(weights.dtype)


def behaviour_weight_stats(weights: torch.Tensor, loss_mask: torch.Tensor, *, cap: float) -> dict[str, torch.Tensor]:
    """Scalars over the masked tokens: ``mean``, ``max`` and ``capped_frac`` (share of tokens at the cap)."""
    mask = loss_mask.bool()
    if not mask.any():
        zero = torch.tensor(0.0)
        return {"mean": zero, "max": zero, "capped_frac": zero}
    values = weights[mask]
    return {
        "mean": values.mean(),
        "max": values.max(),
        "capped_frac": (values >= cap * (1 - 1e-6)).float().mean(),
    }


def staleness_histogram(s: torch.Tensor, *, eta: int) -> torch.Tensor:
    """Counts of s = 0, 1, …, η and a last bin for s > η, (η + 2,) long."""
    return torch.bincount(s.long().clamp(min=0, max=eta + 1), minlength=eta + 2)


def logp_drift(
    behaviour_logp: torch.Tensor, logp: torch.Tensor, loss_mask: torch.Tensor, same_version: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Train–inference drift on the tokens sampled by the trainer's weights (s = 0): ``same_version`` (B,) per
    sample, or (B, T) per token (a response continued across a weight update holds tokens of several versions):

        drift = mean over their masked tokens of |log π_behave − log π_θ|

    Returns ``(drift, n_tokens)``; drift is 0 when no token qualifies (check ``n_tokens``).
    """
    mask = loss_mask.bool() & _per_token(same_version)  # (B, T)
    n = mask.sum()
    gap = (behaviour_logp.detach() - logp.detach()).abs()
    drift = (gap * mask).sum() / n.clamp(min=1)
    return drift, n


def logp_drift_max(
    behaviour_logp: torch.Tensor, logp: torch.Tensor, loss_mask: torch.Tensor, same_version: torch.Tensor
) -> torch.Tensor:
    """The largest train–inference gap over the same tokens as `logp_drift` (masked, sampled by the trainer's weights):

        max |log π_behave − log π_θ|

    — the number verl users watch to catch a broken inference engine (a wrong weight load shows here first, while the
    mean may stay small). 0 when no token qualifies."""
    mask = loss_mask.bool() & _per_token(same_version)  # (B, T)
    gap = (behaviour_logp.detach() - logp.detach()).abs()
    return torch.where(mask, gap, torch.zeros_like(gap)).amax() if mask.any() else gap.new_zeros(())


def _per_token(same_version: torch.Tensor) -> torch.Tensor:
    """``same_version`` (B,) → (B, 1), broadcast over the tokens; (B, T) as it is."""
    same = same_version.bool()
    return same.unsqueeze(-1) if same.dim() == 1 else same
