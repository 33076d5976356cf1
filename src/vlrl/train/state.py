"""What an RL loop carries over a restart beyond weights, optimizer, scheduler, data cursor and RNG: one typed record
(`RLState`) — the learner's `AlgorithmState` (shaper states, the critic) and its feed's state (`vlrl.feed.records`:
`SyncFeedState` or `AsyncFeedState`) — made of plain data so that a checkpoint can hold it in any format.

A checkpoint of one feed resumed by the other is refused by type (`expect_state`), naming the field to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlrl.feed.records import AsyncFeedState, SyncFeedState


@dataclass
class ShaperStates:
    """What each configured shaper returned as ``state`` at the last step (the shapers' own explicit data)."""

    reward_shaping: list[Any]
    advantage_shaping: list[Any]

    @classmethod
    def of(cls, algorithm: Any) -> ShaperStates:
        return cls(list(algorithm.reward_shaping.states), list(algorithm.advantage_shaping.states))

    def restore(self, algorithm: Any) -> None:
        for chain, saved in ((algorithm.reward_shaping, self.reward_shaping),
                             (algorithm.advantage_shaping, self.advantage_shaping)):
            if len(saved) != len(chain.states):
                raise ValueError(f"the checkpoint holds {len(saved)} {chain.field} shaper state(s), the config "
                                 f"configures {len(chain.states)}: resume with the same algo.*_shaping")
            chain.states = list(saved)


@dataclass
class AlgorithmState:
    """The state of ``stage.algo`` beyond the policy: shapers and the critic (weights, AdamW, scheduler)."""

    shapers: ShaperStates
    critic: dict[str, Any] | None

    @classmethod
    def of(cls, algorithm: Any) -> AlgorithmState:
        return cls(ShaperStates.of(algorithm), algorithm.critic.state_dict() if algorithm.critic is not None else None)

    def restore(self, algorithm: Any) -> None:
        self.shapers.restore(algorithm)
        if algorithm.critic is not None:
            algorithm.critic.load_state_dict(self.critic)


@dataclass
class RLState:
    """An RL loop's carry-over: the learner's and the feed's."""

    algorithm: AlgorithmState
    feed: SyncFeedState | AsyncFeedState


def expect_state(carry: Any, feed: type, resume_from: Path | None) -> RLState | None:
    """``carry`` if it is an `RLState` whose feed state is a ``feed`` (or None: a fresh start or a checkpoint without
    loop state); a checkpoint written by the other feed is refused, naming the setting that picks it."""
    if carry is None or (isinstance(carry, RLState) and isinstance(carry.feed, feed)):
        return carry
    written = carry.feed if isinstance(carry, RLState) else carry
    writer = {SyncFeedState: "synchronous", AsyncFeedState: "asynchronous"}.get(type(written), type(written).__name__)
    mode = {SyncFeedState: "sync", AsyncFeedState: "async"}.get(type(written), "?")
    raise ValueError(f"checkpoint.resume: {resume_from} was written by the {writer} recipe; resume it with "
                     f"rollout.mode={mode}")
