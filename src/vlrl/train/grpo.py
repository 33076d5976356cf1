"""Synchronous GRPO-family RL with verifiable rewards — one step, top to bottom:

    1. draw prompts                    PromptCursor
    2. sample n responses per prompt   engine.generate        (behaviour log-probs recorded while sampling; a
                                                               multi-turn rollout runs whole episodes here)
    3. score                           score_groups           (the reward registry)
       (1–3: GroupSampler — with DAPO dynamic sampling it drops all-equal groups and back-fills; with ReMax
        it also scores one greedy response per prompt)
    4. shaped rewards → advantages     prepare_batch          (algo.reward_shaping → algo.advantage → algo.advantage_shaping;
                                                               π_old / π_ref passes only when needed)
    5. minibatch updates               ppo_update             (algo.policy_loss → aggregate (+ KL term) → AdamW)
    6. publish the new weights         engine.update_weights

The estimator, the loss, the aggregation and the shapers are looked up by name from config once
(`build_algorithm`); the step never branches on algorithm names. Everything but the order of the steps is
shared with the asynchronous recipe: the `Group` records, scoring and `flatten` (`vlrl.train.sampling`), the
informative-group filter (`vlrl.train.informative`), the set-up and the step's closing metrics (`vlrl.train.loop`), steps 4–5
(`vlrl.train.batch`, `vlrl.train.update`), the step metrics (`vlrl.train.metrics`) and the typed checkpoint state
(`vlrl.train.state`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack

from vlrl.config import RLStage
from vlrl.data import Sample
from vlrl.data.cursor import PromptCursor
from vlrl.models import Policy
from vlrl.report import MetricsLogger
from vlrl.rollout import Engine
from vlrl.synth.workflow import restore_synthesis, start_synthesis
from vlrl.train.batch import prepare_batch
from vlrl.train.informative import starved_warning
from vlrl.train.loop import (
    StageParts,
    analysis_dir,
    enter_stage,
    log_step,
    perf_metrics,
    rl_algorithm,
    trimmed,
)
from vlrl.train.metrics import step_metrics
from vlrl.train.result import StageResult
from vlrl.train.runtime import Runtime
from vlrl.train.sampling import GroupSampler, flatten, sampling_params
from vlrl.train.state import AlgorithmState, GroupRecord, SyncState, expect_state
from vlrl.train.update import ppo_update

SHOWN = ("reward/mean", "accuracy/mean", "policy/entropy", "perf/step_seconds")  # on the console at each log


def train_grpo(
    policy: Policy,
    engine: Engine,
    samples: list[Sample],
    stage: RLStage,
    *,
    logger: MetricsLogger,
    seed: int,
    stage_name: str = "rl",
    max_seconds: float | None = None,
    runtime: Runtime | None = None,
    validate: Callable[[int], None] | None = None,
) -> StageResult:
    """Run the RL loop; returns its `StageResult` (the last step's metrics, ``steps``, ``seconds``). ``validate(step)`` runs
    after every step (``eval.every``: `vlrl.train.validation.Validation`).

    ``runtime`` (`vlrl.train.runtime`; default one process, no checkpoints): under torchrun each rank
    generates and trains on its share of every step's prompts, advantages and logged metrics are those of the
    whole batch, and checkpoints resume the loop exactly (weights, optimizer, cursor, RNG, shaper states)."""
    rt = runtime or Runtime.single(policy.model)
    train, rollout = stage.train, stage.rollout
    budget = max_seconds if max_seconds is not None else train.max_seconds
    samples = trimmed(samples, stage)
    synthesis = start_synthesis(stage.synth, samples, seed=seed, logger=logger, ctx=rt.ctx)  # Syn-GRPO, or None
    stack = ExitStack()
    try:
        cursor = PromptCursor(synthesis.dataset if synthesis is not None else samples, seed)
        algorithm = rl_algorithm(stage, policy, rt, apply_behaviour_weight=False)  # π_behave = π_old
        sampler = GroupSampler(engine, cursor, sampling_params(rollout), prompts_per_step=train.prompts_per_step,
                               dynamic=stage.algo.dynamic_sampling, greedy_baseline="baseline_rewards" in algorithm.needs,
                               shard=lambda draws: rt.ctx.shard(draws, what="train.prompts_per_step"),
                               gather=rt.ctx.gather_objects, world_size=rt.ctx.world_size,
                               strict=stage.algo.strict_reward)
        parts = enter_stage(stack, policy, stage, rt, logger, stage_name)  # trainable, perf/mfu, optimizer, warnings
        step = _restore(rt, stage_name, parts, cursor, sampler, algorithm, synthesis)
        if step:
            engine.update_weights(version=step)
        run_dir = analysis_dir(logger, rt)  # shapers' analysis files
        start, last = time.time(), {}
        while step < train.steps and not rt.out_of_time(time.time() - start, budget):
            t0 = time.time()
            parts.perf.begin()
            # 1-3. prompts (this rank's share) → n responses each → rewards, as groups
            sampled = sampler.next_batch()
            parts.perf.phase("gen_")
            if sampled.metrics.get("sampling/starved"):
                logger.warn(starved_warning(step + 1, sampled.metrics, prompts_per_step=train.prompts_per_step))
            trajectories, baselines = flatten(sampled.groups)
            t_gen = time.time() - t0
            # 4. shaped rewards → advantages over the whole batch (B sequences, R response columns)
            batch = prepare_batch(algorithm, policy, trajectories, step=step, max_new_tokens=rollout.max_new_tokens,
                                  baseline_rewards=baselines, run_dir=run_dir)
            # 5. updates (and the critic's, when the estimator uses values)
            stats = ppo_update(policy, batch, algorithm.settings, parts.optimizer, parts.scheduler, seed=seed,
                               step=step, critic=algorithm.critic, runtime=rt)
            parts.perf.phase("")
            # 6. the engine samples from the new weights from now on
            step += 1
            engine.update_weights(version=step)
            last = step_metrics(batch, stats, sampled.groups, ctx=rt.ctx)
            if synthesis is not None:  # Syn-GRPO: send the chosen descriptions, swap finished images in (never waits)
                last.update(synthesis.after_step(trajectories, step, shaping=algorithm.reward_shaping))
                sampler.encode.forget(synthesis.retired())
            last.update(sampled.metrics)
            last.update(perf_metrics(parts, batch, t0, {"perf/gen_seconds": t_gen}))
            log_step(logger, stage, stage_name, step, last, SHOWN, parts)
            if rt.checkpoint_due(step):
                _save_checkpoint(rt, step, stage_name, parts, cursor, sampler, algorithm, synthesis)
            if validate is not None:
                validate(step)
    finally:
        stack.close()
        if synthesis is not None:
            synthesis.close()
    return StageResult(step, time.time() - start, last)


def _restore(rt: Runtime, stage_name: str, parts: StageParts, cursor: PromptCursor, sampler: GroupSampler,
             algorithm, synthesis) -> int:
    """Load the checkpoint ``rt`` resumes from, if any, into the optimizer, scheduler and data cursor, and the
    loop's `SyncState`: shapers, critic, dynamic sampling's surplus groups and the draw counter, Syn-GRPO's
    rewritten dataset and client. Returns the step to continue from (0 for a fresh start)."""
    step, carry = rt.restore(stage_name, parts.optimizer, parts.scheduler, cursor)
    state = expect_state(carry, SyncState, rt.resume_from)
    if state is not None:
        state.algorithm.restore(algorithm)
        sampler.carry, sampler.drawn = [g.restore() for g in state.carry], state.drawn
        restore_synthesis(synthesis, state.synth, rt.resume_from)  # the rewritten dataset, the client's jobs
    return step


def _save_checkpoint(rt: Runtime, step: int, stage_name: str, parts: StageParts, cursor: PromptCursor,
                     sampler: GroupSampler, algorithm, synthesis) -> None:
    """Checkpoint ``step``: weights, optimizer, RNG and the cursor (`Runtime.after_step`) plus the loop's
    `SyncState` — shaper states, critic, the draw counter, dynamic sampling's surplus groups, Syn-GRPO's state."""
    rt.after_step(step, stage_name, parts.optimizer, parts.scheduler, cursor, carry_over=SyncState(
        AlgorithmState.of(algorithm), sampler.drawn, [GroupRecord.of(g) for g in sampler.carry],
        synthesis.state() if synthesis is not None else None))
