"""Rollout functions: single-turn generation and the multi-turn agent loop, for LLMs and VLMs alike.

Two plug-in levels, as in slime (both are registries; a name may be a dotted path ``pkg.mod:fn``):

- ``rollout.agent.function`` replaces the whole rollout: ``fn(engine, requests, sampling, *, agent, **options) ->
  list[Trajectory]`` (``len(requests) * sampling.n`` trajectories, the n of request i with
  ``group_index == i``); ``options`` are its keyword-only parameters, bound from ``rollout.agent.options``
  (checked against its signature when the config loads). ``single_turn`` is exactly ``engine.generate``;
  ``multi_turn`` is the batched agent loop below; ``per_sample`` runs a per-sample generate for every
  (request, sample) pair.
- ``rollout.agent.generate`` replaces only the per-sample generate used by ``per_sample``:
  ``fn(engine, request, sampling, *, agent) -> Trajectory``; ``agent`` is the default (the same loop for one
  sample).

The agent loop (slime's multi-turn rollout, with its "future" list done):

1. start: an environment per trajectory (``reset(sample)``; an observation it returns is added to the prompt);
2. generate a turn for every active trajectory in one engine call (context = prompt + all turns so far,
   vision = all images so far); the model's tokens get loss mask 1 and their behaviour log-probs;
3. ``env.step(text)``, retried up to ``max_env_retries_per_turn`` times when it raises or exceeds
   ``env_timeout_seconds`` (after a fresh ``reset`` and a replay of earlier actions where the environment asks
   for it, and always after a timeout); exhausted retries → FAILED (excluded from the loss, counted);
4. ``done`` → stop; ``max_turns`` reached → stop; otherwise the observation is encoded as the *delta* of the
   chat template (no repeated system/tool preamble) and appended with loss mask 0; its images go to the
   inference context and to the training buffer (concatenated once at the end);
5. a token budget (``max_total_tokens``, prompt included) caps everything: hitting it marks TRUNCATED.

The reward stage scores ``response_text``, which is the final turn's text (the final answer); per-step
rewards an environment reports in ``info["reward"]`` are kept on ``Trajectory.turns``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from vlrl.models.adapters import VisionInputs
from vlrl.registry import Registry, option_problems
from vlrl.rollout.env import Environment, env_factory
from vlrl.rollout.types import (
    AgentEngine,
    AsyncEngine,
    C,
    Closable,
    Engine,
    Request,
    SamplingParams,
    Status,
    Trajectory,
    Turn,
    capability,
)

log = logging.getLogger(__name__)

RolloutFn = Callable[..., list[Trajectory]]
ROLLOUTS: Registry[RolloutFn] = Registry(
    "rollout function",
    signature="fn(engine, requests, sampling, *, agent: AgentSettings | None, **options) -> list[Trajectory]",
)
BOUND_BY_RECIPE = {"agent": "the rollout.agent.* fields (AgentSettings)"}  # keyword parameters the recipe passes itself
GENERATES: Registry[Callable[..., Trajectory]] = Registry(
    "per-sample generate", signature="fn(engine, request, sampling, *, agent: AgentSettings) -> Trajectory"
)


@dataclass
class AgentSettings:
    """What a rollout function needs to run episodes (bound from the ``rollout.agent.*`` config by `build_rollout`).

    Attributes:
        env: zero-argument factory of a fresh environment (see `vlrl.rollout.env.env_factory`), or None.
        max_turns: model turns per episode at most.
        max_total_tokens: budget of the whole sequence (prompt + turns + observations); None = no budget.
        max_env_retries_per_turn: failed environment calls tolerated per turn before the episode FAILS.
        env_timeout_seconds: a reset/step that takes longer counts as failed (the call is abandoned).
        generate: per-sample generate of the ``per_sample`` rollout (registered name or dotted path).
        tools: tool schemas handed to the chat template when encoding observations.
    """

    env: Callable[[], Environment] | None = None
    max_turns: int = 1
    max_total_tokens: int | None = None
    max_env_retries_per_turn: int = 2
    env_timeout_seconds: float = 30.0
    generate: str = "agent"
    tools: list[dict] | None = None


def get_rollout(name: str) -> RolloutFn:
    return ROLLOUTS.get(name)


def build_rollout(cfg: Any) -> Callable[[Engine, Sequence[Request], SamplingParams], list[Trajectory]]:
    """``fn(engine, requests, sampling)`` for a `vlrl.config.RolloutConfig`: the configured rollout function
    with its `AgentSettings` and ``rollout.agent.options`` bound (the environment is built once here, so bad
    ``rollout.agent.env_kwargs`` fail now)."""
    cfg = cfg.agent
    fn = get_rollout(cfg.function)
    problems = option_problems(fn, cfg.options, where="rollout.agent.options", name=cfg.function,
                               bound=BOUND_BY_RECIPE)
    if problems:
        raise ValueError("\n".join(f"{field}: {message}" for field, message in problems))
    if cfg.env is None and cfg.function in ("multi_turn", "per_sample"):
        raise ValueError(f"config field 'rollout.agent.env': rollout.agent.function={cfg.function!r} needs an "
                         "environment")
    agent = AgentSettings(
        env=env_factory(cfg.env, cfg.env_kwargs) if cfg.env is not None else None,
        max_turns=cfg.max_turns, max_total_tokens=cfg.max_total_tokens,
        max_env_retries_per_turn=cfg.max_env_retries_per_turn, env_timeout_seconds=cfg.env_timeout_seconds,
        generate=cfg.generate,
    )
    GENERATES.get(agent.generate)  # fail now on a bad name
    return functools.partial(fn, agent=agent, **cfg.options)


class TurnEngine:
    """What a rollout function drives: ``generate`` of the inner engine, and the encoding side (``encode``,
    ``encode_observation``, ``decode``) of ``codec`` — an engine on the same tokenizer and processor — one thread at
    a time (the asynchronous recipe runs episodes of several prompts on worker threads; a tokenizer must not be
    used by two threads at once)."""

    def __init__(self, engine: Engine, codec: Any = None) -> None:
        self.engine, self.codec = engine, codec if codec is not None else engine
        self._lock = threading.Lock()
        if not isinstance(self.codec, AgentEngine):
            self.encode_observation = None  # a multi-turn episode refuses this engine, naming it

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def encode(self, sample):
        with self._lock:
            return self.codec.encode(sample)

    def encode_observation(self, messages: list[dict], *, last_token: int | None, tools: list[dict] | None = None):
        with self._lock:
            return self.codec.encode_observation(messages, last_token=last_token, tools=tools)

    def decode(self, ids: Sequence[int]) -> str:
        with self._lock:
            return self.codec.decode(ids)

    def generate(self, requests: Sequence[Request], sampling: SamplingParams) -> list[Trajectory]:
        return self.engine.generate(requests, sampling)

    def update_weights(self, *, version: int, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        self.engine.update_weights(version=version, state_dict=state_dict)

    def __repr__(self) -> str:
        return type(self.engine).__name__


class RolloutEngine:
    """An `Engine` whose ``generate`` is a rollout function over an inner engine — so any recipe or evaluation
    written against ``engine.generate`` runs multi-turn episodes unchanged. The inner engine's capabilities are
    passed on (`offer`: `WeightPublisher`, ...), except `AsyncEngine`: its ``agenerate`` would bypass the rollout
    function; `wrap` builds an `AsyncRolloutEngine` (whose ``agenerate`` runs the rollout function) over an
    asynchronous engine.

    ``codec``: an engine that encodes and decodes for the inner one (`vlrl.rollout.build_engine` passes an
    `HFEngine` on the trainer's tokenizer and processor, for inner engines that cannot encode observations)."""

    def __init__(self, engine: Engine, rollout: Callable[[Engine, Sequence[Request], SamplingParams], list[Trajectory]],
                 *, codec: Any = None) -> None:
        self.engine, self.rollout = engine, rollout
        self.turns = TurnEngine(engine, codec)

    @staticmethod
    def wrap(engine: Engine, rollout: Callable, *, codec: Any = None, max_workers: int = 64) -> RolloutEngine:
        """`AsyncRolloutEngine` over an `AsyncEngine`, else `RolloutEngine`."""
        if isinstance(engine, AsyncEngine):
            return AsyncRolloutEngine(engine, rollout, codec=codec, max_workers=max_workers)
        return RolloutEngine(engine, rollout, codec=codec)

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def encode(self, sample):
        return self.turns.encode(sample)

    def encode_observation(self, messages: list[dict], *, last_token: int | None, tools: list[dict] | None = None):
        return self.turns.encode_observation(messages, last_token=last_token, tools=tools)

    def decode(self, ids: Sequence[int]) -> str:
        return self.turns.decode(ids)

    def generate(self, requests: Sequence[Request], sampling: SamplingParams) -> list[Trajectory]:
        return self.rollout(self.turns, requests, sampling)

    def update_weights(self, *, version: int, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        self.engine.update_weights(version=version, state_dict=state_dict)

    def close(self) -> None:
        if isinstance(self.engine, Closable):
            self.engine.close()

    def offer(self, protocol: type[C]) -> C | None:
        """The inner engine's capability ``protocol`` (`vlrl.rollout.types.capability`) — never `AsyncEngine`: the
        inner engine's ``agenerate`` would bypass the rollout function."""
        if protocol is AsyncEngine:
            return None
        return capability(self.engine, protocol)


class AsyncRolloutEngine(RolloutEngine):
    """`RolloutEngine` over an asynchronous engine (`ThreadedEngine`, `HTTPEngine`): ``agenerate`` runs the
    rollout function on a worker thread, each turn a blocking call to the inner engine's thread-safe
    ``generate`` (the calls of concurrent episodes meet in the inner engine's batches)."""

    def __init__(self, engine: Engine, rollout: Callable, *, codec: Any = None, max_workers: int = 64) -> None:
        super().__init__(engine, rollout, codec=codec)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="vlrl-episode")

    async def agenerate(self, requests: Sequence[Request], sampling: SamplingParams) -> list[Trajectory]:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.generate, list(requests), sampling)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        super().close()


# ----------------------------------------------------------------------------------------------- rollouts
@ROLLOUTS.register("single_turn")
def single_turn(engine: Engine, requests: Sequence[Request], sampling: SamplingParams, *,
                agent: AgentSettings | None = None) -> list[Trajectory]:
    """One response per sample: exactly ``engine.generate``."""
    return engine.generate(requests, sampling)


@ROLLOUTS.register("multi_turn")
def multi_turn(engine: Engine, requests: Sequence[Request], sampling: SamplingParams, *,
               agent: AgentSettings | None = None) -> list[Trajectory]:
    """The agent loop over all ``len(requests) * n`` episodes at once: one engine call per turn."""
    agent = _require_env(agent)
    episodes = [Episode(engine, request, group_index, agent) for group_index, request in enumerate(requests)
                for _ in range(sampling.n)]
    one = replace(sampling, n=1)
    while True:
        active = [e for e in episodes if e.active]
        if not active:
            break
        generate_turn(engine, active, one)
        for episode in active:
            episode.react()
    return [e.finish() for e in episodes]


@ROLLOUTS.register("per_sample")
def per_sample(engine: Engine, requests: Sequence[Request], sampling: SamplingParams, *,
               agent: AgentSettings | None = None) -> list[Trajectory]:
    """Run the per-sample generate (``agent.generate``) for each of the n samples of each request."""
    agent = _require_env(agent)
    generate = GENERATES.get(agent.generate)
    out = []
    for group_index, request in enumerate(requests):
        for _ in range(sampling.n):
            trajectory = generate(engine, request, replace(sampling, n=1), agent=agent)
            trajectory.group_index = group_index
            out.append(trajectory)
    return out


@GENERATES.register("agent")
def agent_generate(engine: Engine, request: Request, sampling: SamplingParams, *, agent: AgentSettings) -> Trajectory:
    """One episode of the agent loop (the same steps as `multi_turn`, for one sample)."""
    episode = Episode(engine, request, 0, agent)
    while episode.active:
        generate_turn(engine, [episode], replace(sampling, n=1))
        episode.react()
    return episode.finish()


def _require_env(agent: AgentSettings | None) -> AgentSettings:
    if agent is None or agent.env is None:
        raise ValueError("a multi-turn rollout needs an environment (config field 'rollout.agent.env')")
    return agent


def generate_turn(engine: Engine, episodes: Sequence[Episode], sampling: SamplingParams) -> None:
    """One model turn for each episode, in one ``engine.generate`` call (generated at the largest turn budget;
    each episode keeps only its own budget's prefix, whose log-probs do not depend on what follows)."""
    budgets = [e.turn_budget(sampling.max_new_tokens) for e in episodes]
    outs = engine.generate([e.context_request() for e in episodes], replace(sampling, max_new_tokens=max(budgets)))
    for episode, out, budget in zip(episodes, outs, budgets, strict=True):
        episode.add_action(out, budget, sampling.max_new_tokens)


# ----------------------------------------------------------------------------------------------- one episode
class Episode:
    """One trajectory in progress: token ids, loss mask, behaviour log-probs, images, turns, environment."""

    def __init__(self, engine: Engine, request: Request, group_index: int, agent: AgentSettings) -> None:
        self.engine, self.agent, self.group_index = engine, agent, group_index
        self.request = request
        self.response: list[int] = []
        self.mask: list[int] = []
        self.logp: list[float] = []
        self.versions: list[int] = []  # the weight version of each response token (an observation: its turn's last)
        self.vision_buffer: list[VisionInputs | None] = [request.vision]  # training side: concatenated once
        self.images = list(request.images)
        self.turns: list[Turn] = []
        self.actions: list[str] = []
        self.status, self.stop_reason, self.error = Status.COMPLETED, "", ""
        self.weight_version: int | None = None
        self.active = True
        self.env: Environment | None = None
        self._retries = 0
        self._last_token: int | None = None
        self._turn_truncated = False
        if not isinstance(engine, AgentEngine):
            raise TypeError(f"{type(engine).__name__} cannot run multi-turn episodes: it has no "
                            "encode_observation(messages, *, last_token, tools) (see vlrl.rollout.types.AgentEngine)")
        first = self._call_env(lambda env: env.reset(request.sample), replay=False)
        if first is not _FAILED and first is not None:
            self._guarded(self._extend_prompt, first)
        if self.active and self._over_budget(1):  # not even one model token fits after the prompt
            self._stop(Status.TRUNCATED, "token_budget")

    def _extend_prompt(self, observation: Any) -> None:
        """An observation returned by ``reset`` (e.g. tool instructions) becomes a message of the prompt."""
        messages = self.env.format_observation(observation)
        messages = messages if isinstance(messages, list) else [messages]
        images = [p["image"] for m in messages for p in _parts(m) if p.get("type") == "image"]
        plain = [{**m, "content": [{"type": "image"} if p.get("type") == "image" else p for p in _parts(m)]}
                 if isinstance(m.get("content"), list) else m for m in messages]
        sample = self.request.sample
        extended = replace(sample, messages=list(sample.messages) + plain, images=list(sample.images) + images)
        encoded = self.engine.encode(extended)
        self.request = replace(encoded, sample=sample)
        self.vision_buffer, self.images = [encoded.vision], list(encoded.images)

    # ---- generation side
    def context_request(self) -> Request:
        return Request(sample=self.request.sample, prompt_ids=list(self.request.prompt_ids) + self.response,
                       vision=VisionInputs.concat(self.vision_buffer), images=list(self.images))

    def total_tokens(self) -> int:
        return len(self.request.prompt_ids) + len(self.response)

    def turn_budget(self, max_new_tokens: int) -> int:
        if self.agent.max_total_tokens is None:
            return max_new_tokens
        return max(1, min(max_new_tokens, self.agent.max_total_tokens - self.total_tokens()))

    def add_action(self, out: Trajectory, budget: int, max_new_tokens: int) -> None:
        """Append the model's turn (loss mask 1), cut to this episode's budget; a turn that the token budget
        (not the per-turn ``max_new_tokens``) cut short ends the episode TRUNCATED."""
        if self.weight_version is None:
            self.weight_version = out.weight_version
        if out.status is Status.ABORTED:
            self._stop(Status.ABORTED, "aborted")
            return
        ids, logp = out.response_ids[:budget].tolist(), out.behaviour_logp[:budget].tolist()
        ended = out.status is Status.COMPLETED and len(out.response_ids) <= budget
        text = out.response_text if len(out.response_ids) <= budget else self._decode(ids)
        start = len(self.response)
        self.response += ids
        self.mask += [1] * len(ids)
        self.logp += logp
        self.versions += out.versions[:budget].tolist()
        self.turns.append(Turn(action_start=start, action_end=len(self.response), observation_end=len(self.response),
                               text=text))
        self.actions.append(text)
        self._last_token = ids[-1] if ids else None
        self._turn_truncated = not ended
        if not ended and budget < max_new_tokens:
            self._stop(Status.TRUNCATED, "token_budget")

    def _decode(self, ids: list[int]) -> str:
        return self.engine.decode(ids)  # (an `AgentEngine`: checked when the episode started)

    # ---- environment side
    def react(self) -> None:
        """Step the environment on the last turn, then stop or append its observation."""
        if not self.active:
            return
        self._retries = 0
        result = self._call_env(lambda env: _unpack_step(env.step(self.actions[-1])), replay=True)
        self.turns[-1].env_retries = self._retries
        if result is _FAILED:
            return
        observation, done, info = result
        if isinstance(info.get("reward"), (int, float)):
            self.turns[-1].reward = float(info["reward"])
        self.turns[-1].info = {k: float(v) for k, v in info.items() if k != "reward" and isinstance(v, (int, float))}
        if done:
            self._stop(self._final_status(), "done")
        elif len(self.turns) >= self.agent.max_turns:
            self._stop(self._final_status(), "max_turns")
        else:
            self._guarded(self._append_observation, observation)

    def _guarded(self, fn: Callable[[Any], None], observation: Any) -> None:
        """Formatting and encoding an observation: an error there (a malformed message, an image the
        processor rejects) fails this episode — counted, logged — instead of the run. Not retried: it would
        fail the same way again."""
        try:
            fn(observation)
        except Exception as err:
            self.error = f"{type(err).__name__}: {err}"
            log.warning("episode of sample %s failed: cannot encode the observation: %s", self.request.sample.id, self.error)
            self._stop(Status.FAILED, "observation_error")

    def _append_observation(self, observation: Any) -> None:
        messages = self.env.format_observation(observation)
        messages = messages if isinstance(messages, list) else [messages]
        encoded = self.engine.encode_observation(messages, last_token=self._last_token, tools=self.agent.tools)
        if self._over_budget(len(encoded.input_ids) + 1):  # the observation and at least one more model token
            self._stop(Status.TRUNCATED, "token_budget")
            return
        self.response += encoded.input_ids
        self.mask += [0] * len(encoded.input_ids)
        self.logp += [0.0] * len(encoded.input_ids)
        last = self.versions[-1] if self.versions else self.weight_version or 0  # (not sampled: its turn's version)
        self.versions += [last] * len(encoded.input_ids)
        self.vision_buffer.append(encoded.vision)
        new_images = [p["image"] for m in messages for p in _parts(m) if p.get("type") == "image"]
        self.images += new_images
        if self.turns:
            self.turns[-1].observation_end = len(self.response)
            self.turns[-1].num_images = len(new_images)

    def _over_budget(self, extra: int) -> bool:
        limit = self.agent.max_total_tokens
        return limit is not None and self.total_tokens() + extra > limit

    def _final_status(self) -> Status:
        return Status.TRUNCATED if self._turn_truncated else Status.COMPLETED

    def _call_env(self, action: Callable[[Environment], Any], *, replay: bool) -> Any:
        """``action(env)`` with a timeout, retried on failure; `_FAILED` (episode FAILED) when retries run out.

        A retry after a timeout, or for an environment with ``retry_mode == "reset_replay"``, runs on a fresh
        instance: reset, then (``replay``) the earlier turns' actions, then the action."""
        fresh = self.env is None
        while True:
            def attempt(fresh=fresh) -> Any:
                env = self.env
                if fresh:
                    env = self.agent.env()
                    if replay:
                        env.reset(self.request.sample)
                        for past in self.actions[:-1]:
                            env.step(past)
                    self.env = env
                return action(env)

            try:
                return call_with_timeout(attempt, self.agent.env_timeout_seconds)
            except TimeoutError as err:
                reason, error, fresh = "env_timeout", str(err), True
            except Exception as err:  # an environment bug must not kill the run, nor vanish
                reason, error = "env_failed", f"{type(err).__name__}: {err}"
                fresh = fresh or getattr(self.env, "retry_mode", "step_again") == "reset_replay"
            self._retries += 1
            log.debug("environment call failed (%s), retry %d: %s", reason, self._retries, error)
            if self._retries > self.agent.max_env_retries_per_turn:
                self.error = error
                log.warning("episode of sample %s failed after %d environment call(s): %s (%s)",
                            self.request.sample.id, self._retries, reason, error)
                self._stop(Status.FAILED, reason)
                if self.turns:
                    self.turns[-1].env_retries = self._retries
                return _FAILED

    def _stop(self, status: Status, reason: str) -> None:
        self.status, self.stop_reason, self.active = status, reason, False

    def finish(self) -> Trajectory:
        return Trajectory(
            sample=self.request.sample,
            prompt_ids=torch.as_tensor(self.request.prompt_ids, dtype=torch.long),
            response_ids=torch.tensor(self.response, dtype=torch.long),
            loss_mask=torch.tensor(self.mask, dtype=torch.long),
            behaviour_logp=torch.tensor(self.logp, dtype=torch.float),
            vision=VisionInputs.concat(self.vision_buffer),
            images=self.images,
            weight_version=(min([self.weight_version, *self.versions]) if self.weight_version is not None
                            else self.engine.weight_version),  # the oldest token's (the first turn's, unless continued)
            status=self.status,
            response_text=self.turns[-1].text if self.turns else "",
            group_index=self.group_index,
            turns=self.turns,
            stop_reason=self.stop_reason,
            error=self.error,
            token_versions=torch.tensor(self.versions, dtype=torch.long) if len(set(self.versions)) > 1 else None,
        )


_FAILED = object()


def call_with_timeout(fn: Callable[[], Any], timeout: float) -> Any:
    """``fn()`` in a daemon thread; raise `TimeoutError` if it has not returned after ``timeout`` seconds
    (the thread is abandoned — Python cannot kill it — and never blocks interpreter exit)."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as err:  # re-raised in the caller
            result["error"] = err

    thread = threading.Thread(target=run, daemon=True, name="vlrl-env-call")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"environment call exceeded {timeout:g}s")
    if "error" in result:
        raise result["error"]
    return result.get("value")


def _unpack_step(result: Any) -> tuple[Any, bool, dict]:
    if not (isinstance(result, tuple) and len(result) == 3):
        raise TypeError(f"env.step must return (observation, done, info), got {type(result).__name__}")
    observation, done, info = result
    return observation, bool(done), info if isinstance(info, dict) else {}


def _parts(message: dict) -> list[dict]:
    content = message.get("content")
    return [p for p in content if isinstance(p, dict)] if isinstance(content, list) else []


# ----------------------------------------------------------------------------------------------- metrics
def agent_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Turn-level metrics of a batch (log them with the step's metrics; call after scoring for the
    reward-by-turn-count figures).

    ``agent/turns_mean``, ``agent/turns=k`` (fraction with k turns), ``agent/stop/<reason>`` (fraction),
    ``agent/failed`` (count), ``agent/env_retries`` (total), ``agent/action_tokens_mean``,
    ``agent/observation_tokens_mean``, ``agent/images_per_trajectory``, ``agent/reward_turns=k``,
    ``agent/step_reward_mean`` when environments report per-step rewards, and ``agent/env/<key>`` for every
    other number an environment reports in ``info`` (its sum over an episode's turns, mean over episodes:
    e.g. ``agent/env/zoom_call`` = zoom calls per episode).
    """
    n = len(trajectories)
    if n == 0:
        return {}
    turns = Counter(t.num_turns for t in trajectories)
    reasons = Counter(t.stop_reason or t.status.value for t in trajectories)
    metrics: dict[str, float] = {"agent/turns_mean": sum(k * c for k, c in turns.items()) / n}
    metrics.update({f"agent/turns={k}": c / n for k, c in sorted(turns.items())})
    metrics.update({f"agent/stop/{r}": c / n for r, c in sorted(reasons.items())})
    metrics["agent/failed"] = float(sum(t.status is Status.FAILED for t in trajectories))
    metrics["agent/env_retries"] = float(sum(t.env_retries for t in trajectories))
    actions = [int(t.loss_mask.sum()) for t in trajectories]
    metrics["agent/action_tokens_mean"] = sum(actions) / n
    metrics["agent/observation_tokens_mean"] = sum(len(t.loss_mask) - a for t, a in zip(trajectories, actions, strict=True)) / n
    metrics["agent/images_per_trajectory"] = sum(len(t.images) for t in trajectories) / n
    by_turns: dict[int, list[float]] = defaultdict(list)
    for t in trajectories:
        if t.reward is not None:
            by_turns[t.num_turns].append(t.reward)
    metrics.update({f"agent/reward_turns={k}": sum(v) / len(v) for k, v in sorted(by_turns.items())})
    step_rewards = [turn.reward for t in trajectories for turn in t.turns if turn.reward is not None]
    if step_rewards:
        metrics["agent/step_reward_mean"] = sum(step_rewards) / len(step_rewards)
    keys = sorted({key for t in trajectories for turn in t.turns for key in turn.info})
    for key in keys:
        metrics[f"agent/env/{key}"] = sum(turn.info.get(key, 0.0) for t in trajectories for turn in t.turns) / n
    return metrics
