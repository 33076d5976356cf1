"""Entropy-based policy losses — the methods the Syn-GRPO seed compares against (its Table 1 and related
work): Entropy Loss, Entropy Adv. (Cheng et al. 2025), Clip-Cov and KL-Cov (Cui et al. 2025). All four are PPO-family
policy losses in the one registry (`vlrl.algos.losses.POLICY_LOSSES`), because each needs what only the
update's forward pass has: the entropy of π_θ, or the log-probs of π_θ against the advantages.

| name                  | per-token loss (r_t = π_θ / π_old, L^clip_t = ppo_clip)                        | source            |
| --------------------- | ------------------------------------------------------------------------------ | ----------------- |
| ``entropy_bonus``     | L^clip_t − β · H_t                                                             | "Entropy Loss"    |
| ``entropy_advantage`` | L^clip_t with Â_t + min(α · sg[H_t], abs(Â_t) / κ)                               | Cheng et al. 2025 |
| ``clip_cov``          | L^clip_t, and 0 (no gradient) on a random few tokens of high Cov_t               | Cui et al. 2025   |
| ``kl_cov``            | −Â_t · r_t, plus β · abs(log π_θ − log π_old) on the top-k Cov_t tokens          | Cui et al. 2025   |

Cov_t is Cui et al.'s centred token-level covariance of log-probability and advantage:

    Cov_t = (log π_θ(y_t) − mean log π_θ) · (Â_t − mean Â)          means over the valid (loss_mask) tokens

**Conventions chosen here** (the papers' reference code, PRIME-RL/Entropy-Mechanism-of-RL and verl's
``core_algos``, centres and selects within whatever tensors the loss is given — in practice one micro-batch
of one rank — so the selection changes with the micro-batch size):

- the means and the selection run over the *valid tokens of the rows the selection sees*; an update that
  wants one selection per minibatch (and so the one-big-batch gradient for any micro-batching) computes it
  once with `token_covariance` and `clip_cov_selection` / `kl_cov_selection` over the minibatch and hands each
  micro-batch its slice as ``PolicyLossInputs.cov_selection``; the loss then uses it as given;
- selection sizes follow the reference code: k = max(⌊fraction · N_valid⌋, 1) tokens;
- Clip-Cov draws its tokens uniformly among those with ω_low < Cov_t < ω_high that the PPO clip has not
  already cut (the reference code's exclusion), with ``generator`` or the global torch RNG;
- ties in KL-Cov's top-k are broken by `torch.topk` (not specified by the paper).

Defaults are the papers' / reference code's: Clip-Cov fraction 2e-4, band (1, 5); KL-Cov fraction 2e-3 (the authors'
``k_percent: 0.2`` %; verl ships 2e-4) and β = 1; Entropy Adv. α = 0.4, κ = 2; entropy bonus β = 1e-3 (verl's
former ``entropy_coeff`` default; the Syn-GRPO seed does not state its β).
"""

from __future__ import annotations

import dataclasses

import torch

from vlrl.algos.losses import LossOutput, PolicyLossInputs, ppo_clip, register_policy_loss, require


# ------------------------------------------------------------------------------------------ entropy-based
@register_policy_loss("entropy_bonus", needs=("entropy",))
def entropy_bonus(inputs: PolicyLossInputs, *, clip_low: float = 0.2, clip_high: float = 0.2,
                  coef: float = 1e-3) -> LossOutput:
    """PPO clip with an entropy bonus — the "Entropy Loss" of the Syn-GRPO seed's comparison (verl
    ``entropy_coeff``; Schulman et al. 2017's c₂ · S[π_θ]):

        L_t = max(−Â_t · r_t, −Â_t · clip(r_t, 1 − ε_low, 1 + ε_high)) − β · H_t

    H_t = −Σ_v π_θ(v | y_<t) log π_θ(v | y_<t), the entropy of the whole next-token distribution, from the
    update's forward pass *with* its gradient (``inputs.entropy``); aggregated with the policy term, so the
    bonus is β · aggregate(H) exactly as verl subtracts it. Not 0 at Â = 0 (``train.skip_zero_advantage``
    refuses it). Metric ``entropy_bonus``: β · H_t.
    """
    entropy = require(inputs, "entropy", "entropy_bonus")
    out = ppo_clip(inputs, clip_low=clip_low, clip_high=clip_high)
    out.metrics["entropy_bonus"] = (coef * entropy).detach()
    return LossOutput(per_token_loss=out.per_token_loss - coef * entropy, metrics=out.metrics)


