"""Every plug-in option of a run's config, checked before anything loads (at config load and by `vlrl check`).

A plug-in's options are its keyword-only parameters (`vlrl.registry.option_problems`): the estimator's
``algo.advantage_options``, the policy loss's ``algo.policy_loss_options`` (``clip_low`` / ``clip_high`` come from
``algo.clip_low`` / ``algo.clip_high``), each shaper's ``options``, the environment's ``rollout.env_kwargs`` and the
rollout function's ``rollout.function_options``. A problem names the config field:

    algo.advantage_options.epz: unknown option of grpo; known: eps, norm_by_std

Settings that cannot work together are refused here too, naming both fields. A plug-in name that does not resolve
is left to the preflight check (`vlrl.check`), which lists it with everything else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from vlrl.registry import RegistryError, option_problems

Problem = tuple[str, str]  # (config field, message)
LOSS_BOUND = {"clip_low": "algo.clip_low", "clip_high": "algo.clip_high"}


def config_problems(cfg: Any) -> list[Problem]:
    """The option and combination problems of every RL stage of a `RunConfig` (none for SFT)."""
    return [problem for prefix, stage in rl_stages(cfg) for problem in stage_problems(stage, prefix)]


def rl_stages(cfg: Any) -> Iterator[tuple[str, Any]]:
    """(field prefix, RL stage) of a config: ``("", cfg)``, ``("stages.1.", stage)`` or ``("rl.", cfg.rl)``."""
    if getattr(cfg, "rl", None) is not None:
        yield "rl.", cfg.rl
    elif hasattr(cfg, "algo") and hasattr(cfg, "rollout"):
        stages = getattr(cfg, "stages", None) or []
        if stages:
            yield from ((f"stages.{k}.", stage) for k, stage in enumerate(stages))
        else:
            yield "", cfg


def stage_problems(stage: Any, prefix: str = "") -> list[Problem]:
    from vlrl.algos import get_advantage, get_advantage_shaping, get_policy_loss, get_reward_shaping
    from vlrl.rollout.agent import BOUND_BY_RECIPE, get_rollout
    from vlrl.rollout.env import get_env

    algo, rollout = stage.algo, stage.rollout
    checks: list[tuple[Callable, str, dict, str, dict]] = [
        (get_advantage, algo.advantage, algo.advantage_options, "algo.advantage_options", {}),
        (get_policy_loss, algo.policy_loss, algo.policy_loss_options, "algo.policy_loss_options", LOSS_BOUND),
        (get_rollout, rollout.function, rollout.function_options, "rollout.function_options", BOUND_BY_RECIPE),
    ]
    checks += [(get_reward_shaping, spec.name, spec.options, f"algo.reward_shaping.{k}.options", {})
               for k, spec in enumerate(algo.reward_shaping)]
    checks += [(get_advantage_shaping, spec.name, spec.options, f"algo.advantage_shaping.{k}.options", {})
               for k, spec in enumerate(algo.advantage_shaping)]
    if rollout.env is not None:
        checks.append((get_env, rollout.env, rollout.env_kwargs, "rollout.env_kwargs", {}))
    problems = []
    for lookup, name, options, where, bound in checks:
        try:
            fn = lookup(name)
        except RegistryError:  # an unknown name: the preflight check reports it
            continue
        problems += [(prefix + field, message) for field, message in
                     option_problems(fn, options, where=where, name=name, bound=bound)]
    return problems + [(prefix + field, message) for field, message in combination_problems(stage)]


def combination_problems(stage: Any) -> list[Problem]:
    """Settings that each work but not together."""
    problems = []
    multi_turn = stage.rollout.function != "single_turn"
    for k, spec in enumerate(stage.algo.advantage_shaping):
        if spec.name == "step_credit" and spec.options.get("signal") == "forward_proxy" and multi_turn:
            problems.append((f"algo.advantage_shaping.{k}.options.signal",
                             f"forward_proxy scores single-turn responses (the teacher reads the prompt plus the "
                             f"reference plan), but rollout.function={stage.rollout.function}: use signal=rule "
                             f"for multi-turn episodes"))
    return problems
