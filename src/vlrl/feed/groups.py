"""The groups both feeds make (`vlrl.feed.sync`, `vlrl.feed.asynchronous`): a drawn prompt, its n scored responses,
and the batch they flatten into.

    Draw / Group      a prompt drawn from the data cursor (ticket, sample, epoch) / its n scored responses
    PromptEncoder     each sample encoded once (token ids + processor outputs), for as long as it is in the data
    score_groups      score a round's responses (and ReMax's greedy responses) and cut them into groups
    flatten           groups → the batch's trajectories (``group_index`` = position of the group) and baselines
    gathered_round    dynamic sampling under several ranks: every rank holds every group of a round
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vlrl.data import Sample
from vlrl.rewards import score_trajectories
from vlrl.rollout import Engine, Request, SamplingParams, Trajectory


@dataclass(frozen=True)
class Draw:
    """One prompt drawn from the data cursor: its ticket (unique per draw, in draw order), the sample, the
    cursor's epoch when it was drawn."""

    ticket: int
    sample: Sample
    epoch: int


@dataclass
class Group:
    """The n scored responses to one drawn prompt (and, for ReMax, the reward of its greedy response)."""

    trajectories: list[Trajectory]
    draw: Draw
    reward_failures: list[tuple[str, str]] = field(default_factory=list)  # (sample id, error) of failed verifiers
    baseline_reward: float | None = None

    @property
    def weight_version(self) -> int:
        return min(t.weight_version for t in self.trajectories)  # one request → one version; min to be safe


class PromptEncoder:
    """``engine.encode`` once per sample id (tokens and processor outputs are reused by every later draw)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._requests: dict[str, Request] = {}

    def __call__(self, sample: Sample) -> Request:
        request = self._requests.get(sample.id)
        if request is None:
            request = self._requests[sample.id] = self.engine.encode(sample)
        return request

    def forget(self, sample_ids: Sequence[str]) -> None:
        """Drop the encodings of samples that left the dataset (Syn-GRPO replaced them)."""
        for sample_id in sample_ids:
            self._requests.pop(sample_id, None)


def sampling_params(rollout: Any) -> SamplingParams:
    """How a `vlrl.config.RolloutConfig` samples: n responses per prompt at its temperature and budget."""
    return SamplingParams(n=rollout.n, temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                          max_new_tokens=rollout.max_new_tokens, stop=list(rollout.stop))


def greedy(sampling: SamplingParams) -> SamplingParams:
    """ReMax's baseline sampling: one greedy response, the same budget and stop strings."""
    return SamplingParams(n=1, temperature=0.0, max_new_tokens=sampling.max_new_tokens, stop=list(sampling.stop))


def score_groups(draws: Sequence[Draw], trajectories: Sequence[Trajectory], n: int,
                 baselines: Sequence[Trajectory] | None = None, *, strict: bool = True) -> list[Group]:
    """Score ``trajectories`` (n per draw, in draw order) and the greedy ``baselines`` (one per draw) with the
    samples' verifiers — ``strict`` (``algo.strict_reward``): a response that did not end or is not in its answer
    form earns no correctness reward — and cut them into groups. A verifier failure belongs to the first group of
    its sample."""
    report = score_trajectories([*trajectories, *(baselines or [])], strict=strict)
    groups = [Group(list(trajectories[k * n : (k + 1) * n]), draw,
                    baseline_reward=float(baselines[k].reward) if baselines is not None else None)
              for k, draw in enumerate(draws)]
    first = {}
    for group in groups:
        first.setdefault(group.draw.sample.id, group)
    for sample_id, error in report.failures:
        first[sample_id].reward_failures.append((sample_id, error))
    return groups


def flatten(groups: Sequence[Group]) -> tuple[list[Trajectory], torch.Tensor | None]:
    """The batch's trajectories, group by group, with ``group_index`` = the group's position in the batch, and
    (B,) the greedy reward of each response's prompt when the groups carry one (ReMax), else None."""
    trajectories = []
    for i, group in enumerate(groups):
        for t in group.trajectories:
            t.group_index = i
            trajectories.append(t)
    if not groups or groups[0].baseline_reward is None:
        return trajectories, None
    return trajectories, torch.tensor([g.baseline_reward for g in groups for _ in g.trajectories])


def gathered_round(draws: list[Draw], world_size: int, *, shard: Callable[[list[Draw]], list[Draw]],
                   generate: Callable[[list[Draw]], list[Group]],
                   gather: Callable[[list[Group]], list[list[Group]]]) -> list[Group]:
    """Dynamic sampling under several ranks: every rank generates and scores its share of the round's ``draws``
    and then holds *all* of the round's groups, in draw order — so every rank filters the same groups, keeps the
    same ones and carries the same surplus over, exactly as one process would; the step's kept groups are then
    sharded. A round that does not split evenly is padded with copies of its last draw (every rank generates the
    same number of prompts: FSDP2's generate is a collective), and the copies are dropped after the gather."""
    padded = draws + draws[-1:] * (-len(draws) % world_size)
    every = [group for part in gather(generate(shard(padded))) for group in part]  # rank order = draw order
    return every[: len(draws)]
