"""Every plug-in option of a run's config, checked before anything loads (at config load and by `vlrl check`).

`load_run_config` is how a command loads a run's config: `vlrl.config.load_config` with these checks.

A plug-in's options are its keyword-only parameters (`vlrl.registry.option_problems`): the estimator's
``algo.advantage_options``, the policy loss's ``algo.policy_loss_options`` (``clip_low`` / ``clip_high`` come from
``algo.clip_low`` / ``algo.clip_high``), each shaper's ``options``, the environment's ``rollout.agent.env_kwargs`` and the
rollout function's ``rollout.agent.options``. A problem names the config field:

    algo.advantage_options.epz: unknown option of grpo; known: eps, norm_by_std

Settings that cannot work together are refused here too, naming both fields, and the policy loss is run once on a
tiny fake batch with its options, so a value it refuses (``algo.policy_loss_options.fraction: must lie in (0, 1]``)
stops the run at load, not at the first update. A plug-in name that does not resolve is left to the preflight
check (`vlrl.check`), which lists it with everything else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from vlrl.config import Section, load_config
from vlrl.registry import RegistryError, option_problems

Problem = tuple[str, str]  # (config field, message)
LOSS_BOUND = {"clip_low": "algo.clip_low", "clip_high": "algo.clip_high"}
BEHAVIOUR_BOUND = {"cap": "staleness.behaviour_weight_cap", "behaviour_weight_mode": "staleness.behaviour_weight_mode"}


def load_run_config(cls: type[Section], path: str | Path | None = None, overrides: list[str] | None = None, *,
                    prepare: Callable[[Any], None] | None = None) -> Any:
    """`vlrl.config.load_config`, then every plug-in option and combination checked (`config_problems`): one
    `vlrl.config.ConfigError` lists every problem, each naming its config field."""
    return load_config(cls, path, overrides, prepare=prepare, check=config_problems)


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
    from vlrl.algos.losses import applies_behaviour_weight
    from vlrl.rollout.agent import BOUND_BY_RECIPE, get_rollout
    from vlrl.rollout.envs import get_env
    from vlrl.train import step_credit  # noqa: F401  (the training room's shaper registers itself)

    algo, rollout = stage.algo, stage.rollout
    try:  # a loss that applies the behaviour weight takes its cap and mode from the staleness section
        loss_bound = {**LOSS_BOUND, **BEHAVIOUR_BOUND} if applies_behaviour_weight(get_policy_loss(algo.policy_loss)) \
            else LOSS_BOUND
    except RegistryError:
        loss_bound = LOSS_BOUND
    checks: list[tuple[Callable, str, dict, str, dict]] = [
        (get_advantage, algo.advantage, algo.advantage_options, "algo.advantage_options", {}),
        (get_policy_loss, algo.policy_loss, algo.policy_loss_options, "algo.policy_loss_options", loss_bound),
        (get_rollout, rollout.agent.function, rollout.agent.options, "rollout.agent.options", BOUND_BY_RECIPE),
    ]
    checks += [(get_reward_shaping, spec.name, spec.options, f"algo.reward_shaping.{k}.options", {})
               for k, spec in enumerate(algo.reward_shaping)]
    checks += [(get_advantage_shaping, spec.name, spec.options, f"algo.advantage_shaping.{k}.options", {})
               for k, spec in enumerate(algo.advantage_shaping)]
    if rollout.agent.env is not None:
        checks.append((get_env, rollout.agent.env, rollout.agent.env_kwargs, "rollout.agent.env_kwargs", {}))
    problems = []
    for lookup, name, options, where, bound in checks:
        try:
            fn = lookup(name)
        except RegistryError:  # an unknown name: the preflight check reports it
            continue
        problems += [(prefix + field, message) for field, message in
                     option_problems(fn, options, where=where, name=name, bound=bound)]
    if not any(field.startswith(prefix + "algo.policy_loss_options") for field, _ in problems):
        problems += [(prefix + field, message) for field, message in loss_problems(stage)]
    return problems + [(prefix + field, message) for field, message in combination_problems(stage)]


def loss_problems(stage: Any) -> list[Problem]:
    """Run the bound policy loss once on a fake 2 × 3 batch: a value it refuses (ValueError) is reported at
    ``algo.policy_loss_options``; with ``train.skip_zero_advantage``, a loss that is not 0 at Â = 0 too."""
    import torch

    from vlrl.algos import PolicyLossInputs
    from vlrl.algos.losses import check_zero_at_zero_advantage
    from vlrl.train.batch import policy_loss

    try:
        fn = policy_loss(stage)
    except RegistryError:
        return []
    g = torch.Generator().manual_seed(0)
    logp, old = -torch.rand(2, 3, generator=g), -torch.rand(2, 3, generator=g)
    inputs = PolicyLossInputs(logp=logp, old_logp=old, advantages=torch.randn(2, 3, generator=g),
                              loss_mask=torch.ones(2, 3), behaviour_logp=old - 0.1, entropy=torch.rand(2, 3, generator=g))
    try:
        fn(inputs)
    except ValueError as err:
        return [("algo.policy_loss_options", f"{err} (policy_loss={stage.algo.policy_loss})")]
    if stage.train.skip_zero_advantage:
        try:
            check_zero_at_zero_advantage(fn, stage.algo.policy_loss)
        except ValueError as err:
            return [("train.skip_zero_advantage", str(err).removeprefix("train.skip_zero_advantage: "))]
    return []


def combination_problems(stage: Any) -> list[Problem]:
    """Settings that each work but not together."""
    from vlrl.algos import get_policy_loss
    from vlrl.algos.losses import applies_behaviour_weight

    problems = []
    multi_turn = stage.rollout.agent.function != "single_turn"
    correction = stage.algo.rollout_correction
    if correction.tis_cap is not None:
        try:
            own = applies_behaviour_weight(get_policy_loss(stage.algo.policy_loss))
        except RegistryError:
            own = False
        if own:
            problems.append(("algo.rollout_correction.tis_cap",
                             f"algo.policy_loss={stage.algo.policy_loss} applies the behaviour weight π_prox / π_behave, "
                             "the same ratio as TIS: both would count it twice; use one (or mis_cap alone)"))
        elif stage.rollout.mode == "async" and stage.staleness.apply_behaviour_weight:
            problems.append(("algo.rollout_correction.tis_cap",
                             "rollout.mode=async applies the behaviour weight π_prox / π_behave "
                             "(staleness.apply_behaviour_weight), the same ratio as TIS: both would count it twice; "
                             "set staleness.apply_behaviour_weight=false to correct with TIS instead"))
    for k, spec in enumerate(stage.algo.advantage_shaping):
        if spec.name == "step_credit" and spec.options.get("signal") == "forward_proxy" and multi_turn:
            problems.append((f"algo.advantage_shaping.{k}.options.signal",
                             f"forward_proxy scores single-turn responses (the teacher reads the prompt plus the "
                             f"reference plan), but rollout.agent.function={stage.rollout.agent.function}: use signal=rule "
                             f"for multi-turn episodes"))
    return problems
