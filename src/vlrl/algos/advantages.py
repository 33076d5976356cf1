"""Advantage estimators: one registry, one signature.

Every estimator is ``fn(inputs: AdvantageInputs, **options) -> AdvantageOutput``. Options are keyword-only
and bound by the recipe from ``algo.advantage_options``. Outcome estimators read the sequence reward as
``token_rewards.sum(-1)`` (the outcome reward sits on the last model token; a per-token KL penalty adds to
it) and broadcast the advantage to every response token through ``loss_mask``. Token-level estimators
(``reinforce_pp``, ``gae``) use ``token_rewards`` position by position.

| name           | advantage of response i (token t)                                   | source                   |
| -------------- | ------------------------------------------------------------------- | ------------------------ |
| ``grpo``       | (r_i − mean_g) / (std_g + ε)                                        | DeepSeekMath; DAPO eq. 9 |
| ``dr_grpo``    | r_i − mean_g                                                        | Dr.GRPO (Liu et al. 2025)|
| ``rloo``       | r_i − mean_{j≠i in g} r_j = G/(G−1) · (r_i − mean_g)                | Ahmadian et al. 2024     |
| ``reinforce_pp`` | whiten_batch(Σ_{t′≥t} γ^{t′−t} r_t′ [− mean_g r])                 | REINFORCE++ (Hu 2025)    |
| ``gae``        | Σ_l (γλ)^l δ_{t+l},  δ_t = r_t + γ V_{t+1} − V_t   (critic)          | DAPO eq. 2–3; Schulman 2016 |
| ``remax``      | r_i − r(greedy response to the same prompt)                         | ReMax (Li et al. 2024)   |
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlrl.registry import Registry


@dataclass
class AdvantageInputs:
    """What an estimator may use. Shapes: B sequences, T response tokens."""

    token_rewards: torch.Tensor  # (B, T) reward per response token
    loss_mask: torch.Tensor  # (B, T) 1 = the model's token
    group_index: torch.Tensor  # (B,) prompt id; the n samples of one prompt share it
    values: torch.Tensor | None = None  # (B, T) critic values (PPO/GAE)
    baseline_rewards: torch.Tensor | None = None  # (B,) e.g. the greedy rollout's reward (ReMax)


@dataclass
class AdvantageOutput:
    advantages: torch.Tensor  # (B, T), zero where loss_mask is 0
    returns: torch.Tensor  # (B, T) regression targets of a critic (= advantages for critic-free estimators)


ADVANTAGES: Registry = Registry("advantage", signature="fn(inputs: AdvantageInputs, **options) -> AdvantageOutput")


def register_advantage(name: str, *, needs: tuple[str, ...] = ()):
    """Decorator: register an estimator. ``needs`` names the optional `AdvantageInputs` it requires —
    ``"values"`` (the recipe trains a critic) or ``"baseline_rewards"`` (the recipe runs one greedy response
    per prompt) — so the recipe provides them without knowing the estimator's name."""

    def decorator(fn):
        fn.needs = frozenset(needs)
        return ADVANTAGES.register(name)(fn)

    return decorator


def advantage_needs(fn) -> frozenset[str]:
    """What an estimator (registered, or a plug-in with a ``needs`` attribute) requires besides rewards."""
    return frozenset(getattr(fn, "needs", ()))


def get_advantage(name: str):
    """Look up an estimator by name (``grpo``) or dotted path ``pkg.mod:fn``."""
    return ADVANTAGES.get(name)


