"""Policy losses (one registry, one signature) and the aggregation of per-token losses.

A policy loss is ``fn(inputs: PolicyLossInputs, **options) -> LossOutput``: per-token losses (B, T) and
per-token metric indicators (B, T) that the recipe averages over ``loss_mask``. Aggregation into a scalar
is a separate function, `aggregate`, with an explicit normaliser so that gradient accumulation and data
parallelism reproduce the gradient of one big batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from vlrl.registry import Registry


@dataclass
class PolicyLossInputs:
    """Shapes: B sequences, T response tokens."""

    logp: torch.Tensor  # (B, T) log π_θ, with grad
    old_logp: torch.Tensor  # (B, T) log π_old (the proximal policy in decoupled PPO), no grad
    advantages: torch.Tensor  # (B, T)
    loss_mask: torch.Tensor  # (B, T)
    behaviour_logp: torch.Tensor | None = None  # (B, T) log π_behave recorded at sampling


@dataclass
class LossOutput:
    per_token_loss: torch.Tensor  # (B, T)
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> (B, T) values, masked-mean'd


POLICY_LOSSES: Registry = Registry("policy loss", signature="fn(inputs: PolicyLossInputs, **options) -> LossOutput")


def register_policy_loss(name: str):
    return POLICY_LOSSES.register(name)


def get_policy_loss(name: str):
    """Look up a policy loss by name (``ppo_clip``) or dotted path ``pkg.mod:fn``."""
    return POLICY_LOSSES.get(name)


@register_policy_loss("ppo_clip")
def ppo_clip(inputs: PolicyLossInputs, *, clip_low: float = 0.2, clip_high: float = 0.2) -> LossOutput:
    """PPO clipped surrogate with asymmetric clip (DAPO "clip-higher", eq. 10; LLaVA-OV-1.5 ε=0.2, ε′=0.28).

        r_t = exp(log π_θ − log π_old)
        L_t = max(−A_t · r_t, −A_t · clip(r_t, 1 − ε_low, 1 + ε_high))

    Metrics: ``clip_low`` / ``clip_high`` mark tokens whose gradient the clip removed (A < 0 with
    r < 1 − ε_low, A > 0 with r > 1 + ε_high); ``ratio`` is r_t.
    """
    log_ratio = (inputs.logp - inputs.old_logp).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)  # (B, T)
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    A = inputs.advantages
    loss = torch.maximum(-A * ratio, -A * clipped)  # (B, T)
    with torch.no_grad():
        metrics = {
            "clip_low": ((A < 0) & (ratio < 1.0 - clip_low)).float(),
            "clip_high": ((A > 0) & (ratio > 1.0 + clip_high)).float(),
            "ratio": ratio.detach(),
        }
    return LossOutput(per_token_loss=loss, metrics=metrics)


@register_policy_loss("dual_clip")
def dual_clip(inputs: PolicyLossInputs, *, clip_low: float = 0.2, clip_high: float = 0.2,
              clip_ratio_c: float = 3.0) -> LossOutput:
    """Dual-clip PPO (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL"; verl
    ``clip_ratio_c``): PPO clip plus a lower bound on the objective of negative-advantage tokens,

        L_t = max(−A_t · r_t, −A_t · clip(r_t, 1 − ε_low, 1 + ε_high))          (ppo_clip)
        L_t ← min(L_t, −A_t · c)   where A_t < 0                                  c > 1 (3.0)

    so a token the policy already made far more likely (r ≫ 1) with A < 0 cannot produce an unbounded
    loss; such tokens get no gradient. Metric ``clip_dual``: tokens where the second clip was active.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"dual_clip: clip_ratio_c must be > 1, got {clip_ratio_c}")
    out = ppo_clip(inputs, clip_low=clip_low, clip_high=clip_high)
    A = inputs.advantages
    bound = -A * clip_ratio_c  # (B, T)
    dual = (A < 0) & (out.per_token_loss > bound)
    loss = torch.where(dual, bound, out.per_token_loss)
    out.metrics["clip_dual"] = dual.float()
    return LossOutput(per_token_loss=loss, metrics=out.metrics)


@register_policy_loss("decoupled")
def decoupled(inputs: PolicyLossInputs, *, clip_low: float = 0.2, clip_high: float = 0.2, cap: float = 5.0) -> LossOutput:
    """Decoupled PPO of AReaL (LLaVA-OV-1.5 RL seed, "GRPO Algorithm & AReaL Async Framework"):

        r_t = exp(log π_θ − log π_prox)                                  ratio against the proximal policy
        w_t = clip(exp(log π_prox − log π_behave), 0, cap)              behaviour weight, no gradient (cap 5.0)
        L_t = w_t · max(−A_t · r_t, −A_t · clip(r_t, 1 − ε_low, 1 + ε_high))

    ``old_logp`` is π_prox (the weights at the start of the step) and ``behaviour_logp`` π_behave (the
    weights that sampled). This loss applies w itself (``applies_behaviour_weight``), so the update does not
    apply it a second time. Metric ``behaviour_weight_capped``: tokens whose weight hit the cap.
    """
    if inputs.behaviour_logp is None:
        raise ValueError("decoupled: needs behaviour_logp (the log-probs recorded at sampling)")
    if cap <= 0:
        raise ValueError(f"decoupled: cap must be > 0, got {cap}")
    out = ppo_clip(inputs, clip_low=clip_low, clip_high=clip_high)
    delta = (inputs.old_logp - inputs.behaviour_logp).detach()  # (B, T) log π_prox − log π_behave
    w = torch.exp(delta.clamp(max=math.log(cap)))
    out.metrics["behaviour_weight_capped"] = (delta >= math.log(cap)).float()
    return LossOutput(per_token_loss=w * out.per_token_loss, metrics=out.metrics)


decoupled.applies_behaviour_weight = True


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, *, clip: float = 0.2) -> LossOutput:
    """Clipped value loss of PPO (the critic of ``gae``; verl ``compute_value_loss``, OpenAI baselines):

        V_clip = V_old + clip(V − V_old, −ε_v, ε_v)
        L_t = ½ · max((V − R_t)², (V_clip − R_t)²)

    ``old_values`` are the critic's values when the batch was prepared, ``returns`` R the GAE targets.
    Metric ``value_clip``: tokens where the clipped error was the larger one (no gradient through V there
    beyond the clip). Aggregate it with `aggregate` like a policy loss.
    """
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    unclipped_error = (values - returns) ** 2
    clipped_error = (clipped - returns) ** 2
    loss = 0.5 * torch.maximum(unclipped_error, clipped_error)  # (B, T)
    return LossOutput(per_token_loss=loss, metrics={"value_clip": (clipped_error > unclipped_error).float().detach()})


def applies_behaviour_weight(fn) -> bool:
    """True for a policy loss that multiplies by the behaviour weight itself (``decoupled``)."""
    return bool(getattr(getattr(fn, "func", fn), "applies_behaviour_weight", False))


AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")


def aggregate(
    per_token: torch.Tensor, loss_mask: torch.Tensor, mode: str = "token_mean", *, normaliser: float | None = None
) -> torch.Tensor:
    """Reduce per-token losses (B, T) to a scalar.

    - ``token_mean`` (DAPO eq. 12): Σ_i Σ_t l_it / N_tokens — every token weighs the same.
    - ``seq_mean_token_mean`` (GRPO eq. 5): Σ_i (Σ_t l_it / |o_i|) / N_seqs.
    - ``seq_mean_token_sum`` (Dr.GRPO): Σ_i Σ_t l_it / N_seqs — no length normalisation.

    ``normaliser`` is N_tokens (token_mean) or N_seqs (the seq modes) of the *whole* optimiser batch, across
    micro-batches and ranks; by default that of this call's tensors (correct only for one micro-batch).
    """
    mask = loss_mask.to(per_token.dtype)
    if mode == "token_mean":
        total = (per_token * mask).sum()
        default = mask.sum()
    elif mode == "seq_mean_token_mean":
        total = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum()
        default = (mask.sum(-1) > 0).sum()
    elif mode == "seq_mean_token_sum":
        total = (per_token * mask).sum()
        default = (mask.sum(-1) > 0).sum()
    else:
        raise ValueError(f"unknown loss aggregation {mode!r}; choose from {AGGREGATIONS}")
    denominator = default if normaliser is None else normaliser
    return total / max(float(denominator), 1.0)


def normaliser_for(mode: str, loss_mask: torch.Tensor) -> float:
    """The denominator `aggregate` needs for ``mode`` over a whole batch's ``loss_mask``."""
    if mode == "token_mean":
        return float(loss_mask.sum())
    return float((loss_mask.sum(-1) > 0).sum())


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)
