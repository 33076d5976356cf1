"""Synchronous GRPO-family RL with verifiable rewards — one step, top to bottom:

    1. draw prompts                    PromptCursor
    2. sample n responses per prompt   engine.generate        (behaviour log-probs recorded while sampling)
    3. score                           score_trajectories     (the reward registry)
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
from vlrl.rewards import score_trajectories
from vlrl.rollout import Engine, Request, SamplingParams
from vlrl.train.batch import build_algorithm, prepare_batch, step_metrics
from vlrl.train.common import PromptCursor, make_optimizer
from vlrl.train.update import ppo_update


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
) -> dict[str, float]:
    """Run the RL loop; returns the last step's metrics plus ``steps`` and ``seconds``."""
    train, rollout = stage.train, stage.rollout
    budget = max_seconds if max_seconds is not None else train.max_seconds
    if train.max_samples is not None:
        samples = samples[: train.max_samples]
    cursor = PromptCursor(samples, seed)
    sampling = SamplingParams(n=rollout.n, temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                              max_new_tokens=rollout.max_new_tokens, stop=list(rollout.stop))
    algorithm = build_algorithm(stage, policy, apply_behaviour_weight=False)  # sync: π_behave = π_old
    model = policy.model
    optimizer, scheduler = make_optimizer(model, stage.optim)
    requests: dict[str, Request] = {}
    start, last, step = time.time(), {}, 0
    while step < train.steps and not (budget is not None and time.time() - start >= budget):
        t0 = time.time()
        # 1-2. prompts → n responses each
        prompts = cursor.next(train.prompts_per_step)
        batch_requests = [requests.setdefault(s.id, engine.encode(s)) for s in prompts]
        trajectories = engine.generate(batch_requests, sampling)
        t_gen = time.time() - t0
        # 3. rewards
        score_report = score_trajectories(trajectories)
        # 4. shaped rewards → advantages over the whole batch (B sequences, R response columns)
        batch = prepare_batch(algorithm, policy, trajectories, step=step, max_new_tokens=rollout.max_new_tokens,
                              run_dir=logger.path.parent if logger.path is not None else None)
        # 5. updates
        stats = ppo_update(policy, batch, algorithm.settings, optimizer, scheduler, seed=seed, step=step)
        # 6. the engine samples from the new weights from now on
        step += 1
        engine.update_weights(version=step)
        last = step_metrics(batch, stats, score_report.failures)
        last.update({"perf/step_seconds": time.time() - t0, "perf/gen_seconds": t_gen,
                     "perf/tokens_per_s": float(batch.loss_mask.sum()) / max(time.time() - t0, 1e-9),
                     "data/epoch": cursor.epoch})
        if step % train.log_every == 0 or step == train.steps:
            logger.log(stage_name, step, last, show=("reward/mean", "accuracy/mean", "policy/entropy", "perf/step_seconds"))
    return {**last, "steps": step, "seconds": time.time() - start}
