"""The records and the protocols of rollout: `Trajectory`, `SamplingParams`, `Request`; `Engine` and its capabilities.

`Trajectory` is the one record that crosses from rollout to training. Its tensors are aligned with the
response: ``response_ids[j]``, ``loss_mask[j]`` and ``behaviour_logp[j]`` all describe response token j.

Every engine generates synchronously (`Engine`). What some engines can do besides is a protocol of its own, and a
recipe asks for it with `capability` — never by looking for a method or walking the wrappers itself:

    `AgentEngine`       encodes observations and decodes tokens (multi-turn episodes)
    `AsyncEngine`       ``agenerate``, awaitable (the asynchronous recipe)              ThreadedEngine, HTTPEngine
    `WeightPublisher`   publishes weights in the background; shares its servers with    HTTPEngine
                        the other trainer ranks
    `EngineWrapper`     an engine around another (the rollout function's `RolloutEngine`, the report's watcher):
                        it says which of the inner engine's capabilities it passes on (`EngineWrapper.offer`)
    `BatchObserver`     is shown the trajectories a step trains on when they were generated out of its sight      WatchedEngine
                        (asynchronously, through the inner engine's ``agenerate``)
"""

from __future__ import annotations

import concurrent.futures
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
from PIL import Image

from vlrl.data.sample import Sample
from vlrl.models.adapters import VisionInputs


class Status(str, enum.Enum):
    COMPLETED = "completed"  # the model stopped by itself (EOS or a stop string)
    TRUNCATED = "truncated"  # hit max_new_tokens (or a multi-turn token budget)
    FAILED = "failed"  # an environment/tool error exhausted its retries; excluded from the loss
    ABORTED = "aborted"  # cancelled (e.g. by a weight update); re-queued, never trained on


@dataclass
class SamplingParams:
    """How to sample. ``temperature == 0`` means greedy."""

    n: int = 1  # samples per prompt (the GRPO group size)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 32
    stop: list[str] = field(default_factory=list)  # extra stop strings besides EOS
    stop_token_ids: list[int] = field(default_factory=list)  # extra stop tokens besides the model's EOS
    logit_bias: dict[int, float] = field(default_factory=dict)  # {token id: bias added to its logit before sampling}


@dataclass
class Request:
    """One prompt to sample from: the sample, its prompt token ids and its vision inputs. ``max_new_tokens``: this
    request's own budget of new tokens when it is below ``SamplingParams.max_new_tokens`` — a generation continued
    after a weight update (its prompt then ends with the tokens it kept) has only what it had left; None: the
    sampling's."""

    sample: Sample
    prompt_ids: list[int]
    vision: VisionInputs | None = None
    images: list[Image.Image] = field(default_factory=list)
    max_new_tokens: int | None = None


@dataclass
class Turn:
    """One model turn of a multi-turn trajectory and the environment's answer to it.

    Spans index ``Trajectory.response_ids``: the model's tokens are ``[action_start, action_end)`` (loss mask
    1), the observation appended after them is ``[action_end, observation_end)`` (loss mask 0; empty when
    the episode ended on this turn).
    """

    action_start: int
    action_end: int
    observation_end: int
    text: str = ""  # the model's text of this turn (special tokens skipped)
    reward: float | None = None  # a per-step reward the environment reported in ``info["reward"]``
    env_retries: int = 0  # failed environment calls (raised or timed out) before this turn's step succeeded
    num_images: int = 0  # images the observation of this turn added
    info: dict[str, float] = field(default_factory=dict)  # numeric ``info`` the environment returned (e.g. zoom_call)


