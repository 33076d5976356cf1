"""One RL loop over two values — a feed of scored groups and a learner — for synchronous and asynchronous RL alike
(slime's ``train.py`` / ``train_async.py``; AReaL's ``rl_trainer.py``). Read it top to bottom:

    restore                      weights, optimizer, cursor, RNG; the learner's and the feed's states (`RLState`)
    feed.start                   the rollout starts from the trainer's weights
    each step:
      feed.next_batch            1-3. prompts → n responses each → rewards, as groups (`vlrl.feed`: sync generates
                                      them now; async dequeues what its workers generated, older than η dropped)
      learner.step               4-5. shaped rewards → advantages, the minibatch updates (`vlrl.train.learner`)
      feed.publish               6.   the engine samples from the new weights (the feed is its only publisher)
      feed.finish_step           Syn-GRPO's swaps, sampling/…, staleness/…; then log, checkpoint, validate

Which feed and learner a stage gets is `train_rl`'s business (``rollout.mode``); the loop never asks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from vlrl.algos import advantage_needs, get_advantage
from vlrl.config import RLStage
from vlrl.data import Sample
from vlrl.feed.build import build_feed
from vlrl.feed.types import Feed
from vlrl.models import Policy
from vlrl.report import MetricsLogger
from vlrl.rollout import Engine
from vlrl.train.learner import Learner
from vlrl.train.result import StageResult
from vlrl.train.runtime import Runtime
from vlrl.train.state import RLState, expect_state
from vlrl.train.validation import Validation


def rl_loop(feed: Feed, learner: Learner, rt: Runtime, logger: MetricsLogger, stage: RLStage, *, stage_name: str,
            budget: float | None, validate: Callable[[int], None] | None = None) -> StageResult:
    """Train ``stage.train.steps`` steps (or until ``budget`` seconds): see the module docstring."""
    step = restore(rt, stage_name, feed, learner)
    feed.start(step, learner.weights)
    start, last, drained = time.time(), {}, False
    try:
        while step < stage.train.steps and not rt.out_of_time(time.time() - start, budget):
            t0 = time.time()
            learner.perf.begin()
            batch = feed.next_batch(step)  # 1-3. this rank's share of the step's scored groups
            learner.perf.phase("gen_")
            learned = learner.step(batch, step)  # 4-5. advantages, the update (and the critic's)
            step += 1
            feed.publish(step, learner.weights)  # 6. the engine samples from the new weights from now on
            last = {**learned.metrics, **feed.finish_step(batch, step, learned.reward_shaping),
                    **learner.perf_metrics(t0, learned)}
            learner.watches.update(step, last)  # the step's warnings read every step's metrics
            if step % stage.train.log_every == 0 or step == stage.train.steps:
                logger.log(stage_name, step, last, show=feed.shown)
            if rt.checkpoint_due(step):
                save(rt, step, stage_name, feed, learner)
            if validate is not None:
                validate(step)
        drained = True
    finally:
        feed.close(drained)
        learner.close()
    return StageResult(step, time.time() - start, last)


def restore(rt: Runtime, stage_name: str, feed: Feed, learner: Learner) -> int:
    """Load the checkpoint ``rt`` resumes from, if any, into the optimizer, scheduler, the feed's data cursor, the
    learner (shapers, critic) and the feed (its carried groups or rollout cut, Syn-GRPO). Returns the step to
    continue from (0 for a fresh start)."""
    step, carry = rt.restore(stage_name, learner.optimizer, learner.scheduler, feed.cursor)
    state = expect_state(carry, feed.state_type, rt.resume_from)
    if state is not None:
        learner.load_state(state.algorithm)
        feed.load_state(state.feed, rt.resume_from)
    return step


def save(rt: Runtime, step: int, stage_name: str, feed: Feed, learner: Learner) -> None:
    """Checkpoint ``step``: weights, optimizer, RNG and the feed's cursor (`Runtime.after_step`) plus the `RLState`."""
    cursor, feed_state = feed.state()
    rt.after_step(step, stage_name, learner.optimizer, learner.scheduler, cursor,
                  carry_over=RLState(learner.state(), feed_state))


def train_rl(policy: Policy, engine: Engine, samples: list[Sample], stage: RLStage, *, logger: MetricsLogger,
             seed: int, stage_name: str = "rl", max_seconds: float | None = None, runtime: Runtime | None = None,
             validate: Callable[[int], None] | None = None, state_out: dict[str, Any] | None = None) -> StageResult:
    """An RL stage: its learner and its feed (`vlrl.feed.build.build_feed`, by ``rollout.mode``), then `rl_loop`.

    ``runtime`` (`vlrl.train.runtime`; default one process, no checkpoints): under torchrun each rank trains on its
    share of every step's groups, advantages and logged metrics are those of the whole batch, and checkpoints resume
    the loop (weights, optimizer, cursor, RNG, shaper states, the feed's state — an asynchronous run's is not
    bitwise the uninterrupted one's: what is in flight when depends on timing). ``validate(step)`` runs after every
    step (``eval.every``: `vlrl.train.validation.Validation`). ``state_out`` receives the feed's final accounting
    (`Feed.final_state`: an asynchronous feed's draw tickets of every bucket, rank 0's under torchrun)."""
    rt = runtime or Runtime.single(policy.model)
    if validate is not None and stage.rollout.mode == "async" and rt.ctx.enabled:
        raise ValueError("eval.every with rollout.mode=async runs in one process (rank 0 alone holds the rollout's "
                         "weights); under torchrun set eval.every=0 or rollout.mode=sync")
    feed = build_feed(engine, samples, stage, seed=seed, logger=logger, ranks=rt.ctx,  # (refuses what it cannot run)
                      greedy_baseline="baseline_rewards" in advantage_needs(get_advantage(stage.algo.advantage)))
    if isinstance(validate, Validation):
        validate.hold = feed.aside  # an asynchronous feed: the step's weights in the engine, the rollout paused
    try:
        learner = Learner(policy, stage, rt, logger, stage_name, seed=seed,
                          decoupled=stage.rollout.mode == "async" and stage.staleness.apply_behaviour_weight)
    except BaseException:
        feed.close(False)
        raise
    result = rl_loop(feed, learner, rt, logger, stage, stage_name=stage_name, validate=validate,
                     budget=max_seconds if max_seconds is not None else stage.train.max_seconds)
    if state_out is not None:
        state_out.update(feed.final_state())
    return result
