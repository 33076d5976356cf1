"""The minibatch update both RL recipes run (synchronous GRPO and asynchronous decoupled PPO):

    for epoch in ppo_epochs:
        for minibatch in shuffle(batch).chunk(minibatches):
            N = normaliser of the whole minibatch (tokens or sequences)         ← same gradient for any split
            I = Clip-Cov / KL-Cov tokens, chosen once over the minibatch        (those losses only; seeded)
            for micro in minibatch.split(micro_batch_size):                    ← `accumulate`
                logp, entropy = πθ(response)                                   teacher-forced, with grad (each
                                                                                 prompt once: train.shared_prefix)
                L_t = policy_loss(logp, π_old, Â, π_behave, entropy, I)         per token (B, T)
                L_t ← w_t · L_t   (async: w = min(π_prox / π_behave, cap))     when enabled
                L_t ← ρ̃_t · L_t   (TIS: ρ̃ = min(π_old / π_sampler, C))         algo.rollout_correction.tis_cap
                loss = aggregate(L, N) (+ β · aggregate(KL(πθ ‖ π_ref), N))
                loss.backward()
            clip grad norm → optimizer step
            critic (gae): Σ micro ½·max((V − R)², (V_clip − R)²) → backward → its own step

`accumulate` (one minibatch's forward/backward over any set of rows, with the normaliser given explicitly) is
the reusable piece: gradient accumulation over k micro-batches, or rows split over data-parallel ranks with
an all-reduced normaliser, give the gradient of one big batch (tests/train/test_update.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vlrl.algos import PolicyLossInputs, aggregate, kl_estimate, normaliser_for
from vlrl.algos.losses import behaviour_weight
from vlrl.algos.staleness import logp_drift, logp_drift_max
from vlrl.models import Policy
from vlrl.train.common import step_or_skip
from vlrl.train.distributed import DistContext
from vlrl.train.runtime import Runtime
from vlrl.train.shared_prefix import rows_by_prompt, teacher_forced
from vlrl.train.update_stats import UpdateStats


@dataclass
class UpdateBatch:
    """One RL step's training data. Shapes: B sequences, R response columns (right-padded). Its tensors live on
    the host (the CPU); `accumulate` (and the critic's update) move each micro-batch's rows to the model's device."""

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
    rollout_weights: torch.Tensor | None = None  # (B, R) TIS weights min(π_old / π_sampler, C), no grad; None: off
    token_sums: dict[str, list[float]] = field(default_factory=dict)  # per-token metrics of the batch (the KL
    # reward penalty's): name -> [Σ value·mask, Σ mask], logged as token means over every rank's tokens


@dataclass(frozen=True)
class UpdateSettings:
    """The update's knobs, bound from config by `vlrl.train.batch.build_algorithm`."""

    loss_fn: Callable  # policy loss with its options bound: fn(PolicyLossInputs) -> LossOutput
    loss_agg: str  # token_mean | seq_mean_token_mean | seq_mean_token_sum | seq_mean_token_sum_norm
    kl_coef: float  # weight of the KL-to-reference loss term (0: none)
    kl_estimator: str  # k1 | k2 | k3
    temperature: float  # sampling temperature (log-probs are of logits / T)
    micro_batch_size: int
    minibatches: int
    ppo_epochs: int
    grad_clip: float
    behaviour_weight_cap: float = 5.0
    behaviour_weight_mode: str = "clamp"  # clamp | drop: a weight above the cap becomes the cap, or 0
    apply_behaviour_weight: bool = False  # multiply L_t by w_t = min(π_prox / π_behave, cap) (async recipe)
    loss_agg_max_length: int | None = None  # the constant L of seq_mean_token_sum_norm
    cov_selection: Callable | None = None  # Clip-Cov / KL-Cov: select(old_logp, Â, mask, *, generator) over a minibatch
    padding_free: bool = False  # pack each micro-batch into rows, no padding between sequences (vlrl.models.packed)
    shared_prefix: bool = False  # each distinct prompt run once for its rows (vlrl.train.shared_prefix)
    logprob_chunk: int | str = "auto"  # tokens per chunk of the LM head + log-softmax (vlrl.models.logprobs.chunk_tokens)
    skip_zero_advantage: bool = False  # leave rows with Â = 0 everywhere out of the forward/backward (loss 0 there)
    on_nonfinite: str = "stop"  # train.on_nonfinite: a NaN/Inf loss or grad norm stops the run, or its update is skipped


def ppo_update(policy: Policy, batch: UpdateBatch, settings: UpdateSettings, optimizer, scheduler, *, seed: int,
               step: int, critic: Any = None, runtime: Runtime | None = None) -> UpdateStats:
    """``ppo_epochs`` × ``minibatches`` optimizer steps on ``batch``; returns what they measured.
    With a ``critic`` (`vlrl.train.critic.Critic`) its clipped value loss is minimised on the same minibatches.

    Under torchrun (``runtime``, `vlrl.train.runtime`) ``batch`` is this rank's shard: every rank splits its
    rows into the same number of minibatches, the normaliser is all-reduced, and gradients are reduced once per
    minibatch, so N ranks take the optimizer steps of one big batch — the critic's too (wrapped like the actor,
    `vlrl.train.critic`, with the same normaliser)."""
    rt = runtime or Runtime.single(policy.model)
    model = rt.module
    model.train()
    stats = UpdateStats(behaviour_weight_cap=settings.behaviour_weight_cap,
                        skipped=0 if settings.on_nonfinite == "skip" else None)
    B = len(batch.trajectories)
    generator = torch.Generator().manual_seed(seed * 7919 + step)
    selection_generator = torch.Generator().manual_seed(seed * 104729 + step)  # the same on every rank
    skippable = zero_advantage_rows(batch, settings, world_size=rt.ctx.world_size)  # (B,) bool
    for _ in range(settings.ppo_epochs):
        order = torch.randperm(B, generator=generator) if settings.minibatches > 1 else torch.arange(B)
        for minibatch in order.chunk(settings.minibatches):
            rows = minibatch.tolist()
            normaliser = rt.global_normaliser(normaliser_for(settings.loss_agg, batch.loss_mask[rows],
                                                             max_length=settings.loss_agg_max_length))  # all rows
            selection = minibatch_cov_selection(batch, rows, settings, generator=selection_generator, runtime=rt)
            trained = [r for r in rows if not skippable[r]] or rows[:1]  # ≥ 1 row: AdamW steps on a real gradient
            if settings.shared_prefix and settings.micro_batch_size < len(trained):  # a group's rows side by side:
                trained = rows_by_prompt(batch.trajectories, trained)  # its micro-batches then share their prompt
            stats.add("policy/skipped_rows_frac", 1 - len(trained) / max(len(rows), 1))
            part = accumulate(policy, batch, trained, settings, normaliser=normaliser, runtime=rt,
                              cov_selection=selection)
            stats.extend(part)
            grad_norm = step_or_skip(model, optimizer, scheduler, settings.grad_clip, loss=part.values["policy/loss"][0],
                                     ctx=rt.ctx, on_nonfinite=settings.on_nonfinite, where=f"rl step {step + 1}")
            if grad_norm is not None:
                stats.add("policy/grad_norm", grad_norm)
            if settings.on_nonfinite == "skip":
                stats.skipped += grad_norm is None
            if critic is not None:
                stats.extend(critic.accumulate(batch, rows, micro_batch_size=settings.micro_batch_size,
                                               loss_agg=settings.loss_agg, normaliser=normaliser))
                critic_norm = critic.step(on_nonfinite=settings.on_nonfinite, where=f"rl step {step + 1} (critic)")
                if critic_norm is not None:
                    stats.add("critic/grad_norm", critic_norm)
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


def minibatch_cov_selection(batch: UpdateBatch, rows: Sequence[int], settings: UpdateSettings, *,
                            generator: torch.Generator, runtime: Runtime | None = None) -> torch.Tensor | None:
    """Clip-Cov / KL-Cov's tokens chosen once over the minibatch ``rows`` (every rank's rows under data
    parallelism: gathered in rank order, selected identically on every rank with the shared seeded
    ``generator``), from π_old — (B, R) bool with this rank's ``rows`` filled, or None for the other losses.
    One selection per minibatch makes the gradient independent of the micro-batch size and of the number of
    ranks (the papers' code selects within each micro-batch of each rank)."""
    if settings.cov_selection is None:
        return None
    if batch.old_logp is None:
        raise ValueError("the covariance losses choose their tokens from π_old: prepare_batch must compute old_logp")
    ctx = runtime.ctx if runtime is not None else DistContext()
    local = (batch.old_logp[rows], batch.advantages[rows], batch.loss_mask[rows])  # (b, R) each
    parts = ctx.gather_objects(local)  # [local] in one process
    width = max(part[0].shape[1] for part in parts)
    padded = [torch.cat([torch.nn.functional.pad(p[k], (0, width - p[k].shape[1])) for p in parts]) for k in range(3)]
    chosen = settings.cov_selection(*padded, generator=generator)  # (Σ b, width) over every rank's rows
    offset = sum(len(p[0]) for p in parts[: ctx.rank])
    selection = torch.zeros_like(batch.loss_mask, dtype=torch.bool)
    selection[rows] = chosen[offset : offset + len(rows), : batch.loss_mask.shape[1]]
    return selection


def accumulate(policy: Policy, batch: UpdateBatch, rows: Sequence[int], settings: UpdateSettings, *,
               normaliser: float, runtime: Runtime | None = None,
               cov_selection: torch.Tensor | None = None) -> UpdateStats:
    """Forward + backward over ``rows`` of ``batch`` in micro-batches of ``settings.micro_batch_size``,
    adding to the parameters' ``.grad`` (no optimizer step). ``normaliser`` is the `aggregate` denominator of
    the whole minibatch (all micro-batches, all ranks; ÷ world size under a ``runtime``, whose DDP/FSDP2 module
    trains and reduces gradients in the last micro-batch's backward); ``cov_selection`` (B, R), the minibatch's
    Clip-Cov / KL-Cov tokens (`minibatch_cov_selection`); unset for those losses, each micro-batch selects
    within itself. Returns the statistics of ``rows``: ``policy/loss`` once, the sum of the micro-batches'
    losses (this rank's share of the minibatch loss), per-token statistics pooled over the rows' tokens."""
    rt = runtime or Runtime.single(policy.model)
    model = rt.module
    stats = UpdateStats(behaviour_weight_cap=settings.behaviour_weight_cap)
    starts = range(0, len(rows), settings.micro_batch_size)
    total_loss = 0.0
    for start in starts:
        micro = list(rows[start : start + settings.micro_batch_size])
        trajectories = [batch.trajectories[i] for i in micro]
        with rt.gradient_sync(last=start == starts[-1]):  # DDP/FSDP2 reduce gradients in the last backward only
            with rt.autocast():
                logp, entropy = teacher_forced(
                    model, policy.adapter, [t.prompt_ids for t in trajectories], [t.response_ids for t in trajectories],
                    [t.vision for t in trajectories], pad_token_id=policy.pad_token_id, temperature=settings.temperature,
                    with_entropy=True, padding_free=settings.padding_free,
                    shared_prefix=settings.shared_prefix, sums=stats.token_sums,
                    logprob_chunk=settings.logprob_chunk)  # (b, R) each, 0 at padding
            R = logp.shape[1]

            def rows_of(tensor: torch.Tensor) -> torch.Tensor:  # the batch lives on the host: these rows, moved
                return tensor[micro, :R].to(logp.device)  # to the model's device (a no-op on the CPU)

            mask = rows_of(batch.loss_mask)
            behaviour = rows_of(batch.behaviour_logp)
            old = rows_of(batch.old_logp) if batch.old_logp is not None else logp.detach()
            out = settings.loss_fn(PolicyLossInputs(
                logp=logp, old_logp=old, advantages=rows_of(batch.advantages), loss_mask=mask,
                behaviour_logp=behaviour, entropy=entropy,
                cov_selection=rows_of(cov_selection) if cov_selection is not None else None))
            per_token = out.per_token_loss
            w, capped = behaviour_weight(old, behaviour, cap=settings.behaviour_weight_cap,
                                         mode=settings.behaviour_weight_mode)  # (b, R) each
            w = w * mask
            if settings.apply_behaviour_weight:
                per_token = per_token * w
            if batch.rollout_weights is not None:  # TIS: min(π_old / π_sampler, C), 1 without it (MIS only)
                per_token = per_token * rows_of(batch.rollout_weights)
            loss = aggregate(per_token, mask, settings.loss_agg, normaliser=normaliser)
            if batch.ref_logp is not None and settings.kl_coef > 0:
                kl = kl_estimate(logp, rows_of(batch.ref_logp), settings.kl_estimator)
                loss = loss + settings.kl_coef * aggregate(kl, mask, settings.loss_agg, normaliser=normaliser)
                stats.add_tokens("policy/kl_ref", kl, mask)
            loss.backward()
        total_loss += float(loss.detach())
        stats.add_tokens("policy/entropy", entropy, mask)
        stats.add_tokens("policy/approx_kl_old", 0.5 * (logp.detach() - old) ** 2, mask)
        for name, values in out.metrics.items():
            stats.add_tokens(f"policy/{name}", values, mask)
        stats.behaviour_weights.append(w[mask.bool()].detach())
        stats.behaviour_capped += int((capped & mask.bool()).sum())
        same = batch.same_version[micro].to(logp.device)
        drift, n = logp_drift(behaviour, old, mask, same)
        stats.drift_sum += float(drift) * int(n)
        stats.drift_tokens += int(n)
        stats.drift_max = max(stats.drift_max, float(logp_drift_max(behaviour, old, mask, same)))  # rollout/logprob_diff_max
    stats.add("policy/loss", total_loss)
    return stats


def minibatch_gradient(policy: Policy, batch: UpdateBatch, rows: Sequence[int], settings: UpdateSettings, *,
                       normaliser: float, cov_selection: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The gradient `accumulate` leaves for ``rows`` (``.grad`` zeroed before, cloned after, zeroed again):
    the quantity to compare between one big batch, k micro-batches, and rows split over data-parallel ranks
    (each rank passing its rows, the all-reduced normaliser and the minibatch's ``cov_selection``, then
    all-reducing the gradients)."""
    model = policy.model
    model.zero_grad(set_to_none=True)
    was_training = model.training
    model.train()
    accumulate(policy, batch, rows, settings, normaliser=normaliser, cov_selection=cov_selection)
    model.train(was_training)
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads
