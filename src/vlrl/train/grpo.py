"""Synchronous GRPO-family RL with verifiable rewards — one step, top to bottom:

    1. draw prompts                    PromptCursor
    2. sample n responses per prompt   engine.generate        (behaviour log-probs recorded while sampling)
    3. score                           score_trajectories     (the reward registry)
    4. advantages                      algo.advantage         (e.g. GRPO group normalisation)
    5. old / reference log-probs       one no-grad pass each, only when needed
    6. minibatch updates               algo.policy_loss → aggregate (+ KL term) → AdamW
    7. publish the new weights         engine.update_weights

The estimator, the loss and the aggregation are looked up by name from config; the step never branches on
algorithm names.
"""

from __future__ import annotations

import copy
import functools
import time
from collections import defaultdict
from collections.abc import Sequence

import torch

from vlrl.algos import (
    AdvantageInputs,
    PolicyLossInputs,
    aggregate,
    get_advantage,
    get_policy_loss,
    kl_estimate,
    masked_mean,
    normaliser_for,
)
from vlrl.config import RLStage
from vlrl.data import Sample
from vlrl.models import Policy, collate, response_logprobs
from vlrl.report import MetricsLogger
from vlrl.rewards import score_trajectories
from vlrl.rollout import Engine, Request, SamplingParams, Status, Trajectory
from vlrl.train.common import PromptCursor, clip_and_step, make_optimizer

_EXCLUDED = (Status.FAILED, Status.ABORTED)  # never trained on


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
    train, algo, rollout = stage.train, stage.algo, stage.rollout
    budget = max_seconds if max_seconds is not None else train.max_seconds
    if train.max_samples is not None:
        samples = samples[: train.max_samples]
    cursor = PromptCursor(samples, seed)
    sampling = SamplingParams(n=rollout.n, temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                              max_new_tokens=rollout.max_new_tokens, stop=list(rollout.stop))
    advantage_fn = functools.partial(get_advantage(algo.advantage), **algo.advantage_options)
    loss_fn = functools.partial(get_policy_loss(algo.policy_loss), clip_low=algo.clip_low, clip_high=algo.clip_high)
    reference = _frozen_copy(policy.model) if algo.kl_coef > 0 else None  # kl_coef = 0: no reference at all
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
        # 4. advantages over the whole batch (B sequences, R response columns)
        tensors = _batch_tensors(trajectories)
        advantages = advantage_fn(AdvantageInputs(
            token_rewards=tensors["token_rewards"], loss_mask=tensors["loss_mask"], group_index=tensors["group_index"],
        )).advantages  # (B, R)
        # 5. π_old is needed only if the weights move before the last minibatch; π_ref only with a KL term
        n_updates = train.ppo_epochs * train.minibatches
        old_logp = _score(model, policy, trajectories, rollout.temperature) if n_updates > 1 else None
        ref_logp = _score(reference, policy, trajectories, rollout.temperature) if reference is not None else None
        # 6. updates
        model.train()
        stats: dict[str, list[float]] = defaultdict(list)
        generator = torch.Generator().manual_seed(seed * 7919 + step)
        for _ in range(train.ppo_epochs):
            order = torch.randperm(len(trajectories), generator=generator) if train.minibatches > 1 else torch.arange(len(trajectories))
            for minibatch in order.chunk(train.minibatches):
                normaliser = normaliser_for(algo.loss_agg, tensors["loss_mask"][minibatch])
                for micro in minibatch.split(train.micro_batch_size):
                    rows = micro.tolist()
                    tokens = collate([trajectories[i].prompt_ids for i in rows], [trajectories[i].response_ids for i in rows],
                                     [trajectories[i].vision for i in rows], pad_token_id=policy.pad_token_id)
                    R = tokens.response_len
                    mask = tensors["loss_mask"][rows, :R]
                    logp, entropy = response_logprobs(model, policy.adapter, tokens, temperature=rollout.temperature,
                                                      with_entropy=True)
                    old = old_logp[rows, :R] if old_logp is not None else logp.detach()
                    out = loss_fn(PolicyLossInputs(logp=logp, old_logp=old, advantages=advantages[rows, :R],
                                                   loss_mask=mask, behaviour_logp=tensors["behaviour_logp"][rows, :R]))
                    loss = aggregate(out.per_token_loss, mask, algo.loss_agg, normaliser=normaliser)
                    if reference is not None:
                        kl = kl_estimate(logp, ref_logp[rows, :R], algo.kl_estimator)
                        loss = loss + algo.kl_coef * aggregate(kl, mask, algo.loss_agg, normaliser=normaliser)
                        stats["policy/kl_ref"].append(float(masked_mean(kl.detach(), mask)))
                    loss.backward()
                    stats["policy/loss"].append(float(loss.detach()))
                    stats["policy/entropy"].append(float(masked_mean(entropy.detach(), mask)))
                    stats["policy/approx_kl_old"].append(float(masked_mean(0.5 * (logp.detach() - old) ** 2, mask)))
                    for name, values in out.metrics.items():
                        stats[f"policy/{name}"].append(float(masked_mean(values, mask)))
                stats["policy/grad_norm"].append(clip_and_step(model, optimizer, scheduler, stage.optim.grad_clip))
        model.eval()
        # 7. the engine samples from the new weights from now on
        step += 1
        engine.update_weights(version=step)
        last = _step_metrics(trajectories, advantages, tensors, stats, score_report.failures)
        last.update({"perf/step_seconds": time.time() - t0, "perf/gen_seconds": t_gen,
                     "perf/tokens_per_s": float(tensors["loss_mask"].sum()) / max(time.time() - t0, 1e-9),
                     "data/epoch": cursor.epoch})
        if step % train.log_every == 0 or step == train.steps:
            logger.log(stage_name, step, last, show=("reward/mean", "accuracy/mean", "policy/entropy", "perf/step_seconds"))
    return {**last, "steps": step, "seconds": time.time() - start}