def entropy_shaped_advantages(advantages: torch.Tensor, entropy: torch.Tensor, *, alpha: float = 0.4,
                              kappa: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Cheng et al. 2025 (arXiv:2506.14758, "Reasoning with Exploration: An Entropy Perspective"):

        ψ(H_t) = min(α · sg[H_t], |Â_t| / κ)          Â′_t = Â_t + ψ(H_t)

    ψ ≥ 0 carries no gradient; its cap |Â_t|/κ (κ > 1) keeps Â′ of the sign of Â (Â′ ∈ [Â(1 − 1/κ), Â(1 + 1/κ)]
    in magnitude), and Â_t = 0 gives ψ = 0. Returns (Â′, ψ), each (B, T).
    """
    if alpha < 0:
        raise ValueError(f"entropy_advantage: alpha must be ≥ 0, got {alpha}")
    if kappa < 1:
        raise ValueError(f"entropy_advantage: kappa must be ≥ 1 (κ > 1 keeps the advantage's sign), got {kappa}")
    psi = torch.minimum(alpha * entropy.detach(), advantages.abs() / kappa)
    return advantages + psi, psi


@register_policy_loss("entropy_advantage", needs=("entropy",))
def entropy_advantage(inputs: PolicyLossInputs, *, clip_low: float = 0.2, clip_high: float = 0.2,
                      alpha: float = 0.4, kappa: float = 2.0) -> LossOutput:
    """PPO clip on the entropy-shaped advantage of Cheng et al. 2025 (the seed's "Entropy Adv."):

        Â′_t = Â_t + min(α · sg[H_t], |Â_t| / κ)        L_t = max(−Â′_t · r_t, −Â′_t · clip(r_t, 1 − ε_low, 1 + ε_high))

    H_t is the entropy of π_θ at the update (``inputs.entropy``, detached here), as in the authors' "one line"
    in the actor's update loop — which is why this is a loss and not an advantage shaper (a shaper runs
    before the update and would see π_old's entropy; they coincide at the first optimiser step of a rollout
    step). Defaults α = 0.4, κ = 2. Zero at Â = 0. Metrics ``entropy_adv`` (ψ_t) and ``entropy_adv_capped``
    (tokens where |Â_t|/κ bound ψ).
    """
    entropy = require(inputs, "entropy", "entropy_advantage")
    shaped, psi = entropy_shaped_advantages(inputs.advantages, entropy, alpha=alpha, kappa=kappa)
    out = ppo_clip(dataclasses.replace(inputs, advantages=shaped), clip_low=clip_low, clip_high=clip_high)
    with torch.no_grad():
        out.metrics["entropy_adv"] = psi
        out.metrics["entropy_adv_capped"] = (alpha * entropy.detach() > inputs.advantages.abs() / kappa).float()
    return out


# -------------------------------------------------------------------------------------- covariance-based
def token_covariance(logp: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Cov_t = (log π(y_t) − mean log π) · (Â_t − mean Â), means over the valid tokens (``loss_mask``), (B, T);
    −inf where the mask is 0 (never selected). No gradient."""
    valid = loss_mask.bool()
    logp, advantages = logp.detach(), advantages.detach()
    n = valid.sum().clamp(min=1)
    centred_logp = logp - (logp * valid).sum() / n
    centred_adv = advantages - (advantages * valid).sum() / n
    cov = centred_logp * centred_adv
    return torch.where(valid, cov, torch.full_like(cov, -torch.inf))


def _selection_size(fraction: float, loss_mask: torch.Tensor, loss: str) -> int:
    """k = max(⌊fraction · N_valid⌋, 1) (0 without a valid token) — the reference code's count."""
    if not 0 < fraction <= 1:
        raise ValueError(f"{loss}: fraction must lie in (0, 1], got {fraction}")
    n = int(loss_mask.bool().sum())
    return max(int(fraction * n), 1) if n else 0


def clip_cov_selection(cov: torch.Tensor, loss_mask: torch.Tensor, *, fraction: float = 2e-4, low: float = 1.0,
                       high: float = 5.0, exclude: torch.Tensor | None = None,
                       generator: torch.Generator | None = None) -> torch.Tensor:
    """Clip-Cov's tokens (Cui et al. 2025): k = max(⌊fraction · N_valid⌋, 1) drawn uniformly at random among the
    valid tokens with ω_low < Cov_t < ω_high (``low``, ``high``) and not in ``exclude`` (the tokens the PPO clip
    already cut); fewer if fewer qualify. (B, T) bool."""
    candidates = loss_mask.bool() & (cov > low) & (cov < high)
    if exclude is not None:
        candidates &= ~exclude.bool()
    flat = candidates.flatten().nonzero().squeeze(-1)  # indices into the (B·T,) view
    k = min(_selection_size(fraction, loss_mask, "clip_cov"), len(flat))
    chosen = flat[torch.randperm(len(flat), generator=generator)[:k]]
    selection = torch.zeros(cov.numel(), dtype=torch.bool)
    selection[chosen] = True
    return selection.view_as(cov)


def kl_cov_selection(cov: torch.Tensor, loss_mask: torch.Tensor, *, fraction: float = 2e-3) -> torch.Tensor:
    """KL-Cov's tokens (Cui et al. 2025): the k = max(⌊fraction · N_valid⌋, 1) valid tokens of largest Cov_t,
    (B, T) bool."""
    k = _selection_size(fraction, loss_mask, "kl_cov")
    selection = torch.zeros(cov.numel(), dtype=torch.bool)
    selection[torch.topk(cov.flatten(), k).indices] = True  # masked tokens hold −inf: never among the top k
    return selection.view_as(cov)


def _given_selection(inputs: PolicyLossInputs, loss: str) -> torch.Tensor | None:
    """``inputs.cov_selection`` checked against the batch's shape (None: the loss selects itself)."""
    selection = inputs.cov_selection
    if selection is not None and selection.shape != inputs.logp.shape:
        raise ValueError(f"{loss}: cov_selection has shape {tuple(selection.shape)}, the batch {tuple(inputs.logp.shape)}")
    return selection


@register_policy_loss("clip_cov")
def clip_cov(inputs: PolicyLossInputs, *, clip_low: float = 0.2, clip_high: float = 0.2, fraction: float = 2e-4,
             cov_low: float = 1.0, cov_high: float = 5.0) -> LossOutput:
    """Clip-Cov (Cui et al. 2025, arXiv:2505.22617, "The Entropy Mechanism of Reinforcement Learning for Reasoning
    Language Models"):

        L_t = 0                                                   t ∈ I_clip   (its gradient is detached)
        L_t = max(−Â_t · r_t, −Â_t · clip(r_t, 1 − ε_low, 1 + ε_high))   otherwise

    I_clip: ⌊fraction · N⌋ tokens (at least 1) drawn at random among those with ω_low < Cov_t < ω_high
    (`clip_cov_selection`), or ``inputs.cov_selection`` when the update selected over the whole minibatch.
    Defaults fraction 2e-4, (ω_low, ω_high) = (1, 5); the authors' runs loosen the PPO clip to ε = 1 / 1 so that
    Clip-Cov does the clipping. Metric ``clip_cov``: the selected tokens.
    """
    out = ppo_clip(inputs, clip_low=clip_low, clip_high=clip_high)
    selection = _given_selection(inputs, "clip_cov")
    if selection is None:
        cut_by_ppo = (out.metrics["clip_low"] + out.metrics["clip_high"]) > 0
        cov = token_covariance(inputs.logp, inputs.advantages, inputs.loss_mask)
        selection = clip_cov_selection(cov, inputs.loss_mask, fraction=fraction, low=cov_low, high=cov_high,
                                       exclude=cut_by_ppo)
    selection = selection.bool()
    out.metrics["clip_cov"] = selection.float()
    return LossOutput(per_token_loss=torch.where(selection, torch.zeros_like(out.per_token_loss), out.per_token_loss),
                      metrics=out.metrics)


@register_policy_loss("kl_cov")
def kl_cov(inputs: PolicyLossInputs, *, clip_low: float = 0.2, clip_high: float = 0.2, fraction: float = 2e-3,
           coef: float = 1.0) -> LossOutput:
    """KL-Cov (Cui et al. 2025, arXiv:2505.22617): no clip; a KL penalty on the highest-covariance tokens,

        L_t = −Â_t · r_t + β · |log π_θ(y_t) − log π_old(y_t)|     t ∈ I_KL
        L_t = −Â_t · r_t                                           otherwise

    I_KL: the ⌊fraction · N⌋ tokens (at least 1) of largest Cov_t (`kl_cov_selection`), or ``inputs.cov_selection``.
    Defaults fraction 2e-3 (the authors' 0.2 %), β = 1 (their ``ppo_kl_coef``). ``clip_low`` / ``clip_high`` are
    accepted (the recipe passes them) and unused: KL-Cov replaces the clip. The penalty is not 0 at Â = 0
    (``train.skip_zero_advantage`` refuses this loss). Metrics ``kl_cov`` (the selected tokens), ``ratio``.
    """
    del clip_low, clip_high  # KL-Cov has no ratio clip
    log_ratio = (inputs.logp - inputs.old_logp).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)  # (B, T)
    selection = _given_selection(inputs, "kl_cov")
    if selection is None:
        cov = token_covariance(inputs.logp, inputs.advantages, inputs.loss_mask)
        selection = kl_cov_selection(cov, inputs.loss_mask, fraction=fraction)
    selection = selection.bool()
    loss = -inputs.advantages * ratio + coef * log_ratio.abs() * selection
    return LossOutput(per_token_loss=loss, metrics={"kl_cov": selection.float(), "ratio": ratio.detach()})
