"""The minibatch update both RL recipes run (synchronous GRPO and asynchronous decoupled PPO):

    for epoch in ppo_epochs:
        for minibatch in shuffle(batch).chunk(minibatches):
            N = normaliser of the whole minibatch (tokens or sequences)         ← same gradient for any split
            for micro in minibatch.split(micro_batch_size):                    ← `accumulate`
                logp, entropy = πθ(response)                                   teacher-forced, with grad
                L_t = policy_loss(logp, π_old, Â, π_behave)                    per token (B, T)
                L_t ← w_t · L_t   (async: w = min(π_prox / π_behave, cap))     when enabled
                loss = aggregate(L, N) (+ β · aggregate(KL(πθ ‖ π_ref), N))
                loss.backward()
            clip grad norm → optimizer step
            critic (gae): Σ micro ½·max((V − R)², (V_clip − R)²) → backward → its own step

`accumulate` (one minibatch's forward/backward over any set of rows, with the normaliser given explicitly) is
the reusable piece: gradient accumulation over k micro-batches, or rows split over data-parallel ranks with
an all-reduced normaliser, give the gradient of one big batch (tests/train/test_update.py).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vlrl.algos import PolicyLossInputs, aggregate, kl_estimate, masked_mean, normaliser_for
from vlrl.algos.staleness import behaviour_weight_stats, behaviour_weights, logp_drift
from vlrl.models import Policy
from vlrl.models.packed import sequence_logprobs
from vlrl.train.common import clip_and_step
from vlrl.train.runtime import Runtime


@dataclass
class UpdateBatch:
    """One RL step's training data. Shapes: B sequences, R response columns (right-padded)."""

    trajectories: list[Any]  # the B `Trajectory` records (token ids, vision inputs)
    loss_mask: torch.Tensor  # (B, R) 1 = trained-on model token
    behaviour_logp: torch.Tensor  # (B, R) log π_behave recorded at sampling
    advantages: torch.Tensor  # (B, R)
    old_logp: torch.Tensor | None  # (B, R) π_old = π_prox, the weights at the start of the step; None → logp.detach()
    ref_logp: torch.Tensor | None  # (B, R) frozen reference; None when there is no KL term
    group_index: torch.Tensor  # (B,)
    rewards: torch.Tensor  # (B,) shaped scalar rewards the estimator saw
    token_rewards: torch.Tensor  # (B, R)
    same_version: torch.Tensor  # (B,) bool: sampled by the trainer's current weights (train–inference drift)
    metrics: dict[str, float] = field(default_factory=dict)  # from the shapers (logged with the step)
    old_values: torch.Tensor | None = None  # (B, R) critic values when the batch was prepared (gae)
    returns: torch.Tensor | None = None  # (B, R) the critic's regression targets


@dataclass
class UpdateStats:
    """What an update measured. ``values``: the logged metrics (``policy/…``, ``critic/…``), one value per
    micro-batch (or per optimizer step: grad norms), averaged when logged; the behaviour weights and the drift
    counters are kept apart, as the tensors and sums they are, so that ranks can pool them (`merge`)."""

    values: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    behaviour_weights: list[torch.Tensor] = field(default_factory=list)  # w of every trained token, per micro-batch
    drift_sum: float = 0.0  # Σ |log π_behave − log π_old| over tokens sampled by the trainer's current weights
    drift_tokens: int = 0
    behaviour_weight_cap: float = 5.0

    def add(self, name: str, value: float) -> None:
        self.values[name].append(float(value))

    def extend(self, other: UpdateStats) -> None:
        for name, values in other.values.items():
            self.values[name].extend(values)
        self.behaviour_weights += other.behaviour_weights
        self.drift_sum += other.drift_sum
        self.drift_tokens += other.drift_tokens

    @classmethod
    def merge(cls, parts: Sequence[UpdateStats]) -> UpdateStats:
        """One record of several (every rank's, in rank order)."""
        merged = cls(behaviour_weight_cap=parts[0].behaviour_weight_cap if parts else 5.0)
        for part in parts:
            merged.extend(part)
        return merged

    def metrics(self) -> dict[str, float]:
        """Means of ``values``, ``policy/behaviour_weight_{mean,max,capped_frac}`` and ``policy/logp_drift``."""
        out = {name: sum(values) / len(values) for name, values in self.values.items() if values}
        weights = torch.cat(self.behaviour_weights) if self.behaviour_weights else torch.zeros(0)
        for name, value in behaviour_weight_stats(weights, torch.ones_like(weights), cap=self.behaviour_weight_cap).items():
            out[f"policy/behaviour_weight_{name}"] = float(value)
        if self.drift_tokens:
            out["policy/logp_drift"] = self.drift_sum / self.drift_tokens
        return out