def group_stats(scores: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-element group mean, unbiased group std (0 for singleton groups) and group size, each (B,)."""
    _, inverse, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=scores.dtype).index_add_(0, inverse, scores)
    mean = (sums / counts)[inverse]
    sq = torch.zeros(len(counts), dtype=scores.dtype).index_add_(0, inverse, (scores - mean) ** 2)
    dof = (counts - 1).clamp(min=1).to(scores.dtype)
    std = torch.where(counts > 1, (sq / dof).sqrt(), torch.zeros_like(sq))[inverse]
    return mean, std, counts[inverse]


def group_variance(scores: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """Population variance of each element's group, (B,): Syn-GRPO's diversity V(q) = var({R_acc(o_i)}_{i=1}^G)
    (eq. 4; at most 1/4 for 0/1 rewards, reached when half the group is right)."""
    _, inverse, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=scores.dtype).index_add_(0, inverse, scores)
    mean = (sums / counts)[inverse]
    sq = torch.zeros(len(counts), dtype=scores.dtype).index_add_(0, inverse, (scores - mean) ** 2)
    return (sq / counts)[inverse]


@register_advantage("grpo")
def grpo(inputs: AdvantageInputs, *, eps: float = 1e-6, norm_by_std: bool = True) -> AdvantageOutput:
    """GRPO group-normalised advantage (DeepSeekMath; LLaVA-OV-1.5 RL seed, "Advantage").

        Â_i = (r_i − mean(r_group)) / (std(r_group) + ε)      broadcast to every response token of i

    ``std`` is the unbiased group standard deviation (the seed's worked example: rewards
    1, 1, 1, .5, 0 → mean 0.70, std 0.45 → Â = +0.67 for a correct answer). With ``norm_by_std=False``
    only the mean is subtracted (Dr.GRPO's fix for the difficulty bias). A group whose rewards are all
    equal gets Â = 0: no learning signal, as intended.
    """
    scores = inputs.token_rewards.sum(-1)  # (B,)
    mean, std, _ = group_stats(scores, inputs.group_index)
    advantage = scores - mean
    if norm_by_std:
        advantage = advantage / (std + eps)
    advantages = advantage.unsqueeze(-1) * inputs.loss_mask  # (B, T)
    return AdvantageOutput(advantages=advantages, returns=advantages)


def _outcome(inputs: AdvantageInputs, advantage: torch.Tensor) -> AdvantageOutput:
    """Broadcast a per-sequence advantage (B,) onto the model tokens."""
    advantages = advantage.unsqueeze(-1) * inputs.loss_mask  # (B, T)
    return AdvantageOutput(advantages=advantages, returns=advantages)


@register_advantage("dr_grpo")
def dr_grpo(inputs: AdvantageInputs) -> AdvantageOutput:
    """Dr.GRPO ("Understanding R1-Zero-Like Training", Liu et al. 2025): GRPO without its two biases.

        Â_i = r_i − mean(r_group)                broadcast to every response token of i

    No division by the group std (the difficulty bias: near-solved and near-failed prompts get their
    advantages blown up). The other half of the fix — no 1/|o_i| length normalisation — is the loss
    aggregation ``seq_mean_token_sum`` (the ``dr_grpo`` preset sets it).
    """
    scores = inputs.token_rewards.sum(-1)  # (B,)
    mean, _, _ = group_stats(scores, inputs.group_index)
    return _outcome(inputs, scores - mean)


@register_advantage("rloo")
def rloo(inputs: AdvantageInputs) -> AdvantageOutput:
    """REINFORCE Leave-One-Out (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics"):

        Â_i = r_i − 1/(G − 1) · Σ_{j ≠ i} r_j  =  G/(G − 1) · (r_i − mean(r_group))

    each response's baseline is the mean reward of the *other* G − 1 responses to its prompt (unbiased,
    since it does not depend on response i). A singleton group has no baseline: Â = 0.
    """
    scores = inputs.token_rewards.sum(-1)  # (B,)
    mean, _, counts = group_stats(scores, inputs.group_index)
    G = counts.to(scores.dtype)
    advantage = torch.where(counts > 1, G / (G - 1).clamp(min=1) * (scores - mean), torch.zeros_like(scores))
    return _outcome(inputs, advantage)


def _masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float) -> torch.Tensor:
    """(x − mean) / (std + eps) over the masked entries (unbiased std), 0 elsewhere."""
    m = mask.to(values.dtype)
    n = m.sum()
    if n < 2:
        return values * 0
    mean = (values * m).sum() / n
    var = (((values - mean) * m) ** 2).sum() / (n - 1)
    return (values - mean) / (var.sqrt() + eps) * m


def _discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = Σ_{t′ ≥ t, model tokens} γ^{(# model tokens between)} r_t′ — observation tokens (mask 0) are
    stepped over, not discounted; 0 at masked positions. (B, T)."""
    running = torch.zeros_like(token_rewards[:, 0])
    returns = torch.zeros_like(token_rewards)
    keep = mask.bool()
    for t in reversed(range(token_rewards.shape[1])):
        running = torch.where(keep[:, t], token_rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return returns * mask


@register_advantage("reinforce_pp")
def reinforce_pp(inputs: AdvantageInputs, *, gamma: float = 1.0, group_baseline: bool = False,
                 eps: float = 1e-8) -> AdvantageOutput:
    """REINFORCE++ (Hu 2025, "REINFORCE++: a simple and efficient approach for aligning LLMs"):

        G_t = Σ_{t′ ≥ t} γ^{t′ − t} r_t′                  token returns (outcome reward + per-token KL penalty)
        Â_t = (G_t − mean_batch(G)) / (std_batch(G) + ε)   whitened over every model token of the batch

    With ``group_baseline=True`` (REINFORCE++-baseline) the group mean of the outcome rewards is first
    subtracted from every return of the group: G_t ← G_t − mean_g(r). No critic, no per-group std.
    """
    mask = inputs.loss_mask
    returns = _discounted_returns(inputs.token_rewards, mask, gamma)  # (B, T)
    if group_baseline:
        mean, _, _ = group_stats(inputs.token_rewards.sum(-1), inputs.group_index)
        returns = (returns - mean.unsqueeze(-1)) * mask
    return AdvantageOutput(advantages=_masked_whiten(returns, mask, eps), returns=returns)


@register_advantage("gae", needs=("values",))
def gae(inputs: AdvantageInputs, *, gamma: float = 1.0, lam: float = 1.0, whiten: bool = True,
        eps: float = 1e-8) -> AdvantageOutput:
    """Generalised advantage estimation with a critic (Schulman et al. 2016; DAPO eqs. 2–3 — PPO):

        δ_t = r_t + γ V(s_{t+1}) − V(s_t)          V = 0 after the last model token
        Â_t = Σ_l (γλ)^l δ_{t+l}                   returns R_t = Â_t + V(s_t)  (the critic's targets)

    Observation tokens (mask 0, multi-turn) are stepped over: the next state of a model token is the next
    model token. ``whiten`` normalises Â over the batch's model tokens (PPO's usual practice); the returns
    are taken before whitening. γ = λ = 1 (verl's defaults for LLMs) makes Â_t = Σ_{t′≥t} r_t′ − V_t.
    """
    if inputs.values is None:
        raise ValueError("gae needs critic values (inputs.values); the recipe trains a critic when the estimator needs it")
    mask, values, rewards = inputs.loss_mask, inputs.values * inputs.loss_mask, inputs.token_rewards
    keep = mask.bool()
    next_value = torch.zeros_like(values[:, 0])
    running = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(keep[:, t], delta + gamma * lam * running, running)
        next_value = torch.where(keep[:, t], values[:, t], next_value)
        advantages[:, t] = running
    advantages = advantages * mask
    returns = (advantages + values) * mask
    if whiten:
        advantages = _masked_whiten(advantages, mask, eps)
    return AdvantageOutput(advantages=advantages, returns=returns)


@register_advantage("remax", needs=("baseline_rewards",))
def remax(inputs: AdvantageInputs) -> AdvantageOutput:
    """ReMax (Li et al. 2024, "ReMax: a simple, effective and efficient RL method for LLMs"):

        Â_i = r_i − r(ȳ_q)           ȳ_q = the greedy response to response i's prompt q

    ``baseline_rewards`` (B,) carries r(ȳ_q) for every response (the recipe generates and scores one greedy
    response per prompt). No normalisation.
    """
    if inputs.baseline_rewards is None:
        raise ValueError("remax needs baseline_rewards (the reward of the greedy response to each prompt)")
    scores = inputs.token_rewards.sum(-1)  # (B,)
    return _outcome(inputs, scores - inputs.baseline_rewards.to(scores.dtype))
