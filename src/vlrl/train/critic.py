"""The critic of PPO with GAE: a value model built from the policy's backbone plus a scalar head.

    V(s_t) = w · h_t + b          h_t = last hidden state of the backbone at the position that predicts token t

The backbone is a copy of the policy's transformer (its own weights from the policy's current ones; the
language-model head is dropped), the head is zero-initialised (V ≡ 0 at the start, so the first advantages
are the returns). It has its own AdamW optimizer and is trained with the clipped value loss
(`vlrl.algos.losses.value_loss`) on the GAE returns, minibatch by minibatch alongside the policy.
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
    """A `ValueModel` with its optimizer; the update calls `accumulate` per minibatch, then `step`."""

    def __init__(self, policy: Policy, cfg: CriticConfig) -> None:
        self.model = ValueModel(policy)
        self.cfg = cfg
        self.optimizer, self.scheduler = make_optimizer(self.model, OptimConfig(lr=cfg.lr, weight_decay=cfg.weight_decay))

    @torch.no_grad()
    def values(self, trajectories: Sequence[Any]) -> torch.Tensor:
        was_training = self.model.training
        self.model.eval()
        values = self.model(trajectories).cpu()
        self.model.train(was_training)
        return values

    def accumulate(self, batch: Any, rows: Sequence[int], *, micro_batch_size: int, loss_agg: str,
                   normaliser: float) -> UpdateStats:
        """Clipped value loss over ``rows`` in micro-batches, gradients accumulated (no step). Returns
        ``critic/value_loss`` once (the sum over the micro-batches: the rows' share of the minibatch loss) and
        the per-token ``critic/value_clip_frac`` and ``critic/values_mean`` pooled over the rows' tokens."""
        from vlrl.train.update import UpdateStats

        self.model.train()
        stats, total = UpdateStats(), 0.0
        for start in range(0, len(rows), micro_batch_size):
            micro = list(rows[start : start + micro_batch_size])
            values = self.model([batch.trajectories[i] for i in micro])  # (b, R)
            R = values.shape[1]
            mask = batch.loss_mask[micro, :R].to(values.device)
            out = value_loss(values, batch.old_values[micro, :R].to(values.device),
                             batch.returns[micro, :R].to(values.device), clip=self.cfg.value_clip)
            loss = aggregate(out.per_token_loss, mask, loss_agg, normaliser=normaliser)
            loss.backward()
            total += float(loss.detach())
            stats.add_tokens("critic/value_clip_frac", out.metrics["value_clip"], mask)
            stats.add_tokens("critic/values_mean", values, mask)
        stats.add("critic/value_loss", total)
        return stats

    def step(self, *, on_nonfinite: str = "stop", where: str = "critic") -> float | None:
        """The critic's optimizer step (`vlrl.train.common.step_or_skip`: None when a non-finite one is skipped)."""
        return step_or_skip(self.model, self.optimizer, self.scheduler, self.cfg.grad_clip, on_nonfinite=on_nonfinite,
                            where=where)

    def state_dict(self) -> dict[str, Any]:
        """Weights, optimizer and scheduler: what a resumable checkpoint keeps of the critic."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is None:
            raise ValueError("the checkpoint holds no critic state: resume with the same algo.advantage")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