@dataclass(frozen=True)
class UpdateSettings:
    """The update's knobs, bound from config by `vlrl.train.batch.build_algorithm`."""

    loss_fn: Callable  # policy loss with its options bound: fn(PolicyLossInputs) -> LossOutput
    loss_agg: str  # token_mean | seq_mean_token_mean | seq_mean_token_sum
    kl_coef: float  # weight of the KL-to-reference loss term (0: none)
    kl_estimator: str  # k1 | k2 | k3
    temperature: float  # sampling temperature (log-probs are of logits / T)
    micro_batch_size: int
    minibatches: int
    ppo_epochs: int
    grad_clip: float
    behaviour_weight_cap: float = 5.0
    apply_behaviour_weight: bool = False  # multiply L_t by w_t = min(π_prox / π_behave, cap) (async recipe)
    padding_free: bool = False  # pack each micro-batch into rows, no padding between sequences (vlrl.models.packed)
    skip_zero_advantage: bool = False  # leave rows with Â = 0 everywhere out of the forward/backward (loss 0 there)


def ppo_update(policy: Policy, batch: UpdateBatch, settings: UpdateSettings, optimizer, scheduler, *, seed: int,
               step: int, critic: Any = None, runtime: Runtime | None = None) -> UpdateStats:
    """``ppo_epochs`` × ``minibatches`` optimizer steps on ``batch``; returns what they measured.
    With a ``critic`` (`vlrl.train.critic.Critic`) its clipped value loss is minimised on the same minibatches.

    Under torchrun (``runtime``, `vlrl.train.runtime`) ``batch`` is this rank's shard: every rank splits its
    rows into the same number of minibatches, the normaliser is all-reduced, and gradients are reduced once per
    minibatch, so N ranks take the optimizer steps of one big batch. (The critic is single-process:
    `check_scalable` refuses value-based estimators under several ranks.)"""
    rt = runtime or Runtime.single(policy.model)
    model = rt.module
    model.train()
    stats = UpdateStats(behaviour_weight_cap=settings.behaviour_weight_cap)
    B = len(batch.trajectories)
    generator = torch.Generator().manual_seed(seed * 7919 + step)
    skippable = zero_advantage_rows(batch, settings, world_size=rt.ctx.world_size)  # (B,) bool
    for _ in range(settings.ppo_epochs):
        order = torch.randperm(B, generator=generator) if settings.minibatches > 1 else torch.arange(B)
        for minibatch in order.chunk(settings.minibatches):
            rows = minibatch.tolist()
            normaliser = rt.global_normaliser(normaliser_for(settings.loss_agg, batch.loss_mask[rows]))  # all rows
            trained = [r for r in rows if not skippable[r]] or rows[:1]  # ≥ 1 row: AdamW steps on a real gradient
            stats.add("policy/skipped_rows_frac", 1 - len(trained) / max(len(rows), 1))
            stats.extend(accumulate(policy, batch, trained, settings, normaliser=normaliser, runtime=rt))
            stats.add("policy/grad_norm", clip_and_step(model, optimizer, scheduler, settings.grad_clip))
            if critic is not None:
                for name, values in critic.accumulate(batch, rows, micro_batch_size=settings.micro_batch_size,
                                                      loss_agg=settings.loss_agg, normaliser=normaliser).items():
                    stats.values[name].extend(values)
                stats.add("critic/grad_norm", critic.step())
    model.eval()
    return stats


def zero_advantage_rows(batch: UpdateBatch, settings: UpdateSettings, *, world_size: int = 1) -> torch.Tensor:
    """(B,) bool: rows `ppo_update` may leave out of the forward/backward with ``settings.skip_zero_advantage``.

    A row whose advantages are 0 on every trained token adds exactly 0 to the loss when there is no KL loss term
    (every registered policy loss is Â · f(ratio); `build_algorithm` checks the configured one), while the
    normaliser, computed over all rows, still counts its tokens — so the gradient is unchanged. Only in one
    process: data-parallel ranks must run the same number of backward passes."""
    mask = batch.loss_mask.bool()
    zero = ~((batch.advantages != 0) & mask).any(dim=1)
    if not settings.skip_zero_advantage or world_size > 1 or (batch.ref_logp is not None and settings.kl_coef > 0):
        return torch.zeros_like(zero)
    return zero


