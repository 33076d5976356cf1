"""Synchronous GRPO-family RL with verifiable rewards — one step, top to bottom:

    1. draw prompts                    PromptCursor
    2. sample n responses per prompt   engine.generate        (behaviour log-probs recorded while sampling)
    3. score                           score_trajectories     (the reward registry)
       (1–3: GroupSampler — with DAPO dynamic sampling it drops all-equal groups and back-fills; with ReMax
        it also scores one greedy response per prompt)
    4. shaped rewards → advantages     prepare_batch          (algo.reward_shaping → algo.advantage → algo.advantage_shaping;
                                                               π_old / π_ref passes only when needed)
    5. minibatch updates               ppo_update             (algo.policy_loss → aggregate (+ KL term) → AdamW)
    6. publish the new weights         engine.update_weights

The estimator, the loss, the aggregation and the shapers are looked up by name from config once
(`build_algorithm`); the step never branches on algorithm names. Steps 4–5 are shared with the
asynchronous recipe (`vlrl.train.batch`, `vlrl.train.update`).
"""

from __future__ import annotations

import time

from vlrl.config import RLStage
from vlrl.data import Sample
from vlrl.models import Policy
from vlrl.report import MetricsLogger
from vlrl.rollout import Engine, SamplingParams
from vlrl.synth.workflow import start_synthesis
from vlrl.train.batch import build_algorithm, prepare_batch
from vlrl.train.checkpoint import algorithm_state, load_algorithm_state
from vlrl.train.common import PromptCursor, make_optimizer
from vlrl.train.distributed import GlobalAdvantage, Runtime, global_step_metrics
from vlrl.train.sampling import GroupSampler
from vlrl.train.update import ppo_update
from vlrl.train.zero_advantage import ZeroAdvantageWatch


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
) -> dict[str, float]:
    """Run the RL loop; returns the last step's metrics plus ``steps`` and ``seconds``.

    ``runtime`` (`vlrl.train.distributed`; default one process, no checkpoints): under torchrun each rank
    generates and trains on its share of every step's prompts, advantages and logged metrics are those of the
    whole batch, and checkpoints resume the loop exactly (weights, optimizer, cursor, RNG, shaper states)."""
    rt = runtime or Runtime.single(policy.model)
    train, rollout = stage.train, stage.rollout
    budget = max_seconds if max_seconds is not None else train.max_seconds
    if train.max_samples is not None:
        samples = samples[: train.max_samples]
    synthesis = start_synthesis(stage.synth, samples, seed=seed, logger=logger)  # Syn-GRPO; None unless synth.enabled
    try:
        cursor = PromptCursor(synthesis.dataset if synthesis is not None else samples, seed)
        sampling = SamplingParams(n=rollout.n, temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                                  max_new_tokens=rollout.max_new_tokens, stop=list(rollout.stop))
        algorithm = build_algorithm(stage, policy, apply_behaviour_weight=False, reference=rt.reference)  # π_behave = π_old
        algorithm.advantage_fn = GlobalAdvantage(algorithm.advantage_fn, rt.ctx)  # over all ranks' responses
        sampler = GroupSampler(engine, cursor, sampling, prompts_per_step=train.prompts_per_step,
                               dynamic=stage.algo.dynamic_sampling, greedy_baseline="baseline_rewards" in algorithm.needs,
                               shard=lambda prompts: rt.ctx.shard(prompts, what="train.prompts_per_step"))
        optimizer, scheduler = make_optimizer(rt.module, stage.optim)
        step, carry_over = rt.restore(stage_name, optimizer, scheduler, cursor)
        if carry_over and "rollout" in carry_over:  # its buffered groups and in-flight prompts would be lost
            raise ValueError(f"checkpoint.resume: {rt.checkpointer.resume_from} was written by the asynchronous "
                             "recipe; resume it with rollout.mode=async")
        load_algorithm_state(algorithm, carry_over)
        if carry_over:  # dynamic sampling's surplus groups and the critic resume too
            sampler.carry = list(carry_over.get("sampler_carry") or [])
            if algorithm.critic is not None:
                algorithm.critic.load_state_dict(carry_over["critic"])
        if step:
            engine.update_weights(version=step)
        run_dir = logger.path.parent if logger.path is not None and rt.ctx.is_main else None  # shapers' analysis files
        start, last = time.time(), {}
        zero_advantage = ZeroAdvantageWatch(logger, stage_name)  # one warning when most groups carry no signal
        while step < train.steps and not rt.out_of_time(time.time() - start, budget):
            t0 = time.time()
            # 1-3. prompts (this rank's share) → n responses each → rewards
            sampled = sampler.next_batch()
            t_gen = time.time() - t0
            # 4. shaped rewards → advantages over the whole batch (B sequences, R response columns)
            batch = prepare_batch(algorithm, policy, sampled.trajectories, step=step, max_new_tokens=rollout.max_new_tokens,
                                  baseline_rewards=sampled.baseline_rewards, run_dir=run_dir)
            # 5. updates (and the critic's, when the estimator uses values)
            stats = ppo_update(policy, batch, algorithm.settings, optimizer, scheduler, seed=seed, step=step,
                               critic=algorithm.critic, runtime=rt)
            # 6. the engine samples from the new weights from now on
            step += 1
            engine.update_weights(version=step)
            last = global_step_metrics(rt.ctx, batch, stats, sampled.failures)
            if synthesis is not None:  # Syn-GRPO: send the chosen descriptions, swap finished images in (never waits)
                last.update(synthesis.after_step(sampled.trajectories, step, shaping=algorithm.reward_shaping))
                sampler.forget(synthesis.retired())
            last.update({**sampled.metrics, "perf/step_seconds": time.time() - t0, "perf/gen_seconds": t_gen,
                         "perf/tokens_per_s": float(batch.loss_mask.sum()) / max(time.time() - t0, 1e-9),
                         "data/epoch": cursor.epoch})
            if rt.ctx.is_main:
                zero_advantage.update(step, last)
            if step % train.log_every == 0 or step == train.steps:
                logger.log(stage_name, step, last, show=("reward/mean", "accuracy/mean", "policy/entropy", "perf/step_seconds"))
            rt.after_step(step, stage_name, optimizer, scheduler, cursor, carry_over={
                **algorithm_state(algorithm), "sampler_carry": sampler.carry,
                "critic": algorithm.critic.state_dict() if algorithm.critic is not None else None})
    finally:
        if synthesis is not None:
            synthesis.close()
    return {**last, "steps": step, "seconds": time.time() - start}
