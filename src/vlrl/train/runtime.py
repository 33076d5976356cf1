"""The runtime of a training loop: the process context, the module to train (wrapped for DDP / FSDP2), the
frozen reference and the checkpointer — what a loop needs beyond the model to run on N ranks and to survive
a kill. `make_runtime` builds it from a run's config; `Runtime.single` is the one-process default.

(`vlrl.train.distributed` is torch.distributed itself, `vlrl.train.checkpoint` the files; this module joins the
two, so neither imports the other's user.)
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vlrl.config import DistConfig
from vlrl.data.cursor import PromptCursor
from vlrl.train.checkpoint import Checkpointer
from vlrl.train.common import frozen_copy, seed_everything
from vlrl.train.distributed import MIXED_DTYPES, DistContext, gradient_sync, wrap_critic, wrap_model


@dataclass
class Runtime:
    """What a training loop needs beyond the model to run on N ranks and to survive a kill: the process
    context, the module to train (wrapped), and the checkpointer (with the checkpoint to resume from)."""

    ctx: DistContext
    module: torch.nn.Module
    cfg: DistConfig = field(default_factory=DistConfig)
    checkpointer: Checkpointer | None = None
    reference: torch.nn.Module | None = None  # RL with a KL term: the frozen reference, sharded like the actor
    critic: torch.nn.Module | None = None  # RL with a value-based estimator: the value model, wrapped like the actor

    @property
    def resume_from(self) -> Path | None:
        """The checkpoint this run resumes from (None: a fresh start)."""
        return self.checkpointer.resume_from if self.checkpointer is not None else None

    @classmethod
    def single(cls, model: torch.nn.Module) -> Runtime:
        """One process, no checkpoints: the loops' default."""
        return cls(DistContext(device=next(model.parameters()).device), model)

    def gradient_sync(self, last: bool):
        return gradient_sync(self.module, last)

    def global_normaliser(self, local_count: float) -> float:
        """This rank's loss denominator for a count (tokens or sequences) of its shard: Σ_ranks count / W."""
        return self.ctx.local_normaliser(self.ctx.all_reduce_sum([local_count])[0])

    def autocast(self):
        """torch.autocast for DDP and single-process mixed precision (FSDP2 casts through its own policy)."""
        from torch.distributed.fsdp import FSDPModule

        if self.cfg.mixed_precision == "none" or isinstance(self.module, FSDPModule):
            return nullcontext()
        return torch.autocast(self.ctx.device.type, dtype=MIXED_DTYPES[self.cfg.mixed_precision])

    def out_of_time(self, elapsed: float, budget: float | None) -> bool:
        """The wall-clock budget is spent (all ranks agree, so they stop at the same step)."""
        return budget is not None and self.ctx.any(elapsed >= budget)

    def restore(self, stage: str, optimizer, scheduler, cursor: PromptCursor) -> tuple[int, Any]:
        """Load the checkpoint to resume from, if any: weights, optimizer, scheduler, cursor, RNG states.
        Returns (step, this rank's carry-over state); (0, None) for a fresh start."""
        if self.checkpointer is None or self.checkpointer.resume_from is None:
            return 0, None
        from vlrl.train.checkpoint import CheckpointError

        state = self.checkpointer.load(self.checkpointer.resume_from, stage=stage, module=self.module,
                                       optimizer=optimizer, scheduler=scheduler)
        try:
            cursor.load_state(state["cursor"])
            return int(state["step"]), state["carry_over"]
        except (KeyError, TypeError, ValueError) as err:  # a trainer state that does not fit: one line
            raise CheckpointError(f"{self.checkpointer.resume_from}: its data cursor cannot be restored "
                                  f"({type(err).__name__}: {err})") from None

    def checkpoint_due(self, step: int) -> bool:
        """A checkpoint is written at ``step`` (loops with state that is costly to gather ask first)."""
        return self.checkpointer is not None and self.checkpointer.due(step)

    def after_step(self, step: int, stage: str, optimizer, scheduler, cursor: PromptCursor,
                   carry_over: Any = None) -> None:
        """Save a checkpoint when one is due at ``step``."""
        if self.checkpoint_due(step):
            self.checkpointer.save(step, stage=stage, module=self.module, optimizer=optimizer, scheduler=scheduler,
                                   cursor=cursor.state(), carry_over=carry_over)




def make_runtime(cfg, ctx: DistContext, policy, run_dir, resume_from=None) -> Runtime:
    """Wrap the policy's model for ``cfg.dist`` and attach the checkpointer of ``run_dir`` (resuming from
    ``resume_from`` when given). With several ranks each rank then draws from its own random stream
    (seed + rank), after the weights were built identically everywhere."""
    algo = getattr(cfg, "algo", None)
    reference = None
    if ctx.enabled and algo is not None and algo.kl_coef > 0 and policy.lora is None:  # copied before sharding
        # (LoRA: the reference is the actor with its adapters disabled, `vlrl.train.batch.reference_model`)
        reference = wrap_model(frozen_copy(policy.model), ctx, cfg.dist.model_copy(update={"strategy": "fsdp"})) \
            if cfg.dist.strategy == "fsdp" else frozen_copy(policy.model)
    critic = None
    if algo is not None and needs_critic(algo.advantage):  # built before the actor is sharded in place
        from vlrl.train.critic import ValueModel

        critic = wrap_critic(ValueModel(policy), ctx, cfg.dist)
    module = wrap_model(policy.model, ctx, cfg.dist)
    if ctx.enabled:
        seed_everything(cfg.seed + ctx.rank)
    checkpointer = Checkpointer(Path(run_dir) / "checkpoints", cfg.checkpoint, ctx, policy=policy,
                                metrics_path=Path(run_dir) / "metrics.jsonl", resume_from=resume_from)
    return Runtime(ctx, module, cfg.dist, checkpointer, reference, critic)


def needs_critic(advantage: str) -> bool:
    """The estimator ``algo.advantage`` uses critic values (gae)."""
    from vlrl.algos import advantage_needs, get_advantage

    return "values" in advantage_needs(get_advantage(advantage))
