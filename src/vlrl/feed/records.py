"""What a feed carries over a restart, as plain data (tensors, numbers, strings, `Sample` records, `Turn` records) so
that a checkpoint can hold it in any format (`vlrl.train.carry`):

    SyncFeedState   the synchronous feed: the draw counter, dynamic sampling's carried-over groups, Syn-GRPO's
                    dataset and client (`vlrl.synth.workflow.SynthState`)
    AsyncFeedState  the asynchronous feed: the ticket ledger and the rollout's cut (undrained groups with their
                    weight versions, re-queued and in-flight draws, counters), Syn-GRPO's state

`GroupRecord` is a scored group as plain data: the live `Group` holds `Trajectory` objects (PIL images, shared
`VisionInputs`); its record keeps what training needs — token ids, masks, behaviour log-probs, the images'
processor outputs (each distinct one once: the n responses of a prompt share theirs), weight version, status,
reward, accuracy, sub-scores, turns — and `restore` rebuilds the group (without the PIL images, which only
reports use).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vlrl.data import Sample
from vlrl.feed.groups import Draw, Group
from vlrl.models.adapters import VisionInputs
from vlrl.rollout import Status, Trajectory
from vlrl.rollout.types import Turn


# ----------------------------------------------------------------------------------------------- groups
@dataclass
class ResponseRecord:
    """One scored response as plain data (a `Trajectory` without its sample, images and group index)."""

    prompt_ids: torch.Tensor  # (P,)
    response_ids: torch.Tensor  # (R,)
    loss_mask: torch.Tensor  # (R,)
    behaviour_logp: torch.Tensor  # (R,)
    vision: int  # index into `GroupRecord.visions`; -1: no image
    weight_version: int
    status: str  # a `Status` value
    response_text: str
    reward: float | None
    accuracy: float | None
    reward_parts: dict[str, float]
    turns: list[Turn]
    stop_reason: str = ""
    error: str = ""
    token_versions: torch.Tensor | None = None  # (R,) the version of each token (partial rollout); None: weight_version


@dataclass
class GroupRecord:
    """A scored `Group` as plain data (see the module docstring)."""

    ticket: int
    epoch: int
    sample: Sample
    responses: list[ResponseRecord]
    visions: list[VisionInputs]  # each distinct processor output of the group's responses, once
    baseline_reward: float | None = None
    reward_failures: list[tuple[str, str]] = field(default_factory=list)

    @classmethod
    def of(cls, group: Group) -> GroupRecord:
        visions: list[VisionInputs] = []
        responses = []
        for t in group.trajectories:
            index = -1
            if t.vision is not None:
                index = next((k for k, v in enumerate(visions) if v is t.vision), -1)
                if index < 0:
                    visions.append(t.vision)
                    index = len(visions) - 1
            responses.append(ResponseRecord(
                prompt_ids=t.prompt_ids, response_ids=t.response_ids, loss_mask=t.loss_mask,
                behaviour_logp=t.behaviour_logp, vision=index, weight_version=t.weight_version, status=t.status.value,
                response_text=t.response_text, reward=t.reward, accuracy=t.accuracy, reward_parts=dict(t.reward_parts),
                turns=list(t.turns), stop_reason=t.stop_reason, error=t.error, token_versions=t.token_versions))
        return cls(group.draw.ticket, group.draw.epoch, group.draw.sample, responses, visions, group.baseline_reward,
                   list(group.reward_failures))

    def restore(self) -> Group:
        """The live group: responses that shared processor outputs share one `VisionInputs` object again."""
        trajectories = [Trajectory(
            sample=self.sample, prompt_ids=r.prompt_ids, response_ids=r.response_ids, loss_mask=r.loss_mask,
            behaviour_logp=r.behaviour_logp, vision=self.visions[r.vision] if r.vision >= 0 else None,
            weight_version=r.weight_version, status=Status(r.status), response_text=r.response_text, reward=r.reward,
            accuracy=r.accuracy, reward_parts=dict(r.reward_parts), turns=list(r.turns), stop_reason=r.stop_reason,
            error=r.error, token_versions=r.token_versions) for r in self.responses]
        return Group(trajectories, self.draw(), list(self.reward_failures), self.baseline_reward)

    def draw(self) -> Draw:
        return Draw(self.ticket, self.sample, self.epoch)


@dataclass
class DrawRecord:
    """A drawn prompt not yet in any group (re-queued, or in flight at a checkpoint)."""

    ticket: int
    epoch: int
    sample: Sample

    @classmethod
    def of(cls, draw: Draw) -> DrawRecord:
        return cls(draw.ticket, draw.epoch, draw.sample)

    def restore(self) -> Draw:
        return Draw(self.ticket, self.sample, self.epoch)


# ----------------------------------------------------------------------------------------------- the feeds' states
@dataclass
class Ledger:
    """Where every drawn prompt (by draw ticket) went: trained, discarded as stale, or filtered as uninformative."""

    trained: list[int] = field(default_factory=list)
    discarded: list[int] = field(default_factory=list)
    filtered: list[int] = field(default_factory=list)

    def copy(self) -> Ledger:
        return Ledger(list(self.trained), list(self.discarded), list(self.filtered))


@dataclass
class RolloutCut:
    """The asynchronous rollout at a checkpoint: each drawn ticket is in exactly one of the lists or the ledger."""

    drawn: int  # tickets issued
    requeued: int  # prompts sent back to the queue so far
    started: int  # prompts counted against the admission limit (in-flight ones given back)
    requeue: list[DrawRecord]
    in_flight: list[DrawRecord]  # generated again after a resume
    buffer: list[GroupRecord]  # undrained, oldest first


@dataclass
class SyncFeedState:
    """What the synchronous feed carries over a restart (`vlrl.feed.sync.SyncFeed.state`)."""

    drawn: int  # draw tickets issued so far
    carry: list[GroupRecord]  # dynamic sampling's informative groups left over for the next step
    synth: Any = None  # Syn-GRPO's `vlrl.synth.workflow.SynthState` (synth.enabled), else None


@dataclass
class AsyncFeedState:
    """What the asynchronous feed carries over a restart (`vlrl.feed.asynchronous.AsyncFeed.state`): the ticket
    ledger and the rollout's cut (rank 0's under torchrun; the other ranks' are empty)."""

    ledger: Ledger
    rollout: RolloutCut
    synth: Any = None  # Syn-GRPO's `vlrl.synth.workflow.SynthState` (synth.enabled), else None
