"""The feed's records and protocols: `FeedBatch` (what the loop trains on), `Feed` (the five calls and what a checkpoint
reads), and what a feed is given — `FeedLogger`, `Ranks`, the trainer's `Weights`."""


from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from vlrl.feed.groups import Group
from vlrl.rollout.types import Trajectory

Weights = Callable[[], dict[str, torch.Tensor]]  # the trainer's full state dict (a collective under FSDP2)


@dataclass
class FeedBatch:
    """One step's training data as the feed hands it over: this rank's share of whole groups.

    Attributes:
        groups: the scored groups.
        trajectories: their responses, group by group (``group_index`` = the group's position).
        baselines: (B,) ReMax's greedy reward of each response's prompt, else None.
        staleness: (B,) the trainer's version minus the weight version of each response's oldest token (async),
            or None — on-policy by construction (sync; dynamic sampling's carried groups count as on-policy, as
            in verl).
        metrics: the feed's ``sampling/…`` metrics of the step and its timing (``perf/gen_seconds`` or
            ``perf/wait_seconds``).
    """

    groups: list[Group]
    trajectories: list[Trajectory]
    baselines: torch.Tensor | None = None
    staleness: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class FeedLogger(Protocol):
    """What a feed says: a line, a warning; ``path``: the run's metrics file (Syn-GRPO writes its gallery beside it)."""

    path: Path | None

    def info(self, message: str) -> None: ...

    def warn(self, message: str) -> None: ...


class Ranks(Protocol):
    """The trainer's processes as a feed uses them (`vlrl.train.distributed.DistContext`)."""

    rank: int
    world_size: int

    @property
    def enabled(self) -> bool: ...

    @property
    def is_main(self) -> bool: ...

    def shard(self, items: Sequence[Any], *, what: str) -> list[Any]: ...

    def gather_objects(self, obj: Any) -> list[Any]: ...


class Feed(Protocol):
    """See the module docstring."""

    cursor: Any  # the data cursor (`vlrl.data.cursor.PromptCursor`) a checkpoint restores
    state_type: type  # the record `state` returns (`SyncFeedState`, `AsyncFeedState`)
    shown: tuple[str, ...]  # the metrics shown on the console at each log

    def start(self, step: int, weights: Weights) -> None: ...

    def next_batch(self, step: int) -> FeedBatch: ...

    def publish(self, version: int, weights: Weights) -> None: ...

    def aside(self) -> AbstractContextManager[None]: ...

    def finish_step(self, batch: FeedBatch, step: int, shaping: Any) -> dict[str, float]: ...

    def state(self) -> tuple[Any, Any]: ...

    def load_state(self, state: Any, source: Any) -> None: ...

    def final_state(self) -> dict[str, Any]: ...

    def close(self, drained: bool) -> None: ...


