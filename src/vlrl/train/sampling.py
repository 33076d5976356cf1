"""Steps 1–3 of the synchronous RL step: draw prompts, sample n responses each, score — with DAPO dynamic
sampling and ReMax's greedy baseline when configured.

Dynamic sampling (DAPO §3.2.2, eq. 11; verl ``filter_groups``): generate a round of prompts, drop the groups
whose rewards are all equal (zero advantage, no gradient), and generate more rounds until the batch holds
``prompts_per_step`` informative groups or ``max_extra_rounds`` extra rounds were spent. A round asks for
``ceil(missing × oversample)`` prompts; informative groups beyond the batch are carried over to the next
step (they were sampled by weights one step older: the update treats them as on-policy, like verl).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vlrl.algos.filters import informative_groups
from vlrl.config import DynamicSamplingConfig
from vlrl.data import Sample
from vlrl.rewards import score_trajectories
from vlrl.rollout import Engine, Request, SamplingParams, Trajectory
from vlrl.train.common import PromptCursor


@dataclass
class SampledGroup:
    """The n scored responses to one prompt (and, for ReMax, the reward of its greedy response)."""

    trajectories: list[Trajectory]
    baseline_reward: float | None = None


@dataclass
class SampledBatch:
    trajectories: list[Trajectory]  # group by group, ``group_index`` = position of the group in the batch
    failures: list = field(default_factory=list)  # reward failures (`ScoreReport.failures`) of every round
    baseline_rewards: torch.Tensor | None = None  # (B,) greedy reward of each response's prompt
    metrics: dict[str, float] = field(default_factory=dict)


class GroupSampler:
    """Draws prompts from ``cursor`` and returns one step's scored groups."""

    def __init__(self, engine: Engine, cursor: PromptCursor, sampling: SamplingParams, *, prompts_per_step: int,
                 dynamic: DynamicSamplingConfig, greedy_baseline: bool = False,
                 shard: Callable[[list[Sample]], list[Sample]] | None = None) -> None:
        """``shard``: under torchrun, keeps this rank's share of the prompts every rank drew (same cursor)."""
        self.engine, self.cursor, self.sampling = engine, cursor, sampling
        self.shard = shard or (lambda prompts: prompts)
        self.prompts_per_step, self.dynamic, self.greedy_baseline = prompts_per_step, dynamic, greedy_baseline
        self.carry: list[SampledGroup] = []  # informative groups left over from the previous step
        self._requests: dict[str, Request] = {}

    def next_batch(self) -> SampledBatch:
        if not self.dynamic.enabled:
            groups, failures = self._round(self.prompts_per_step)
            return self._batch(groups, failures, {})
        P = self.prompts_per_step
        kept, failures, carried_in = self.carry, [], len(self.carry)
        self.carry = []
        rounds = generated = dropped = 0
        while len(kept) < P and rounds <= self.dynamic.max_extra_rounds:
            groups, round_failures = self._round(math.ceil((P - len(kept)) * self.dynamic.oversample))
            rounds, generated, failures = rounds + 1, generated + len(groups), failures + round_failures
            informative = [g for g in groups if self._informative(g)]
            dropped += len(groups) - len(informative)
            kept = kept + informative
        kept, self.carry = kept[:P], kept[P:]
        n = self.sampling.n
        metrics = {"sampling/rounds": rounds, "sampling/prompts_generated": generated,
                   "sampling/samples_generated": generated * n, "sampling/groups_dropped": dropped,
                   "sampling/prompts_used": len(kept), "sampling/carried_in": carried_in,
                   "sampling/carried_over": len(self.carry)}
        if not kept:
            raise RuntimeError(f"dynamic sampling: every one of {generated} groups in {rounds} round(s) had equal rewards "
                               f"(zero advantage); raise algo.dynamic_sampling.max_extra_rounds or check the reward")
        return self._batch(kept, failures, metrics)

    def forget(self, sample_ids: list[str]) -> None:
        """Drop the cached encodings of samples that left the dataset (Syn-GRPO replaced them)."""
        for sample_id in sample_ids:
            self._requests.pop(sample_id, None)

    def _round(self, count: int) -> tuple[list[SampledGroup], list]:
        """Draw ``count`` prompts, sample ``n`` responses each, score them (and their greedy responses)."""
        prompts = self.shard(self.cursor.next(count))
        requests = [self._requests.setdefault(s.id, self.engine.encode(s)) for s in prompts]
        trajectories = self.engine.generate(requests, self.sampling)
        report = score_trajectories(trajectories)
        n = self.sampling.n
        groups = [SampledGroup(trajectories[k * n : (k + 1) * n]) for k in range(len(prompts))]
        failures = list(report.failures)
        if self.greedy_baseline:  # ReMax: one greedy response per prompt, scored like the others
            greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=self.sampling.max_new_tokens,
                                    stop=list(self.sampling.stop))
            baselines = self.engine.generate(requests, greedy)
            failures += list(score_trajectories(baselines).failures)
            for group, baseline in zip(groups, baselines, strict=True):
                group.baseline_reward = float(baseline.reward)
        return groups, failures

    def _informative(self, group: SampledGroup) -> bool:
        return group_is_informative(group.trajectories, self.dynamic.metric)

    def _batch(self, groups: list[SampledGroup], failures: list, metrics: dict[str, float]) -> SampledBatch:
        trajectories = []
        for i, group in enumerate(groups):
            for t in group.trajectories:
                t.group_index = i
                trajectories.append(t)
        baseline = None
        if self.greedy_baseline:
            baseline = torch.tensor([g.baseline_reward for g in groups for _ in g.trajectories])
        return SampledBatch(trajectories, failures, baseline, metrics)

    def state(self) -> dict:
        """Plain data a checkpoint needs besides the cursor: the carried-over groups (token ids, log-probs,
        rewards), in the layout of `vlrl.train.async_grpo.GroupBuffer.state_dict`."""
        return {"cursor": self.cursor.state(), "carry": [{
            "sample_id": g.trajectories[0].sample.id, "baseline_reward": g.baseline_reward, "trajectories": [
                {"response_ids": t.response_ids.tolist(), "behaviour_logp": t.behaviour_logp.tolist(),
                 "loss_mask": t.loss_mask.tolist(), "weight_version": t.weight_version, "status": t.status.value,
                 "reward": t.reward, "reward_parts": dict(t.reward_parts), "response_text": t.response_text}
                for t in g.trajectories]} for g in self.carry]}


def group_is_informative(trajectories: list[Trajectory], metric: str = "reward") -> bool:
    """True if the group's ``metric`` (the scalar reward, or the ``accuracy`` sub-score — 0 when missing)
    is not the same for every response (DAPO eq. 11)."""
    if metric == "accuracy":
        scores = torch.tensor([float(t.reward_parts.get("accuracy", 0.0)) for t in trajectories])
    else:
        scores = torch.tensor([float(t.reward) for t in trajectories])
    return bool(informative_groups(scores, torch.zeros(len(scores), dtype=torch.long)).all())