@dataclass
class Trajectory:
    """One sampled response with everything training needs.

    Attributes:
        sample: the prompt's Sample (answer, reward name, metadata).
        prompt_ids: (P,) prompt token ids.
        response_ids: (R,) everything after the prompt (model tokens, and in multi-turn, observations).
        loss_mask: (R,) 1 = the model's own token (trained on), 0 = observation / tool output.
        behaviour_logp: (R,) log-prob of each response token under the policy that sampled it, recorded at
            sampling time (temperature applied); 0 where ``loss_mask`` is 0.
        vision: processor outputs of every image of the sequence, all turns, in order.
        images: the decoded images (for reports and for re-encoding by another engine).
        weight_version: version of the weights that produced the trajectory — of its oldest token when its tokens
            span several versions (``token_versions``), so staleness and the η bound count from the oldest.
        status: see `Status`.
        response_text: the decoded response (model tokens only, special tokens skipped).
        group_index: index of the prompt within its batch; the n samples of a prompt share it.
        reward: scalar reward (filled by the reward stage).
        accuracy: whether the response is correct (1 / 0, or a fraction for a weighted sum of verifiers) — the
            reward's `RewardOutput.accuracy`; None when no verifier of the sample reports one (filled with
            ``reward``).
        well_formed: the response ended (status completed) and has its sample's declared answer form
            (`vlrl.rewards.score_trajectories`); None until scored.
        reward_parts: named sub-scores of the reward (``overall``, ``accuracy``, ``format``, ...), for logging.
        turns: multi-turn only: one `Turn` per model turn (boundaries, per-step rewards, retries); empty
            for a single-turn response.
        stop_reason: multi-turn only (empty for a single-turn response): why the episode ended: ``done``
            (the environment ended it), ``max_turns``, ``token_budget`` (TRUNCATED), ``env_failed`` (retries
            exhausted, FAILED), ``env_timeout`` (FAILED after hangs), ``observation_error`` (an observation
            that cannot be encoded, FAILED) or ``aborted``.
        error: what went wrong, for a FAILED trajectory.
        token_versions: (R,) long, the weight version that sampled each response token: a generation interrupted
            by a weight update and continued on the new weights with its tokens kept
            (``rollout.servers.on_weight_update=partial``) holds two or more. None: every token is
            ``weight_version``'s (`versions` gives the tensor either way).
        prompt_logp: (P,) float, log π(prompt_ids[j] | prompt_ids[:j]) at temperature 1 for the prompt tokens a
            request asked scored (a server's SGLang ``logprob_start_len``: j > start), NaN elsewhere (every j ≤ start,
            j = 0 always); None when nobody asked (`vlrl.rollout.batcher.score_prompts`).
    """

    sample: Sample
    prompt_ids: torch.Tensor
    response_ids: torch.Tensor
    loss_mask: torch.Tensor
    behaviour_logp: torch.Tensor
    vision: VisionInputs | None = None
    images: list[Image.Image] = field(default_factory=list)
    weight_version: int = 0
    status: Status = Status.COMPLETED
    response_text: str = ""
    group_index: int = 0
    reward: float | None = None
    accuracy: float | None = None
    well_formed: bool | None = None
    reward_parts: dict[str, float] = field(default_factory=dict)
    turns: list[Turn] = field(default_factory=list)
    stop_reason: str = ""
    error: str = ""
    token_versions: torch.Tensor | None = None
    prompt_logp: torch.Tensor | None = None

    @property
    def versions(self) -> torch.Tensor:
        """(R,) long: the weight version of each response token (``token_versions``, else ``weight_version``'s)."""
        if self.token_versions is not None:
            return self.token_versions
        return torch.full((len(self.response_ids),), self.weight_version, dtype=torch.long)

    @property
    def num_turns(self) -> int:
        return max(1, len(self.turns))

    @property
    def env_retries(self) -> int:
        return sum(t.env_retries for t in self.turns)

    @property
    def response_length(self) -> int:
        return int(self.loss_mask.sum())


