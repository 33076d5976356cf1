"""The learner: a step's groups in, an update out — AReaL's ``prepare_batch`` → update, verl's actor. It holds what
``stage.algo`` binds once (`vlrl.train.batch.build_algorithm`: the estimator, the loss, the shapers, π_ref, the
critic) and what a stage trains with (the trainable modules, the optimizer and its scheduler, the phase meter, the
step's warnings); the RL loop (`vlrl.train.loop`) only calls it.

    step(batch, step)   shaped rewards → advantages (π_old / π_ref / critic passes when needed: `prepare_batch`),
                        the minibatch updates (`ppo_update`, the critic's too), the step's metrics (`step_metrics`)
    weights()           the trainer's full state dict (gathered from FSDP2 shards: a collective), for the feed to
                        publish
    state() / load_state(...)   the shapers' states and the critic (`vlrl.train.state.AlgorithmState`)

With an asynchronous feed the loss is decoupled: w · L_clip(π_θ / π_prox), w = min(π_prox / π_behave, cap), when
``staleness.apply_behaviour_weight``; π_prox is the weights at the start of the step (one teacher-forced pass, only
when the weights move within the step: `prepare_batch`).
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from vlrl.config import RLStage
from vlrl.feed.types import FeedBatch
from vlrl.models import Policy
from vlrl.report import MetricsLogger
from vlrl.train.batch import ShapingChain, build_algorithm, prepare_batch
from vlrl.train.budget import PhaseMeter, compute_dtype
from vlrl.train.common import make_optimizer
from vlrl.train.distributed import GlobalAdvantage, GlobalRewardShaping
from vlrl.train.metrics import step_metrics
from vlrl.train.modules import StageModules, stage_modules
from vlrl.train.runtime import Runtime
from vlrl.train.state import AlgorithmState
from vlrl.train.update import ppo_update
from vlrl.train.watches import StepWatches


@dataclass
class StepStats:
    """What one learner step reports: the step's metrics (`vlrl.train.metrics.step_metrics`: reward/…, accuracy/…,
    response/…, policy/…, shaping/…, agent/…, data/epoch — the whole batch's under torchrun), the tokens it trained
    on, and the reward-shaping chain as the step left it (Syn-GRPO reads its ``syn_diversity``)."""

    metrics: dict[str, float]
    tokens: float
    reward_shaping: ShapingChain


class Learner:
    """``stage`` bound once over ``policy`` on ``rt``'s ranks. ``decoupled``: the asynchronous objective's behaviour
    weight (``staleness.apply_behaviour_weight``); the synchronous feed's π_behave is π_old."""

    def __init__(self, policy: Policy, stage: RLStage, rt: Runtime, logger: MetricsLogger, stage_name: str, *,
                 seed: int, decoupled: bool) -> None:
        self.policy, self.stage, self.rt, self.seed = policy, stage, rt, seed
        self.algorithm = build_algorithm(stage, policy, apply_behaviour_weight=decoupled, reference=rt.reference,
                                         critic_model=rt.critic, ctx=rt.ctx)
        self.algorithm.advantage_fn = GlobalAdvantage(self.algorithm.advantage_fn, rt.ctx)  # over all ranks' responses
        self.algorithm.reward_shaping = GlobalRewardShaping.over(self.algorithm.reward_shaping, rt.ctx)  # batch-level
        self.stack = ExitStack()  # train.trainable and gradient checkpointing, undone at `close`
        teacher_close = getattr(self.algorithm.teacher, "close", None)
        if teacher_close is not None:  # a teacher on servers (algo.distill.teacher_urls): its HTTP client
            self.stack.callback(teacher_close)
        self.modules: StageModules = self.stack.enter_context(stage_modules(policy, stage.train))
        model = policy.model
        self.perf = self.stack.enter_context(PhaseMeter(model, rt.ctx.device, compute_dtype(model, rt.cfg.mixed_precision),
                                                        rt.ctx))  # perf/mfu of the update and of generation
        self.optimizer, self.scheduler = make_optimizer(model, stage.optim, policy.adapter.module_groups,
                                                        total_steps=stage.train.steps)
        self.watches = StepWatches(logger, stage_name, enabled=rt.ctx.is_main,  # zero-advantage, well-formed
                                   loss_beside_advantage=self.algorithm.settings.distill_coef > 0)
        self.run_dir = logger.path.parent if logger.path is not None and rt.ctx.is_main else None  # shapers' files

    def step(self, batch: FeedBatch, step: int) -> StepStats:
        """Advantages over the whole batch (B sequences, R response columns), the updates (and the critic's), the
        step's metrics. The phase meter's update phase closes here (the loop opened it)."""
        same_version = None  # the drift metrics' tokens: those sampled by the trainer's weights (async; each its own)
        if batch.staleness is not None:
            same_version = pad_sequence([t.versions == step for t in batch.trajectories], batch_first=True)  # (B, R)
        prepared = prepare_batch(self.algorithm, self.policy, batch.trajectories, step=step,
                                 max_new_tokens=self.stage.rollout.max_new_tokens, same_version=same_version,
                                 baseline_rewards=batch.baselines, run_dir=self.run_dir)
        stats = ppo_update(self.policy, prepared, self.algorithm.settings, self.optimizer, self.scheduler,
                           seed=self.seed, step=step, critic=self.algorithm.critic, runtime=self.rt)
        self.perf.phase("")
        metrics = step_metrics(prepared, stats, batch.groups, ctx=self.rt.ctx)
        return StepStats(metrics, float(prepared.loss_mask.sum()), self.algorithm.reward_shaping)

    def weights(self) -> dict[str, torch.Tensor]:
        """The trainer's weights, whole: FSDP2 shards gathered (every rank calls it; rank 0 gets them, on the CPU)."""
        state = self.policy.model.state_dict()
        if any(hasattr(t, "full_tensor") for t in state.values()):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            state = get_model_state_dict(self.policy.model,
                                         options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return state

    def perf_metrics(self, t0: float, learned: StepStats) -> dict[str, float]:
        """The step's closing metrics: its seconds since ``t0``, the trainable parameters, the learning rate,
        gradient checkpointing, trained tokens per second and the phases' perf/…"""
        return {"perf/step_seconds": time.time() - t0,
                "policy/trainable_params": self.modules.trainable_params, "policy/lr": self.scheduler.get_last_lr()[0],
                "perf/gradient_checkpointing": float(self.modules.gradient_checkpointing),
                "perf/tokens_per_s": learned.tokens / max(time.time() - t0, 1e-9), **self.perf.metrics()}

    def state(self) -> AlgorithmState:
        return AlgorithmState.of(self.algorithm)

    def load_state(self, state: AlgorithmState) -> None:
        state.restore(self.algorithm)

    def close(self) -> None:
        self.stack.close()
