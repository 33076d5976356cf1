"""The sampling front half both RL recipes share: draw prompts, generate n responses each, score them, keep the
informative groups, and flatten the kept groups into the step's batch.

    Draw / Group      a prompt drawn from the data cursor (ticket, sample, epoch) / its n scored responses
    PromptEncoder     each sample encoded once (token ids + processor outputs), for as long as it is in the data
    score_groups      score a round's responses (and ReMax's greedy responses) and cut them into groups
    flatten           groups → the batch's trajectories (``group_index`` = position of the group) and baselines
    GroupSampler      the synchronous recipe's steps 1–3; the asynchronous one keeps prompts in flight instead
                      (`vlrl.train.async_grpo.AsyncRollout`) and pushes the same `Group` records into its buffer

Dynamic sampling (DAPO §3.2.2, eq. 11; verl ``filter_groups``), synchronous recipe: `GroupSampler.next_batch`
feeds rounds of ``ceil(missing × oversample)`` prompts to the informative-group filter
(`vlrl.train.informative.InformativeFilter`: the informative test, the cap of ``max_extra_rounds`` extra rounds,
the starved rule, the trim) until the batch holds ``prompts_per_step`` informative groups or the cap is spent.
Informative groups beyond the batch are carried over to the next step (`GroupSampler.carry`; they were sampled by
weights one step older: the update treats them as on-policy, like verl).

Under several ranks every rank holds the whole round (`gathered_round`): the ranks filter the same groups, keep
the same ones and carry the same surplus — what one process would — and the kept groups are then sharded. A
batch left short when the extra rounds run out is cut to a multiple of the number of ranks (the rest is carried).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vlrl.config import DynamicSamplingConfig
from vlrl.data import Sample
from vlrl.data.cursor import PromptCursor
from vlrl.rewards import score_trajectories
from vlrl.rollout import Engine, Request, SamplingParams, Trajectory
from vlrl.train.informative import informative_filter


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


@dataclass
class SampledBatch:
    groups: list[Group]
    metrics: dict[str, float] = field(default_factory=dict)  # dynamic sampling's ``sampling/…``


class GroupSampler:
    """Steps 1–3 of the synchronous recipe: draws prompts from ``cursor`` and returns one step's scored groups."""

    def __init__(self, engine: Engine, cursor: PromptCursor, sampling: SamplingParams, *, prompts_per_step: int,
                 dynamic: DynamicSamplingConfig, greedy_baseline: bool = False,
                 shard: Callable[[list[Any]], list[Any]] | None = None,
                 gather: Callable[[list[Group]], list[list[Group]]] | None = None, world_size: int = 1,
                 strict: bool = True) -> None:
        """``shard``: under torchrun, keeps this rank's share of the prompts every rank drew (same cursor).
        ``gather`` / ``world_size``: every rank's groups, in rank order (dynamic sampling under several ranks
        filters the whole round: `gathered_round`). ``strict``: `score_groups`'."""
        self.engine, self.cursor, self.sampling, self.strict = engine, cursor, sampling, strict
        self.shard = shard or (lambda draws: draws)
        self.gather, self.world_size = gather, world_size
        self.prompts_per_step, self.greedy_baseline = prompts_per_step, greedy_baseline
        self.filter = informative_filter(dynamic, "rounds", prompts_per_step=prompts_per_step, world_size=world_size)
        self.encode = PromptEncoder(engine)
        self.carry: list[Group] = []  # informative groups left over from the previous step
        self.drawn = 0  # tickets issued

    def next_batch(self) -> SampledBatch:
        if self.filter is None:
            return SampledBatch(self._round(self.prompts_per_step))
        self.filter.begin(self.carry)
        while not self.filter.done():
            self.filter.offer(self._whole_round(self.filter.round_size()))
        step = self.filter.finish()
        self.carry = step.surplus
        # (every rank kept the same groups: `gathered_round`)
        return SampledBatch(self.shard(step.groups) if self.world_size > 1 else step.groups, step.metrics)

    def draw(self) -> Draw:
        sample = self.cursor.next(1)[0]
        self.drawn += 1
        return Draw(self.drawn - 1, sample, self.cursor.epoch)

    def _whole_round(self, count: int) -> list[Group]:
        """A round of dynamic sampling: every drawn group on every rank (see `gathered_round`)."""
        if self.world_size == 1:
            return self._round(count)
        return gathered_round([self.draw() for _ in range(count)], self.world_size, shard=self.shard,
                              generate=self._generate, gather=self.gather)

    def _round(self, count: int) -> list[Group]:
        """Draw ``count`` prompts, sample ``n`` responses each, score them (and their greedy responses)."""
        return self._generate(self.shard([self.draw() for _ in range(count)]))

    def _generate(self, draws: list[Draw]) -> list[Group]:
        requests = [self.encode(d.sample) for d in draws]
        trajectories = self.engine.generate(requests, self.sampling)
        baselines = self.engine.generate(requests, greedy(self.sampling)) if self.greedy_baseline else None
        return score_groups(draws, trajectories, self.sampling.n, baselines, strict=self.strict)


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
