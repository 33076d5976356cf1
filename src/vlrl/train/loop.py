"""The set-up both RL recipes share (`vlrl.train.grpo`, `vlrl.train.async_grpo`), and the metrics and log line
that close each of their steps. Each recipe calls these in its own order:

    trimmed        train.max_samples
    rl_algorithm   `build_algorithm` once, its estimator and reward shapers over every rank's responses
    enter_stage    train.trainable and gradient checkpointing, the phase meter (perf/mfu), optimizer + scheduler,
                   the step's warnings (`StepWatches`: zero-advantage groups, answers no longer well-formed)
    perf_metrics   perf/step_seconds, the recipe's own timings, policy/lr, perf/tokens_per_s, perf/mfu …
    log_step       the warnings read every step's metrics; logged every train.log_every steps and at the last
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch

from vlrl.config import RLStage
from vlrl.data import Sample
from vlrl.models import Policy
from vlrl.report import MetricsLogger
from vlrl.train.batch import Algorithm, build_algorithm
from vlrl.train.budget import PhaseMeter, compute_dtype
from vlrl.train.common import make_optimizer
from vlrl.train.distributed import GlobalAdvantage, GlobalRewardShaping
from vlrl.train.modules import StageModules, stage_modules
from vlrl.train.runtime import Runtime
from vlrl.train.update import UpdateBatch
from vlrl.train.watches import StepWatches


@dataclass
class StageParts:
    """What a stage trains with, set up by `enter_stage`: the trainable modules, the phase meter, the optimizer and
    its learning-rate scheduler, and the warnings its steps' metrics can raise."""

    modules: StageModules
    perf: PhaseMeter
    optimizer: torch.optim.Optimizer
    scheduler: Any
    watches: StepWatches


def trimmed(samples: list[Sample], stage: RLStage) -> list[Sample]:
    """The first ``train.max_samples`` samples (all of them when unset)."""
    return samples[: stage.train.max_samples] if stage.train.max_samples is not None else samples


def rl_algorithm(stage: RLStage, policy: Policy, rt: Runtime, *, apply_behaviour_weight: bool) -> Algorithm:
    """``stage.algo`` bound once (`build_algorithm`), its estimator over all ranks' responses and its batch-level
    reward shapers (e.g. syn_diversity's EMA) over the whole batch."""
    algorithm = build_algorithm(stage, policy, apply_behaviour_weight=apply_behaviour_weight, reference=rt.reference,
                                critic_model=rt.critic, ctx=rt.ctx)
    algorithm.advantage_fn = GlobalAdvantage(algorithm.advantage_fn, rt.ctx)  # over all ranks' responses
    algorithm.reward_shaping = GlobalRewardShaping.over(algorithm.reward_shaping, rt.ctx)  # batch-level shapers
    return algorithm


def enter_stage(stack: ExitStack, policy: Policy, stage: RLStage, rt: Runtime, logger: MetricsLogger,
                stage_name: str) -> StageParts:
    """train.trainable and gradient checkpointing (undone when ``stack`` closes), the phase meter of perf/mfu
    (generation and update), then the optimizer and scheduler over the stage's trainable parameters, and the
    step's warnings (said by rank 0)."""
    modules = stack.enter_context(stage_modules(policy, stage.train))
    model = policy.model
    perf = stack.enter_context(PhaseMeter(model, rt.ctx.device, compute_dtype(model, rt.cfg.mixed_precision), rt.ctx))
    optimizer, scheduler = make_optimizer(model, stage.optim, policy.adapter.module_groups,
                                          total_steps=stage.train.steps)
    return StageParts(modules, perf, optimizer, scheduler, StepWatches(logger, stage_name, enabled=rt.ctx.is_main))


def perf_metrics(parts: StageParts, batch: UpdateBatch, t0: float, seconds: dict[str, float]) -> dict[str, float]:
    """The step's closing metrics: its seconds since ``t0``, the recipe's own timings (``seconds``), the trainable
    parameters, the learning rate, gradient checkpointing, trained tokens per second and the phases' perf/…"""
    return {"perf/step_seconds": time.time() - t0, **seconds,
            "policy/trainable_params": parts.modules.trainable_params, "policy/lr": parts.scheduler.get_last_lr()[0],
            "perf/gradient_checkpointing": float(parts.modules.gradient_checkpointing),
            "perf/tokens_per_s": float(batch.loss_mask.sum()) / max(time.time() - t0, 1e-9),
            **parts.perf.metrics()}


def analysis_dir(logger: MetricsLogger, rt: Runtime):
    """Where shapers write their analysis files: the run directory on rank 0, else None."""
    return logger.path.parent if logger.path is not None and rt.ctx.is_main else None


def log_step(logger: MetricsLogger, stage: RLStage, stage_name: str, step: int, last: dict[str, float],
             show: tuple[str, ...], parts: StageParts) -> None:
    """Let the stage's warnings read ``last`` (every step), then log it every ``train.log_every`` steps and at the
    last step, showing ``show`` on the console."""
    parts.watches.update(step, last)
    if step % stage.train.log_every == 0 or step == stage.train.steps:
        logger.log(stage_name, step, last, show=show)
