"""The synchronous feed: each step draws prompts, generates n responses each on the latest weights and scores them —
the step's generation is the step's wait (slime's ``train.py``: the rollout is awaited at once).

    GroupSampler    draw → generate → score, with DAPO dynamic sampling's rounds (below)
    SyncFeed        the sampler, Syn-GRPO, and the weight update after every step (`vlrl.feed.publish`)

Dynamic sampling (DAPO §3.2.2, eq. 11; verl ``filter_groups``): `GroupSampler.next_batch` feeds rounds of
``ceil(missing × oversample)`` prompts to the informative-group filter (`vlrl.feed.informative.InformativeFilter`:
the informative test, the cap of ``max_extra_rounds`` extra rounds, the starved rule, the trim) until the batch holds
``prompts_per_step`` informative groups or the cap is spent. Informative groups beyond the batch are carried over to
the next step (`GroupSampler.carry`; they were sampled by weights one step older: the update treats them as
on-policy, like verl).

Under several ranks every rank holds the whole round (`vlrl.feed.groups.gathered_round`): the ranks filter the same
groups, keep the same ones and carry the same surplus — what one process would — and the kept groups are then
sharded. A batch left short when the extra rounds run out is cut to a multiple of the number of ranks (the rest is
carried).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from vlrl.config import DynamicSamplingConfig
from vlrl.data.cursor import PromptCursor
from vlrl.feed.groups import (
    Draw,
    Group,
    PromptEncoder,
    flatten,
    gathered_round,
    greedy,
    sampling_params,
    score_groups,
)
from vlrl.feed.informative import informative_filter, starved_warning
from vlrl.feed.publish import update_in_place
from vlrl.feed.records import GroupRecord, SyncFeedState
from vlrl.feed.types import FeedBatch, FeedLogger, Ranks, Weights
from vlrl.rollout.types import Engine, SamplingParams
from vlrl.synth.workflow import restore_synthesis, start_synthesis


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


class SyncFeed:
    """The synchronous `vlrl.feed.types.Feed` (module docstring): prompts ``samples`` (Syn-GRPO: its rewritten
    dataset), drawn with ``seed``; ``ranks``: under torchrun each rank generates its share of every step's prompts."""

    state_type = SyncFeedState
    shown = ("reward/mean", "accuracy/mean", "policy/entropy", "perf/step_seconds")

    def __init__(self, engine: Engine, samples: list[Any], stage: Any, *, seed: int, logger: FeedLogger, ranks: Ranks,
                 greedy_baseline: bool) -> None:
        self.engine, self.logger, self.prompts_per_step = engine, logger, stage.train.prompts_per_step
        self.synthesis = start_synthesis(stage.synth, samples, seed=seed, logger=logger, ctx=ranks)  # or None
        self.cursor = PromptCursor(self.synthesis.dataset if self.synthesis is not None else samples, seed)
        self.sampler = GroupSampler(engine, self.cursor, sampling_params(stage.rollout),
                                    prompts_per_step=stage.train.prompts_per_step, dynamic=stage.algo.dynamic_sampling,
                                    greedy_baseline=greedy_baseline,
                                    shard=lambda draws: ranks.shard(draws, what="train.prompts_per_step"),
                                    gather=ranks.gather_objects, world_size=ranks.world_size,
                                    strict=stage.algo.strict_reward)

    def start(self, step: int, weights: Weights) -> None:
        """A resumed run: the engine samples from the restored weights, as version ``step``."""
        if step:
            update_in_place(self.engine, step)

    def next_batch(self, step: int) -> FeedBatch:
        """Prompts (this rank's share) → n responses each → rewards, as groups (DAPO: its rounds)."""
        start = time.time()
        sampled = self.sampler.next_batch()
        if sampled.metrics.get("sampling/starved"):
            self.logger.warn(starved_warning(step + 1, sampled.metrics, prompts_per_step=self.prompts_per_step))
        trajectories, baselines = flatten(sampled.groups)
        return FeedBatch(sampled.groups, trajectories, baselines, None,
                         {**sampled.metrics, "perf/gen_seconds": time.time() - start})

    def publish(self, version: int, weights: Weights) -> None:
        update_in_place(self.engine, version)

    def aside(self) -> AbstractContextManager[None]:
        """An evaluation within the run: the engine already samples from the trainer's weights; nothing to hold."""
        return nullcontext()

    def finish_step(self, batch: FeedBatch, step: int, shaping: Any) -> dict[str, float]:
        """Syn-GRPO: send the chosen descriptions, swap finished images in (never waits); the sampling metrics."""
        metrics: dict[str, float] = {}
        if self.synthesis is not None:
            metrics.update(self.synthesis.after_step(batch.trajectories, step, shaping=shaping))
            self.sampler.encode.forget(self.synthesis.retired())
        return {**metrics, **batch.metrics}

    def state(self) -> tuple[PromptCursor, SyncFeedState]:
        """(the data cursor, the draw counter, dynamic sampling's surplus groups, Syn-GRPO's state)."""
        return self.cursor, SyncFeedState(self.sampler.drawn, [GroupRecord.of(g) for g in self.sampler.carry],
                                          self.synthesis.state() if self.synthesis is not None else None)

    def load_state(self, state: SyncFeedState, source: Any) -> None:
        """Continue from a checkpoint's `state` (the cursor is restored with the checkpoint's weights)."""
        self.sampler.carry, self.sampler.drawn = [g.restore() for g in state.carry], state.drawn
        restore_synthesis(self.synthesis, state.synth, source)  # the rewritten dataset, the client's jobs

    def final_state(self) -> dict[str, Any]:
        return {"cursor": self.cursor.state(), "drawn": self.sampler.drawn}

    def close(self, drained: bool) -> None:
        if self.synthesis is not None:
            self.synthesis.close()
