"""DAPO's informative-group filter (dynamic sampling, DAPO §3.2.2, eq. 11; verl ``filter_groups``): one object both
feeds use where groups reach them, so that no training loop knows DAPO exists — as in slime, where the filter runs
inside the rollout (its producer-side filter, ``rollout/sglang_rollout.py``).

    is_informative     a group whose rewards (or accuracies) all agree has zero advantage: it is not informative
    Cap                how far one step's search for informative groups may go, and what it counts
    InformativeFilter  one step: keep/drop accounting, the cap, the starved rule, the world-size trim, the
                       ``sampling/…`` metrics
    informative_filter the filter a recipe's ``algo.dynamic_sampling`` asks for (None when it is off)
    starved_warning    the line a recipe prints when a step found no informative group

Who feeds it: the synchronous feed's sampler (`vlrl.feed.sync.GroupSampler.next_batch`) the rounds it generates;
the asynchronous rollout's buffer (`vlrl.feed.async_rollout.GroupBuffer.take_batch`) the batches it dequeues,
returning the dropped groups' admission quota as it goes. Each feed hands the loop a batch and its ``sampling/…``
metrics.

A step: `InformativeFilter.begin` (with the informative groups carried over from the last step, if any), `offer`
groups until `done`, then `finish` — the batch, the informative surplus beyond it, the dropped groups and the
metrics. With nothing informative within the cap the step is *starved*: it trains ``prompts_per_step`` groups of
the last round offered — zero advantage, no policy gradient, the run goes on — logs ``sampling/starved`` = 1 and
the feed warns with `starved_warning`. (verl raises at its cap ``max_num_gen_batches``, stopping the run; a
starved step here costs one step and says which knobs to turn.) A batch left short at the cap is cut to a multiple
of the number of ranks, so that it splits evenly; the rest is surplus. With fewer informative groups than ranks (and
several ranks) the step trains them together with the last groups offered, cut the same way — none is also carried
over or put back (until 2026-11-28 the sync sampler trained such a group and carried it over too, and the async
buffer handed the ranks an empty batch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from vlrl.algos.filters import informative_groups
from vlrl.config import DynamicSamplingConfig
from vlrl.rollout import Trajectory


class Group(Protocol):
    """What the filter reads of a group (`vlrl.feed.groups.Group`): its scored responses."""

    trajectories: list[Trajectory]


def is_informative(group: Group, metric: str = "reward") -> bool:
    """True if the group's ``metric`` — the scalar reward, or the verifiers' accuracy (0 when none reports one) —
    is not the same for every response (DAPO eq. 11)."""
    values = [t.accuracy or 0.0 for t in group.trajectories] if metric == "accuracy" else \
        [t.reward for t in group.trajectories]
    scores = torch.tensor([float(v) for v in values])
    return bool(informative_groups(scores, torch.zeros(len(scores), dtype=torch.long)).all())


def starved_warning(step: int, metrics: dict[str, float], *, prompts_per_step: int) -> str:
    """The one line a recipe prints when dynamic sampling found no informative group at ``step`` (``metrics``: the
    step's ``sampling/…`` values): what happened, what the step did instead, and which knobs change it."""
    return (f"step {step}: dynamic sampling found no group with differing rewards in "
            f"{int(metrics['sampling/groups_dropped']) + prompts_per_step} groups; this step trains on "
            f"{prompts_per_step} of them (zero advantage: no policy gradient). If it persists, raise "
            "algo.dynamic_sampling.max_extra_rounds, rollout.n or rollout.temperature, keep informative prompts with "
            "`vlrl data select`, start from a better SFT checkpoint, or check the reward")


@dataclass(frozen=True)
class Cap:
    """How far one step's search for informative groups may go: the step stops offering groups once ``limit`` of
    what ``counts`` were spent (or the batch is full). Each recipe counts what it pays for:

    - ``"rounds"`` (the synchronous sampler): generation rounds, ``max_extra_rounds + 1`` per step — one round is
      one ``engine.generate`` call of ceil(missing × oversample) prompts, which the trainer waits for (verl's
      ``max_num_gen_batches``). Its metrics add the rounds, the prompts and samples generated and the carry-over.
    - ``"dropped"`` (the asynchronous buffer): uninformative groups dropped, ``(max_extra_rounds + 1) ×
      prompts_per_step`` per step. The buffer has no rounds: workers that never stop fill it group by group, and
      each dropped group is one replacement the trainer waits for. Its metrics are the dropped, used and starved
      counts (what was generated is the rollout's business, logged under ``rollout/…``).

    Both end a step the same way (`InformativeFilter.finish`): the batch is cut to a multiple of the ranks, and with
    fewer informative groups than ranks (none: the step is *starved*) it is filled up with the last groups offered."""

    counts: Literal["rounds", "dropped"]
    limit: int


@dataclass
class Filtered:
    """One step's outcome: the batch, the informative groups beyond it (the sampler carries them to its next
    step; the buffer puts them back), the uninformative groups dropped (the buffer returns their quota and the
    ledger files them as filtered), and the step's ``sampling/…`` metrics."""

    groups: list[Group]
    surplus: list[Group] = field(default_factory=list)
    dropped: list[Group] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


class InformativeFilter:
    """DAPO dynamic sampling for one step at a time: keeps the informative groups offered until the batch holds
    ``prompts_per_step`` of them or the `Cap` is spent (see the module docstring for the starved rule and the trim).
    ``world_size``: the ranks the batch is split over."""

    def __init__(self, config: DynamicSamplingConfig, cap: Cap, *, prompts_per_step: int, world_size: int = 1) -> None:
        self.metric, self.oversample = config.metric, config.oversample
        self.cap, self.prompts_per_step, self.world_size = cap, prompts_per_step, world_size
        self.begin()

    def begin(self, carried: Sequence[Group] = ()) -> None:
        """Start a step, with the informative groups ``carried`` over from the last one."""
        self.kept: list[Group] = list(carried)
        self.carried_in = len(self.kept)
        self.dropped: list[Group] = []  # this step's uninformative groups, in the order offered
        self.rounds = self.generated = self.samples = 0
        self.last: list[Group] = []  # the last groups offered (a starved step trains them)

    @property
    def missing(self) -> int:
        """Informative groups the batch still lacks."""
        return self.prompts_per_step - len(self.kept)

    def round_size(self) -> int:
        """Prompts the next generation round draws: ceil(missing × oversample)."""
        return math.ceil(self.missing * self.oversample)

    def done(self) -> bool:
        """The batch is full, or the cap is spent."""
        spent = self.rounds if self.cap.counts == "rounds" else len(self.dropped)
        return len(self.kept) >= self.prompts_per_step or spent >= self.cap.limit

    def offer(self, groups: Sequence[Group]) -> list[Group]:
        """One round (or dequeued batch) of scored groups: keep the informative ones; returns the dropped ones."""
        flags = [is_informative(g, self.metric) for g in groups]
        bad = [g for g, ok in zip(groups, flags, strict=True) if not ok]
        self.kept += [g for g, ok in zip(groups, flags, strict=True) if ok]
        self.dropped += bad
        self.rounds, self.generated = self.rounds + 1, self.generated + len(groups)
        self.samples += sum(len(g.trajectories) for g in groups)
        self.last = list(groups)
        return bad

    def finish(self) -> Filtered:
        """The step's batch: at most ``prompts_per_step`` kept groups, cut to a multiple of ``world_size`` (several
        ranks: a short batch still splits evenly). With fewer kept groups than ranks (none at all: *starved*) the
        batch is what was kept plus the last groups offered (zero advantage), cut the same way."""
        P, W = self.prompts_per_step, self.world_size
        usable = min(P, len(self.kept) - len(self.kept) % W)
        groups, surplus = self.kept[:usable], self.kept[usable:]
        starved = not self.kept
        if not groups:  # too few informative groups within the cap to split: fill up with the last ones offered
            pool = self.kept + [g for g in self.last if not _holds(self.kept, g)]
            groups = pool[: min(P, len(pool) - len(pool) % W)]
            surplus = [g for g in self.kept if not _holds(groups, g)]
            self.dropped = [g for g in self.dropped if not _holds(groups, g)]
        if self.cap.counts == "rounds":
            metrics = {"sampling/rounds": self.rounds, "sampling/prompts_generated": self.generated,
                       "sampling/samples_generated": self.samples, "sampling/groups_dropped": len(self.dropped),
                       "sampling/prompts_used": len(groups), "sampling/carried_in": self.carried_in,
                       "sampling/carried_over": len(surplus), "sampling/starved": float(starved)}
        else:
            metrics = {"sampling/groups_dropped": len(self.dropped), "sampling/prompts_used": len(groups),
                       "sampling/starved": float(starved)}
        return Filtered(groups, surplus, self.dropped, metrics)


def _holds(groups: Sequence[Group], group: Group) -> bool:
    return any(g is group for g in groups)


def informative_filter(config: DynamicSamplingConfig, counts: Literal["rounds", "dropped"], *, prompts_per_step: int,
                       world_size: int = 1) -> InformativeFilter | None:
    """The filter ``config`` (``algo.dynamic_sampling``) asks for, its cap counting ``counts`` (`Cap`): generation
    rounds for the synchronous sampler, dropped groups for the asynchronous buffer. None when it is off."""
    if not config.enabled:
        return None
    limit = config.max_extra_rounds + 1
    cap = Cap(counts, limit if counts == "rounds" else limit * prompts_per_step)
    return InformativeFilter(config, cap, prompts_per_step=prompts_per_step, world_size=world_size)