@runtime_checkable
class Engine(Protocol):
    """Generates trajectories. In-process (`HFEngine`) or remote (an SGLang-compatible server)."""

    weight_version: int

    def encode(self, sample: Sample) -> Request:
        """Render, tokenize and process the images of a sample into a `Request`."""
        ...

    def generate(self, requests: Sequence[Request], sampling: SamplingParams) -> list[Trajectory]:
        """Sample ``sampling.n`` responses per request; returns ``len(requests) * n`` trajectories in
        request order, the n samples of request i carrying ``group_index == i``."""
        ...

    def update_weights(self, *, version: int, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Load new weights (or, for an engine sharing the trainer's model, just adopt ``version``)."""
        ...


@runtime_checkable
class AgentEngine(Engine, Protocol):
    """An `Engine` that can also run multi-turn episodes (`vlrl.rollout.agent`): it encodes observations
    for its own model family and decodes token ids."""

    def encode_observation(self, messages: list[dict], *, last_token: int | None, tools: list[dict] | None = None):
        """Token ids + vision inputs (an `EncodedPrompt`) of observation ``messages`` appended after a model turn
        whose last token was ``last_token`` (a turn not ended by EOS is closed first)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids, special tokens skipped."""
        ...


@runtime_checkable
class AsyncEngine(Engine, Protocol):
    """An `Engine` that can also be awaited (what the asynchronous recipe needs)."""

    async def agenerate(self, requests: Sequence[Request], sampling: SamplingParams) -> list[Trajectory]:
        """Same contract as `Engine.generate`; trajectories carry the version that produced them and
        ``Status.ABORTED`` when a weight update aborted them."""
        ...

    def close(self) -> None:
        ...


@runtime_checkable
class WeightPublisher(Protocol):
    """An engine whose weights live elsewhere (rollout servers): it publishes the trainer's weights without waiting
    for them to be loaded, and under torchrun it is shared by the trainer ranks (each generates its share on the
    same servers; a weight update is then a collective call of every rank)."""

    world_size: int  # trainer ranks sharing the servers (1 until `join_trainer_ranks`)

    def publish(self, *, version: int, state_dict: dict[str, torch.Tensor] | None = None) -> concurrent.futures.Future:
        """Start a weight update to ``version``; the future resolves to ``version`` once the rollout side has it
        (``weight_version`` is bumped then), or raises the update's error."""
        ...

    def join_trainer_ranks(self, rank: int, world_size: int) -> None:
        """This engine is rank ``rank``'s of ``world_size`` trainer ranks (the default torch.distributed group)."""
        ...


@runtime_checkable
class BatchObserver(Protocol):
    """An engine wrapper that records what is trained on (the report's watcher: samples.jsonl's training snapshots)
    and must be shown the batches an asynchronous feed generated through the inner engine."""

    def observe(self, trajectories: Sequence[Trajectory], label: str, step: int) -> None:
        """The trajectories step ``step`` trains on (its weights become version ``step + 1``), sampled as ``label``
        says (``t=1``)."""
        ...


@runtime_checkable
class Closable(Protocol):
    """An engine holding threads or connections: `vlrl.rollout.build.close_engine` closes it."""

    def close(self) -> None:
        ...


C = TypeVar("C")


@runtime_checkable
class EngineWrapper(Protocol):
    """An engine around another one. It says which capabilities of the engine it wraps it passes on: a wrapper that
    replaces generation (`vlrl.rollout.agent.RolloutEngine`) never passes on the inner engine's ``agenerate``."""

    def offer(self, protocol: type[C]) -> C | None:
        """The wrapped engine as ``protocol`` (usually ``capability(inner, protocol)``), or None."""
        ...


def capability(engine: Any, protocol: type[C]) -> C | None:
    """``engine`` as ``protocol`` (`AsyncEngine`, `WeightPublisher`, ...): the engine itself when it implements it,
    else what the wrapper it is passes on of the engine it wraps (`EngineWrapper.offer`), else None."""
    if isinstance(engine, protocol):
        return engine
    if isinstance(engine, EngineWrapper):
        return engine.offer(protocol)
    return None
