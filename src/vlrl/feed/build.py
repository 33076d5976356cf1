"""`build_feed`: the one place a feed is built, from a stage's ``rollout.mode``."""

from __future__ import annotations

from typing import Any

from vlrl.feed.asynchronous import AsyncFeed
from vlrl.feed.sync import SyncFeed
from vlrl.feed.types import Feed, FeedLogger, Ranks


def build_feed(engine: Any, samples: list[Any], stage: Any, *, seed: int, logger: FeedLogger, ranks: Ranks,
               greedy_baseline: bool) -> Feed:
    """The feed of ``stage.rollout.mode``: `SyncFeed` or `AsyncFeed` over ``engine`` and ``samples`` (the first
    ``train.max_samples``). ``greedy_baseline``: ReMax's estimator needs one greedy response per prompt too."""
    samples = samples[: stage.train.max_samples] if stage.train.max_samples is not None else samples
    feed = AsyncFeed if stage.rollout.mode == "async" else SyncFeed
    return feed(engine, samples, stage, seed=seed, logger=logger, ranks=ranks, greedy_baseline=greedy_baseline)