def accumulate(policy: Policy, batch: UpdateBatch, rows: Sequence[int], settings: UpdateSettings, *,
               normaliser: float, runtime: Runtime | None = None) -> UpdateStats:
    """Forward + backward over ``rows`` of ``batch`` in micro-batches of ``settings.micro_batch_size``,
    adding to the parameters' ``.grad`` (no optimizer step). ``normaliser`` is the `aggregate` denominator of
    the whole minibatch (all micro-batches, all ranks; ÷ world size under a ``runtime``, whose DDP/FSDP2 module
    trains and reduces gradients in the last micro-batch's backward). Returns per-micro-batch statistics."""
    rt = runtime or Runtime.single(policy.model)
    model = rt.module
    stats = UpdateStats(behaviour_weight_cap=settings.behaviour_weight_cap)
    starts = range(0, len(rows), settings.micro_batch_size)
    for start in starts:
        micro = list(rows[start : start + settings.micro_batch_size])
        trajectories = [batch.trajectories[i] for i in micro]
        with rt.gradient_sync(last=start == starts[-1]):  # DDP/FSDP2 reduce gradients in the last backward only
            with rt.autocast():
                logp, entropy, _ = sequence_logprobs(
                    model, policy.adapter, [t.prompt_ids for t in trajectories], [t.response_ids for t in trajectories],
                    [t.vision for t in trajectories], pad_token_id=policy.pad_token_id, temperature=settings.temperature,
                    with_entropy=True, padding_free=settings.padding_free)  # (b, R) each, 0 at padding
            R = logp.shape[1]
            mask = batch.loss_mask[micro, :R]
            behaviour = batch.behaviour_logp[micro, :R]
            old = batch.old_logp[micro, :R] if batch.old_logp is not None else logp.detach()
            out = settings.loss_fn(PolicyLossInputs(logp=logp, old_logp=old, advantages=batch.advantages[micro, :R],
                                                    loss_mask=mask, behaviour_logp=behaviour))
            per_token = out.per_token_loss
            w = behaviour_weights(old, behaviour, mask, cap=settings.behaviour_weight_cap)  # (b, R)
            if settings.apply_behaviour_weight:
                per_token = per_token * w
            loss = aggregate(per_token, mask, settings.loss_agg, normaliser=normaliser)
            if batch.ref_logp is not None and settings.kl_coef > 0:
                kl = kl_estimate(logp, batch.ref_logp[micro, :R], settings.kl_estimator)
                loss = loss + settings.kl_coef * aggregate(kl, mask, settings.loss_agg, normaliser=normaliser)
                stats.add("policy/kl_ref", masked_mean(kl.detach(), mask))
            loss.backward()
        stats.add("policy/loss", loss.detach())
        stats.add("policy/entropy", masked_mean(entropy.detach(), mask))
        stats.add("policy/approx_kl_old", masked_mean(0.5 * (logp.detach() - old) ** 2, mask))
        for name, values in out.metrics.items():
            stats.add(f"policy/{name}", masked_mean(values, mask))
        stats.behaviour_weights.append(w[mask.bool()].detach())
        drift, n = logp_drift(behaviour, old, mask, batch.same_version[micro])
        stats.drift_sum += float(drift) * int(n)
        stats.drift_tokens += int(n)
    return stats


def minibatch_gradient(policy: Policy, batch: UpdateBatch, rows: Sequence[int], settings: UpdateSettings, *,
                       normaliser: float) -> dict[str, torch.Tensor]:
    """The gradient `accumulate` leaves for ``rows`` (``.grad`` zeroed before, cloned after, zeroed again):
    the quantity to compare between one big batch, k micro-batches, and rows split over data-parallel ranks
    (each rank passing its rows and the all-reduced normaliser, then all-reducing the gradients)."""
    model = policy.model
    model.zero_grad(set_to_none=True)
    was_training = model.training
    model.train()
    accumulate(policy, batch, rows, settings, normaliser=normaliser)
    model.train(was_training)
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads
