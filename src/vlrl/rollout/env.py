"""Environments for multi-turn rollouts: the protocol and loading with typed kwargs (the registry: `vlrl.rollout.envs`).

An environment sees one episode of one sample (slime's ``BaseInteractionEnv``, with ``reset`` taking the
sample):

- ``reset(sample) -> observation | None``: start an episode; a non-None observation is shown to the model
  before its first turn (e.g. tool instructions).
- ``step(response_text) -> (observation, done, info)``: react to one model turn. ``done`` ends the episode;
  ``info`` may hold a per-step ``"reward"`` (float), recorded on the trajectory's turn.
- ``format_observation(observation) -> message | list[message]``: the chat message(s) appended to the
  context, text and images (``{"type": "image", "image": PIL.Image}`` parts).

An environment may raise from ``step`` (a tool that crashed, a judge that timed out): the agent loop retries
(`vlrl.rollout.agent`). ``retry_mode`` says how: ``"step_again"`` calls ``step`` again on the same instance;
``"reset_replay"`` builds a fresh instance, resets it and replays the earlier turns' actions first (for
stateful environments whose state a failed step may have corrupted). After a timeout the instance may still
be running in its thread, so the loop always uses a fresh instance (``reset_replay``).

Registering: ``@register_env("name")`` (`vlrl.rollout.envs`: a built-in is one module of that package) on a class
(or factory) whose constructor takes keyword-only, typed options. `env_factory` validates config kwargs against that signature (pydantic), so a wrong key or type
stops the run before any rollout with an error naming the option.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from PIL import Image
from pydantic import ValidationError, validate_call

from vlrl.data.sample import Sample
from vlrl.rollout.envs import get_env

Message = dict[str, Any]
StepResult = tuple[Any, bool, dict[str, Any]]


@runtime_checkable
class Environment(Protocol):
    """One episode of interaction with the model (see the module docstring)."""

    def reset(self, sample: Sample) -> Any: ...

    def step(self, response_text: str) -> StepResult: ...

    def format_observation(self, observation: Any) -> Message | list[Message]: ...


class EnvConfigError(ValueError):
    """Environment options that do not fit the environment's constructor; the message names the option."""


def env_factory(name: str, kwargs: dict[str, Any] | None = None, *, where: str = "rollout.agent.env_kwargs") -> Callable[[], Environment]:
    """A zero-argument factory of environment ``name`` with ``kwargs`` validated against its typed signature.

    One instance is built here, so a wrong option fails at start-up naming ``where.<option>``.
    """
    cls = get_env(name)
    kwargs = dict(kwargs or {})
    config = {"arbitrary_types_allowed": True}
    if isinstance(cls, type) and cls.__init__ is object.__init__:  # no options at all
        unknown = sorted(kwargs)

        def build() -> Environment:
            if unknown:
                raise EnvConfigError(f"{where}.{unknown[0]}: unknown option (environment {name!r} takes none)")
            return cls()
    elif isinstance(cls, type):  # validate against __init__, then build instances through the validated call
        init = validate_call(cls.__init__, config=config)

        def build() -> Environment:
            env = cls.__new__(cls)
            init(env, **kwargs)
            return env
    else:
        checked = validate_call(cls, config=config)

        def build() -> Environment:
            return checked(**kwargs)

    try:
        probe = build()
    except ValidationError as err:
        lines = []
        for e in err.errors():
            loc = ".".join(str(p) for p in e["loc"]) or "(kwargs)"
            message = "unknown option" if e["type"] == "unexpected_keyword_argument" else e["msg"]
            lines.append(f"{where}.{loc}: {message} (environment {name!r})")
        raise EnvConfigError("\n".join(lines)) from None
    missing = [m for m in ("reset", "step", "format_observation") if not callable(getattr(probe, m, None))]
    if missing:
        raise EnvConfigError(f"environment {name!r} lacks {missing} of the Environment protocol")
    return build


# ----------------------------------------------------------------------------------------------- helpers
@dataclass
class Observation:
    """A convenient observation type: text and images, shown as one message of ``role``."""

    text: str = ""
    images: list[Image.Image] = field(default_factory=list)
    role: str = "user"


class BaseEnv:
    """Optional base class: keeps the sample, formats `Observation` records, retries by stepping again."""

    retry_mode = "step_again"
    sample: Sample | None = None

    def reset(self, sample: Sample) -> Any:
        self.sample = sample
        return None

    def step(self, response_text: str) -> StepResult:  # pragma: no cover - abstract
        raise NotImplementedError

    def format_observation(self, observation: Any) -> Message | list[Message]:
        return observation_message(observation)


def observation_message(observation: Any) -> Message:
    """A chat message for an `Observation` (images first, then text), a plain string, or a message dict."""
    if isinstance(observation, dict) and "role" in observation:
        return observation
    if isinstance(observation, str):
        observation = Observation(text=observation)
    if not isinstance(observation, Observation):
        raise TypeError(f"cannot format an observation of type {type(observation).__name__}; "
                        "return an Observation, a string or a chat message, or override format_observation")
    parts: list[dict[str, Any]] = [{"type": "image", "image": image} for image in observation.images]
    if observation.text:
        parts.append({"type": "text", "text": observation.text})
    return {"role": observation.role, "content": parts}
