"""The critic of PPO with GAE: a value model built from the policy's backbone plus a scalar head.

    V(s_t) = w · h_t + b          h_t = last hidden state of the backbone at the position that predicts token t

The backbone is a copy of the policy's transformer (its own weights from the policy's current ones; the
language-model head is dropped), the head is zero-initialised (V ≡ 0 at the start, so the first advantages
are the returns). It has its own AdamW optimizer and is trained with the clipped value loss
(`vlrl.algos.losses.value_loss`) on the GAE returns, minibatch by minibatch alongside the policy.

Under torchrun the value model is built before the actor is sharded and wrapped like it
(`vlrl.train.runtime.make_runtime`, `vlrl.train.distributed.wrap_critic`: DDP, or FSDP2 with the actor's units);
each rank computes the values of its own responses, the value loss is divided by the all-reduced normaliser ÷ W
(the actor's) and the gradients are reduced in the last micro-batch's backward, so the ranks take the optimizer
step of one big batch. Its checkpoint state is the full (gathered) state dict, keyed by parameter name: it
loads on any number of ranks, DDP, FSDP2 or one process.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from vlrl.algos import aggregate
from vlrl.algos.losses import value_loss
from vlrl.config import CriticConfig, OptimConfig
from vlrl.models import Policy, collate
from vlrl.train.common import make_optimizer, step_or_skip
from vlrl.train.distributed import gradient_sync, unwrap
from vlrl.train.microbatch import MicroBatch
from vlrl.train.update_stats import UpdateStats


class ValueModel(torch.nn.Module):
    """The policy's backbone (copied) + a linear head to one scalar per position."""

    def __init__(self, policy: Policy) -> None:
        super().__init__()
        causal_lm = policy.model
        self.backbone = copy.deepcopy(getattr(causal_lm, "model", causal_lm))  # without the LM head
        config = causal_lm.config
        hidden = getattr(getattr(config, "text_config", None), "hidden_size", None) or config.hidden_size
        self.head = torch.nn.Linear(hidden, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)
        self.head.to(device=next(causal_lm.parameters()).device, dtype=next(causal_lm.parameters()).dtype)
        self.adapter = policy.adapter
        self.pad_token_id = policy.pad_token_id

    def forward(self, trajectories: Sequence[Any]) -> torch.Tensor:
        """Values (B, R) of the response tokens (0 on padding), aligned with `response_logprobs`."""
        tokens = collate([t.prompt_ids for t in trajectories], [t.response_ids for t in trajectories],
                         [t.vision for t in trajectories], pad_token_id=self.pad_token_id)
        device = self.head.weight.device
        kwargs = self.adapter.forward_inputs(self.backbone, tokens.input_ids.to(device), tokens.attention_mask.to(device),
                                             tokens.vision.to(device) if tokens.vision is not None else None)
        hidden = self.backbone(**kwargs, use_cache=False).last_hidden_state  # (B, P + R, H)
        P, R = tokens.prompt_len, tokens.response_len
        values = self.head(hidden[:, P - 1 : P + R - 1]).squeeze(-1).float()  # (B, R): state before token t
        return values * tokens.response_mask.to(device).to(values.dtype)


class Critic:
    """A `ValueModel` with its optimizer; the update calls `accumulate` per minibatch, then `step`.
    ``module``: the value model already wrapped for several ranks (`vlrl.train.runtime.Runtime.critic`);
    ``ctx`` (`DistContext`): the ranks agree on a non-finite step."""

    def __init__(self, policy: Policy, cfg: CriticConfig, *, module: torch.nn.Module | None = None,
                 ctx: Any = None) -> None:
        self.model = module if module is not None else ValueModel(policy)
        self.cfg, self.ctx = cfg, ctx
        self.optimizer, self.scheduler = make_optimizer(self.model, OptimConfig(lr=cfg.lr, weight_decay=cfg.weight_decay))

    @torch.no_grad()
    def values(self, trajectories: Sequence[Any]) -> torch.Tensor:
        was_training = self.model.training
        self.model.eval()
        values = self.model(trajectories).cpu()
        self.model.train(was_training)
        return values

    def accumulate(self, batch: Any, micro_batches: Sequence[MicroBatch], *, loss_agg: str,
                   normaliser: float) -> UpdateStats:
        """Clipped value loss over ``micro_batches`` (rows of ``batch``; `vlrl.train.microbatch`), gradients
        accumulated (no step; under DDP/FSDP2 reduced over the ranks in the last micro-batch's backward; a no-op
        micro-batch's loss × 0). ``normaliser``: the actor's (all-reduced ÷ W). Returns ``critic/value_loss`` once
        (the sum over the micro-batches: the rows' share of the minibatch loss) and the per-token
        ``critic/value_clip_frac`` and ``critic/values_mean`` pooled over the rows' tokens."""

        self.model.train()
        stats, total = UpdateStats(), 0.0
        for k, part in enumerate(micro_batches):
            micro = list(part.rows)
            with gradient_sync(self.model, k == len(micro_batches) - 1):
                values = self.model([batch.trajectories[i] for i in micro])  # (b, R)
                R = values.shape[1]
                mask = batch.loss_mask[micro, :R].to(values.device)
                out = value_loss(values, batch.old_values[micro, :R].to(values.device),
                                 batch.returns[micro, :R].to(values.device), clip=self.cfg.value_clip)
                loss = aggregate(out.per_token_loss, mask, loss_agg, normaliser=normaliser)
                (loss * 0.0 if part.noop else loss).backward()
            if part.noop:
                continue
            total += float(loss.detach())
            stats.add_tokens("critic/value_clip_frac", out.metrics["value_clip"], mask)
            stats.add_tokens("critic/values_mean", values, mask)
        stats.add("critic/value_loss", total)
        return stats

    def step(self, *, on_nonfinite: str = "stop", where: str = "critic") -> float | None:
        """The critic's optimizer step (`vlrl.train.common.step_or_skip`: None when a non-finite one is skipped)."""
        return step_or_skip(self.model, self.optimizer, self.scheduler, self.cfg.grad_clip, on_nonfinite=on_nonfinite,
                            where=where, ctx=self.ctx)

    def state_dict(self) -> dict[str, Any]:
        """Weights, optimizer and scheduler: what a resumable checkpoint keeps of the critic — the full tensors
        keyed by parameter name (gathered from the FSDP2 shards; a collective: every rank calls it)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model, optimizer = get_state_dict(self.model, self.optimizer, options=StateDictOptions(full_state_dict=True))
        return {"model": _detached(model), "optimizer": _detached(optimizer), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore `state_dict`'s record (sharded again under FSDP2; every rank calls it)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        if state is None:
            raise ValueError("the checkpoint holds no critic state: resume with the same algo.advantage")
        missing = sorted(set(unwrap(self.model).state_dict()) - set(state["model"]))
        if missing:
            raise ValueError(f"the checkpoint's critic lacks {len(missing)} weight(s) of this one, e.g. {missing[:3]}: "
                             "it was written for a different model")
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=StateDictOptions(full_state_dict=True))
        self.scheduler.load_state_dict(state["scheduler"])


def _detached(value: Any) -> Any:
    """A state dict's tensors as plain CPU copies (nothing shared with the live parameters)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_detached(v) for v in value)
    return value
