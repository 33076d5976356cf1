"""Syn-GRPO's diversity reward with diversity smoothing, and its description selection (Syn-GRPO seed,
§3.2 Eq. 4 and §3.3.2 Eq. 5, 6, 8).

Besides its reasoning and answer, every response o_i predicts a diversity v_i ∈ [0, 1] of the answers to its
prompt q. The ground truth is the spread of the group's accuracy rewards:

    V(q)              = 4 · var({R_acc(o_i)}_{i=1..G})                           Eq. 4, normalised by its ¼ bound
    V_k^batch_avg     = 1/|B_k| · Σ_{q' ∈ B_k} V(q')                             mean over the prompts of step k
    V_k^global_avg    = γ · V_{k−1}^global_avg + (1 − γ) · V_k^batch_avg         V_1^global_avg = V_1^batch_avg
    Ṽ(q)              = clip(V(q) · V_k^global_avg / V_k^batch_avg, 0, 1)        diversity smoothing
    R_diversity(o_i)  = 1 − |v_i − Ṽ(q)|                                         Eq. 6 (Eq. 5 without smoothing)
    i*                = argmax_i R_diversity(o_i)                                Eq. 8: its description is synthesised

``var`` is the population variance (1/G): for rewards in [0, 1] it is at most ¼ (Popoviciu), the bound the
paper normalises by, so V(q) ∈ [0, 1]. The paper writes the smoothing weight β in Eq. 6 and γ = 0.7 in §4
(its ablation, Table 4); here it is ``gamma``. Cases the paper leaves open, decided here:

- V_k^batch_avg = 0 (every group of the batch unanimous): every V(q) = 0, so Ṽ(q) = 0 (0 · anything);
  the EMA still absorbs the zero batch.
- a response whose v_i could not be read (malformed output, NaN) gets R_diversity = 0, the minimum, and
  cannot be selected in Eq. 8.
- ties in Eq. 8 go to the lowest index (the first response).

The only state is `DiversityState` (V_{k−1}^global_avg), passed in and returned: the function is pure.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlrl.algos.shaping import RewardShapingInputs, ShapingOutput, register_reward_shaping


@dataclass(frozen=True)
class DiversityState:
    """The EMA of batch diversities, V_{k−1}^global_avg (None before the first step), and steps seen.

    ``last_reward`` holds R_diversity of the last batch, in batch order: what the synthesis workflow ranks
    descriptions by (Eq. 8) after the step; it plays no part in the next step's reward.
    """

    global_avg: float | None = None
    steps: int = 0
    last_reward: tuple[float, ...] = ()


@dataclass
class DiversityOutput:
    """R_diversity per response and what went into it. B responses."""

    reward: torch.Tensor  # (B,) R_diversity(o_i) ∈ [0, 1]; 0 where v_i is missing
    diversity: torch.Tensor  # (B,) V(q) of each response's group, normalised to [0, 1]
    smoothed: torch.Tensor  # (B,) Ṽ(q) (= V(q) without smoothing)
    batch_avg: float  # V_k^batch_avg
    global_avg: float  # V_k^global_avg
    state: DiversityState  # the state for step k + 1


def group_diversity(accuracy: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """V(q) = 4 · population variance of the accuracy rewards of each group, broadcast to its members.

    accuracy (B,) ∈ [0, 1], group_index (B,) → (B,). Rewards 1, 0, 1, 0 → var ¼ → V = 1.
    """
    accuracy = accuracy.double()
    _, inverse, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=accuracy.dtype).index_add_(0, inverse, accuracy)
    mean = sums / counts  # (Q,)
    sq = torch.zeros(len(counts), dtype=accuracy.dtype).index_add_(0, inverse, (accuracy - mean[inverse]) ** 2)
    return (4.0 * sq / counts)[inverse].float()  # (B,)


def diversity_reward(
    accuracy: torch.Tensor,
    predicted: torch.Tensor,
    group_index: torch.Tensor,
    state: DiversityState,
    *,
    gamma: float = 0.7,
    smoothing: bool = True,
) -> DiversityOutput:
    """R_diversity(o_i) = 1 − |v_i − Ṽ(q)| with the EMA smoothing of Eq. 6 (see the module docstring).

    Args:
        accuracy: (B,) R_acc(o_i) ∈ [0, 1].
        predicted: (B,) v_i, the diversity each response predicted; NaN where it could not be read.
        group_index: (B,) prompt id; the G responses of one prompt share it.
        state: V_{k−1}^global_avg from the previous step (`DiversityState()` at the first).
        gamma: smoothing weight (β of Eq. 6; the paper's γ = 0.7).
        smoothing: False gives Eq. 5 (Ṽ = V); the EMA is still tracked.
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"diversity: gamma must lie in [0, 1], got {gamma}")
    if accuracy.shape != predicted.shape or accuracy.shape != group_index.shape or accuracy.dim() != 1:
        raise ValueError(f"diversity: accuracy {tuple(accuracy.shape)}, predicted {tuple(predicted.shape)} and "
                         f"group_index {tuple(group_index.shape)} must be the same (B,) shape")
    diversity = group_diversity(accuracy, group_index)  # (B,)
    _, first = _first_of_groups(group_index)
    batch_avg = float(diversity[first].double().mean())  # mean over prompts, not responses
    global_avg = batch_avg if state.global_avg is None else gamma * state.global_avg + (1 - gamma) * batch_avg
    if smoothing and batch_avg > 0:
        smoothed = (diversity * (global_avg / batch_avg)).clamp(0.0, 1.0)
    else:
        smoothed = diversity.clone()  # batch_avg = 0 → every V(q) = 0 → Ṽ = 0
    predicted = predicted.float()
    valid = torch.isfinite(predicted)
    reward = torch.where(valid, 1.0 - (predicted.nan_to_num(0.0) - smoothed).abs(), torch.zeros_like(smoothed))
    reward = reward.clamp(0.0, 1.0)
    return DiversityOutput(reward=reward, diversity=diversity, smoothed=smoothed, batch_avg=batch_avg,
                           global_avg=global_avg, state=DiversityState(global_avg, state.steps + 1, tuple(reward.tolist())))