def _batch_tensors(trajectories: Sequence[Trajectory]) -> dict[str, torch.Tensor]:
    """Right-padded (B, R) response tensors: loss mask (0 for failed/aborted), behaviour log-probs, token
    rewards (the outcome reward on the last response token), and the group index (B,)."""
    B = len(trajectories)
    R = max(1, max(len(t.response_ids) for t in trajectories))
    loss_mask = torch.zeros(B, R)
    behaviour = torch.zeros(B, R)
    token_rewards = torch.zeros(B, R)
    for i, t in enumerate(trajectories):
        n = len(t.response_ids)
        if t.status not in _EXCLUDED:
            loss_mask[i, :n] = t.loss_mask.float()
        behaviour[i, :n] = t.behaviour_logp
        if n:
            token_rewards[i, n - 1] = float(t.reward)
    group_index = torch.tensor([t.group_index for t in trajectories])
    return {"loss_mask": loss_mask, "behaviour_logp": behaviour, "token_rewards": token_rewards, "group_index": group_index}


@torch.no_grad()
def _score(model: torch.nn.Module, policy: Policy, trajectories: Sequence[Trajectory], temperature: float) -> torch.Tensor:
    """Teacher-forced log-probs (B, R) of the trajectories' responses under ``model``."""
    tokens = collate([t.prompt_ids for t in trajectories], [t.response_ids for t in trajectories],
                     [t.vision for t in trajectories], pad_token_id=policy.pad_token_id)
    was_training = model.training
    model.eval()
    logp, _ = response_logprobs(model, policy.adapter, tokens, temperature=temperature)
    model.train(was_training)
    return logp


def _frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    reference = copy.deepcopy(model).eval()
    for p in reference.parameters():
        p.requires_grad_(False)
    return reference


def _step_metrics(trajectories, advantages, tensors, stats, failures) -> dict[str, float]:
    rewards = torch.tensor([t.reward for t in trajectories])
    metrics: dict[str, float] = {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "reward/failures": len(failures),
    }
    by_task: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajectories:
        by_task[t.sample.task].append(t)
    accuracies = []
    for task, group in sorted(by_task.items()):
        metrics[f"reward/{task}"] = sum(t.reward for t in group) / len(group)
        acc = [t.reward_parts.get("accuracy") for t in group if "accuracy" in t.reward_parts]
        if acc:
            metrics[f"accuracy/{task}"] = sum(acc) / len(acc)
            accuracies.append(metrics[f"accuracy/{task}"])
    if accuracies:
        metrics["accuracy/mean"] = sum(accuracies) / len(accuracies)
    lengths = torch.tensor([len(t.response_ids) for t in trajectories], dtype=torch.float)
    metrics["response/length_mean"] = float(lengths.mean())
    metrics["response/length_max"] = float(lengths.max())
    metrics["response/truncated_frac"] = sum(t.status is Status.TRUNCATED for t in trajectories) / len(trajectories)
    seq_adv = (advantages.abs() * tensors["loss_mask"]).sum(-1)  # (B,)
    groups = tensors["group_index"]
    zero = [bool((seq_adv[groups == g] == 0).all()) for g in groups.unique()]
    metrics["policy/zero_adv_groups_frac"] = sum(zero) / len(zero)
    for name, values in stats.items():
        metrics[name] = sum(values) / len(values)
    return metrics
