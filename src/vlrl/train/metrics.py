"""The metrics of one RL step — one function for both recipes (`step_metrics`), over the whole batch of every rank.

    reward/…        mean, std, per task, verifier failures, and ReMax's greedy baseline (the scored responses)
    accuracy/…      per task (`Trajectory.accuracy`), macro mean
    response/…      length mean / max, truncated fraction, well-formed fraction (ended, in the answer form)
    rollout/…       gen_prob (mean probability of the sampled tokens), diversity (Syn-GRPO eq. 4)
    policy/…        zero-advantage groups, and the update's statistics (`UpdateStats.metrics`)
    shaping/…       what the shapers reported
    agent/…         multi-turn episodes (`vlrl.rollout.agent.agent_metrics`), when the batch holds any
    data/epoch      the latest epoch of the data cursor among the batch's prompts

The recipes add what is theirs alone: dynamic sampling's ``sampling/…``, the asynchronous recipe's
``staleness/…``, Syn-GRPO's ``synth/…``, timings (``perf/…``).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence

import torch

from vlrl.algos.advantages import group_variance
from vlrl.data import Sample
from vlrl.feed.groups import Group
from vlrl.report.watch import generation_prob
from vlrl.rollout import Status, Trajectory
from vlrl.rollout.agent import agent_metrics
from vlrl.train.distributed import DistContext
from vlrl.train.update import UpdateBatch, UpdateStats


def step_metrics(batch: UpdateBatch, stats: UpdateStats, groups: Sequence[Group], *,
                 ctx: DistContext | None = None) -> dict[str, float]:
    """The step's metrics (see the module docstring). Under torchrun (``ctx``) ``batch``, ``stats`` and
    ``groups`` are this rank's share: every rank's responses and statistics are gathered, so that rank 0 logs
    what one process training the whole batch would."""
    trajectories = list(batch.trajectories)
    stats = UpdateStats.merge([stats, UpdateStats(token_sums=batch.token_sums)])  # + the batch's per-token metrics
    seq_adv = (batch.advantages.abs() * batch.loss_mask).sum(-1)  # (B,) |Â| of each response
    group_index, shaping = batch.group_index, dict(batch.metrics)
    failures = sum(len(g.reward_failures) for g in groups)
    epoch = max((g.draw.epoch for g in groups), default=0)
    baselines = [g.baseline_reward for g in groups if g.baseline_reward is not None]
    if ctx is not None and ctx.enabled:
        parts = ctx.gather_objects({"rows": [_light(t) for t in trajectories], "adv": seq_adv, "group": group_index,
                                    "stats": stats, "failures": failures, "shaping": shaping, "epoch": epoch,
                                    "baselines": baselines})
        trajectories, offset, shifted = [], 0, []
        for part in parts:
            trajectories += part["rows"]
            shifted.append(part["group"] + offset)  # prompt ids are per rank: make them distinct
            offset += int(part["group"].max()) + 1 if len(part["group"]) else 0
        seq_adv, group_index = torch.cat([p["adv"] for p in parts]), torch.cat(shifted)
        stats = UpdateStats.merge([p["stats"] for p in parts])
        failures, epoch = sum(p["failures"] for p in parts), max(p["epoch"] for p in parts)
        baselines = [b for p in parts for b in p["baselines"]]
        shaping = {k: sum(p["shaping"].get(k, 0.0) for p in parts) / len(parts) for k in parts[0]["shaping"]}
    metrics = response_metrics(trajectories, group_index)
    metrics["reward/failures"] = failures
    if baselines:  # ReMax: the reward of the greedy response to each prompt, the baseline of its group
        metrics["reward/greedy_baseline"] = sum(baselines) / len(baselines)
    zero = [bool((seq_adv[group_index == g] == 0).all()) for g in group_index.unique()]
    metrics["policy/zero_adv_groups_frac"] = sum(zero) / len(zero)
    metrics.update(stats.metrics())
    metrics.update(shaping)
    if any(t.turns for t in trajectories):
        metrics.update(agent_metrics(trajectories))
    metrics["data/epoch"] = epoch
    return metrics


def response_metrics(trajectories: Sequence[Trajectory], group_index: torch.Tensor) -> dict[str, float]:
    """``reward/…``, ``accuracy/…``, ``response/…``, ``rollout/gen_prob`` and ``rollout/diversity`` of scored
    responses (B of them, ``group_index`` (B,) their prompts)."""
    rewards = torch.tensor([float(t.reward) for t in trajectories])
    metrics: dict[str, float] = {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
    }
    by_task: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajectories:
        by_task[t.sample.task].append(t)
    accuracies = []
    for task, group in sorted(by_task.items()):
        metrics[f"reward/{task}"] = sum(t.reward for t in group) / len(group)
        scored = [t.accuracy for t in group if t.accuracy is not None]
        if scored:
            metrics[f"accuracy/{task}"] = sum(scored) / len(scored)
            accuracies.append(metrics[f"accuracy/{task}"])
    if accuracies:
        metrics["accuracy/mean"] = sum(accuracies) / len(accuracies)
    lengths = torch.tensor([len(t.response_ids) for t in trajectories], dtype=torch.float)
    metrics["response/length_mean"] = float(lengths.mean())
    metrics["response/length_max"] = float(lengths.max())
    metrics["response/truncated_frac"] = sum(t.status is Status.TRUNCATED for t in trajectories) / len(trajectories)
    metrics["response/well_formed_frac"] = sum(bool(t.well_formed) for t in trajectories) / len(trajectories)
    metrics["rollout/gen_prob"] = generation_prob(trajectories)
    metrics["rollout/diversity"] = diversity(trajectories, group_index)
    return metrics


def diversity(trajectories: Sequence[Trajectory], group_index: torch.Tensor) -> float:
    """Syn-GRPO's diversity (eq. 4), batch mean: V(q) = var of the accuracy rewards within each group (the
    verifiers' accuracy when every response has one, else the scalar reward), averaged over groups."""
    if all(t.accuracy is not None for t in trajectories):
        scores = torch.tensor([float(t.accuracy) for t in trajectories])
    else:
        scores = torch.tensor([float(t.reward) for t in trajectories])
    per_element = group_variance(scores, group_index)  # (B,)
    _, first = unique_first(group_index)
    return float(per_element[first].mean())


def unique_first(index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(distinct values, position of each one's first occurrence)."""
    values, inverse = torch.unique(index, return_inverse=True)
    first = torch.full((len(values),), len(index), dtype=torch.long).scatter_reduce(
        0, inverse, torch.arange(len(index)), "amin")
    return values, first


def _light(t: Trajectory) -> Trajectory:
    """A copy of ``t`` without what metrics never read (prompt, vision inputs, pixels, text), to gather across
    ranks: the sample keeps its id and task, the images list only its length."""
    return dataclasses.replace(t, sample=Sample(t.sample.id, t.sample.task, []), prompt_ids=torch.empty(0, dtype=torch.long),
                               vision=None, images=[None] * len(t.images), response_text="", reward_parts={})