def select_descriptions(reward: torch.Tensor, group_index: torch.Tensor, valid: torch.Tensor) -> dict[int, int]:
    """Eq. 8: for every group, the index i* of its response with the highest R_diversity among the ``valid``
    ones (those with a usable description); ties → the lowest index; groups without one are left out.

    reward (B,), group_index (B,), valid (B,) bool → {group id: row index}.
    """
    chosen: dict[int, int] = {}
    for i in range(len(reward)):
        if not bool(valid[i]):
            continue
        g = int(group_index[i])
        if g not in chosen or float(reward[i]) > float(reward[chosen[g]]):
            chosen[g] = i
    return chosen


def _first_of_groups(group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(group ids, row of each group's first member)."""
    ids, inverse = torch.unique(group_index, return_inverse=True)
    rows = torch.arange(len(group_index))
    first = torch.full((len(ids),), len(group_index), dtype=torch.long).scatter_reduce(0, inverse, rows, reduce="amin")
    return ids, first


# ----------------------------------------------------------------------------------------------- reward shaper
@register_reward_shaping("syn_diversity")
def syn_diversity(inputs: RewardShapingInputs, *, gamma: float = 0.7, smoothing: bool = True, weight: float = 1.0,
                  accuracy_part: str = "accuracy") -> ShapingOutput:
    """Syn-GRPO's diversity reward as a reward shaper (Eq. 6–7): r′ = r + weight · R_diversity(o_i).

    v_i is read from each response's ``<diversity>`` block (`vlrl.rewards.syn`), R_acc(o_i) from its reward part
    ``accuracy_part`` (the verifiers' ``accuracy``; e.g. ``bbox_iou`` for the seed's continuous IoU when the
    sample's reward weights several verifiers). The state is the `DiversityState` (the EMA of Eq. 6, and the
    batch's R_diversity, which the synthesis workflow ranks descriptions by). Select it with
    ``algo.reward_shaping: [{name: syn_diversity, options: {gamma: 0.7}}]``.
    """
    from vlrl.rewards.syn import parse_syn_response

    trajectories = inputs.trajectories
    if len(trajectories) != len(inputs.rewards):
        raise ValueError(f"syn_diversity: needs the batch's trajectories (got {len(trajectories)} for "
                         f"{len(inputs.rewards)} rewards)")
    parsed = [parse_syn_response(t.response_text, require_think=False).diversity for t in trajectories]
    predicted = torch.tensor([float("nan") if v is None else v for v in parsed])  # (B,)
    accuracy = torch.tensor([float(t.reward_parts.get(accuracy_part, 0.0)) for t in trajectories]).clamp(0, 1)  # (B,)
    state = inputs.state if isinstance(inputs.state, DiversityState) else DiversityState()
    out = diversity_reward(accuracy, predicted, inputs.group_index, state, gamma=gamma, smoothing=smoothing)
    metrics = {"reward_mean": float(out.reward.mean()), "v_batch": out.batch_avg, "v_global": out.global_avg,
               "target_mean": float(out.smoothed.mean()), "parsed_frac": float(torch.isfinite(predicted).float().mean())}
    return ShapingOutput(values=inputs.rewards + weight * out.reward.to(inputs.rewards.dtype), metrics=metrics,
                         state=out.state)
