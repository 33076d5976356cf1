"""The sampling front half both RL recipes share: draw prompts, generate n responses each, score them, keep the
informative groups, and flatten the kept groups into the step's batch.

    Draw / Group      a prompt drawn from the data cursor (ticket, sample, epoch) / its n scored responses
    PromptEncoder     each sample encoded once (token ids + processor outputs), for as long as it is in the data
    score_groups      score a round's responses (and ReMax's greedy responses) and cut them into groups
    is_informative    DAPO eq. 11: a group whose rewards (or accuracies) all agree has zero advantage
    starved_warning   the line a recipe prints when dynamic sampling found no informative group in a step
    flatten           groups → the batch's trajectories (``group_index`` = position of the group) and baselines
    GroupSampler      the synchronous recipe's steps 1–3; the asynchronous one keeps prompts in flight instead
                      (`vlrl.train.async_grpo.AsyncRollout`) and pushes the same `Group` records into its buffer

Dynamic sampling (DAPO §3.2.2, eq. 11; verl ``filter_groups``), synchronous recipe: generate a round of prompts,
drop the groups whose rewards are all equal (zero advantage, no gradient), and generate more rounds until the
batch holds ``prompts_per_step`` informative groups or ``max_extra_rounds`` extra rounds were spent. A round asks
for ``ceil(missing × oversample)`` prompts; informative groups beyond the batch are carried over to the next step
(they were sampled by weights one step older: the update treats them as on-policy, like verl). At the cap the step
trains on the informative groups it has; with none at all (a model that is always right or always wrong on these
prompts) it trains on ``prompts_per_step`` groups of the last round — zero advantage, no policy gradient, the run
goes on — logs ``sampling/starved`` = 1 and the recipe warns with `starved_warning`. (verl raises at its cap
``max_num_gen_batches``, stopping the run; a starved step here costs one step and says which knobs to turn.)

Under several ranks every rank holds the whole round (`gathered_round`): the ranks filter the same groups, keep
the same ones and carry the same surplus — what one process would — and the kept groups are then sharded. A
batch left short when the extra rounds run out is cut to a multiple of the number of ranks (the rest is carried).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vlrl.algos.filters import informative_groups
from vlrl.config import DynamicSamplingConfig
from vlrl.data import Sample
from vlrl.data.cursor import PromptCursor
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
                 baselines: Sequence[Trajectory] | None = None) -> list[Group]:
    """Score ``trajectories`` (n per draw, in draw order) and the greedy ``baselines`` (one per draw) with the
    samples' verifiers, and cut them into groups. A verifier failure belongs to the first group of its sample."""
    report = score_trajectories([*trajectories, *(baselines or [])])
    groups = [Group(list(trajectories[k * n : (k + 1) * n]), draw,
                    baseline_reward=float(baselines[k].reward) if baselines is not None else None)
              for k, draw in enumerate(draws)]
    first = {}
    for group in groups:
        first.setdefault(group.draw.sample.id, group)
    for sample_id, error in report.failures:
        first[sample_id].reward_failures.append((sample_id, error))
    return groups


def is_informative(group: Group, metric: str = "reward") -> bool:
    """True if the group's ``metric`` — the scalar reward, or the verifiers' accuracy (0 when none reports one) —
    is not the same for every response (DAPO eq. 11)."""
    values = [t.accuracy or 0.0 for t in group.trajectories] if metric == "accuracy" else \
        [t.reward for t in group.trajectories]
    scores = torch.tensor([float(v) for v in values])
    return bool(informative_groups(scores, torch.zeros(len(scores), dtype=torch.long)).all())


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


def starved_warning(step: int, metrics: dict[str, float], *, prompts_per_step: int) -> str:
    """The one line a recipe prints when dynamic sampling found no informative group at ``step`` (``metrics``: the
    step's ``sampling/…`` values): what happened, what the step did instead, and which knobs change it."""
    return (f"step {step}: dynamic sampling found no group with differing rewards in "
            f"{int(metrics['sampling/groups_dropped']) + prompts_per_step} groups; this step trains on "
            f"{prompts_per_step} of them (zero advantage: no policy gradient). If it persists, raise "
            "algo.dynamic_sampling.max_extra_rounds, rollout.n or rollout.temperature, keep informative prompts with "
            "`vlrl data select`, start from a better SFT checkpoint, or check the reward")


@dataclass
class SampledBatch:
    groups: list[Group]
    metrics: dict[str, float] = field(default_factory=dict)  # dynamic sampling's ``sampling/…``


class GroupSampler:
    """Steps 1–3 of the synchronous recipe: draws prompts from ``cursor`` and returns one step's scored groups."""

    def __init__(self, engine: Engine, cursor: PromptCursor, sampling: SamplingParams, *, prompts_per_step: int,
                 dynamic: DynamicSamplingConfig, greedy_baseline: bool = False,
                 shard: Callable[[list[Any]], list[Any]] | None = None,
                 gather: Callable[[list[Group]], list[list[Group]]] | None = None, world_size: int = 1) -> None:
        """``shard``: under torchrun, keeps this rank's share of the prompts every rank drew (same cursor).
        ``gather`` / ``world_size``: every rank's groups, in rank order (dynamic sampling under several ranks
        filters the whole round: `gathered_round`)."""
        self.engine, self.cursor, self.sampling = engine, cursor, sampling
        self.shard = shard or (lambda draws: draws)
        self.gather, self.world_size = gather, world_size
        self.prompts_per_step, self.dynamic, self.greedy_baseline = prompts_per_step, dynamic, greedy_baseline
        self.encode = PromptEncoder(engine)
        self.carry: list[Group] = []  # informative groups left over from the previous step
        self.drawn = 0  # tickets issued

    def next_batch(self) -> SampledBatch:
        if not self.dynamic.enabled:
            return SampledBatch(self._round(self.prompts_per_step))
        P = self.prompts_per_step
        kept, carried_in = self.carry, len(self.carry)
        self.carry = []
        rounds = generated = dropped = 0
        groups: list[Group] = []
        while len(kept) < P and rounds <= self.dynamic.max_extra_rounds:
            groups = self._whole_round(math.ceil((P - len(kept)) * self.dynamic.oversample))
            rounds, generated = rounds + 1, generated + len(groups)
            informative = [g for g in groups if is_informative(g, self.dynamic.metric)]
            dropped += len(groups) - len(informative)
            kept = kept + informative
        usable = min(P, len(kept) - len(kept) % self.world_size)  # several ranks: a short batch still splits evenly
        kept, self.carry = kept[:usable], kept[usable:]
        starved = not kept
        if starved:  # nothing informative within the cap: go on with the last round's (zero-advantage) groups
            kept, dropped = groups[:P], dropped - len(groups[:P])
        return SampledBatch(self.shard(kept) if self.world_size > 1 else kept, {  # (every rank kept the same groups)
            "sampling/rounds": rounds, "sampling/prompts_generated": generated,
            "sampling/samples_generated": generated * self.sampling.n, "sampling/groups_dropped": dropped,
            "sampling/prompts_used": len(kept), "sampling/carried_in": carried_in,
            "sampling/carried_over": len(self.carry), "sampling/starved": float(starved)})

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
        return score_groups(draws, trajectories, self.sampling.n, baselines)


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
