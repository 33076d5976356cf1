"""The minibatch update both RL recipes run (synchronous GRPO and asynchronous decoupled PPO):

    for epoch in ppo_epochs:
        for minibatch in shuffle(batch).chunk(minibatches):
            N = normaliser of the whole minibatch (tokens or sequences)         ← same gradient for any split
            I = Clip-Cov / KL-Cov tokens, chosen once over the minibatch        (those losses only; seeded)
            for micro in minibatch.split(micro_batch_size):                    ← `accumulate` (or by cost:
                                                                                 train.max_tokens_per_micro_batch,
                                                                                 rows rebalanced over the ranks —
                                                                                 `minibatches`, vlrl.train.microbatch)
                logp, entropy = πθ(response)                                   teacher-forced, with grad (each
                                                                                 prompt once: train.shared_prefix)
                L_t = policy_loss(logp, π_old, Â, π_behave, entropy, I)         per token (B, T)
                L_t ← w_t · L_t   (async: w = min(π_prox / π_behave, cap))     when enabled
                L_t ← ρ̃_t · L_t   (TIS: ρ̃ = min(π_old / π_sampler, C))         algo.rollout_correction.tis_cap
                loss = aggregate(L, N) (+ β · aggregate(KL(πθ ‖ π_ref), N))
                       (+ β_d · aggregate(D(πθ ‖ π_teacher), N): algo.distill's topk term, `vlrl.algos.distill`)
                loss.backward()
            clip grad norm → optimizer step
            critic (gae): Σ micro ½·max((V − R)², (V_clip − R)²) → backward → its own step

`accumulate` (one minibatch's forward/backward over any set of rows, with the normaliser given explicitly) is
the reusable piece: gradient accumulation over k micro-batches, or rows split over data-parallel ranks with
an all-reduced normaliser, give the gradient of one big batch (tests/train/test_update.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vlrl.algos import PolicyLossInputs, aggregate, kl_estimate, normaliser_for
from vlrl.algos.distill import topk_reverse_kl
from vlrl.algos.losses import behaviour_weight
from vlrl.algos.staleness import logp_drift, logp_drift_max
from vlrl.models import Policy
from vlrl.models.forward import PassLayout, teacher_forced
from vlrl.models.logprobs import HeadQuery
from vlrl.models.shared_prefix import rows_by_prompt
from vlrl.train.common import step_or_skip
from vlrl.train.distributed import DistContext
from vlrl.train.microbatch import CostModel, MicroBatch, StepLayout, by_count, gather_rows
from vlrl.train.runtime import Runtime
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
    same_version: torch.Tensor  # (B,) or (B, R) bool: sampled by the trainer's current weights (train–inference drift)
    metrics: dict[str, float] = field(default_factory=dict)  # from the shapers (logged with the step)
    old_values: torch.Tensor | None = None  # (B, R) critic values when the batch was prepared (gae)
    returns: torch.Tensor | None = None  # (B, R) the critic's regression targets
    rollout_weights: torch.Tensor | None = None  # (B, R) TIS weights min(π_old / π_sampler, C), no grad; None: off
    token_sums: dict[str, list[float]] = field(default_factory=dict)  # per-token metrics of the batch (the KL
    # reward penalty's): name -> [Σ value·mask, Σ mask], logged as token means over every rank's tokens
    teacher_topk_logp: torch.Tensor | None = None  # (B, R, k + 1) algo.distill topk: the teacher's log-probs of its
    # top-k tokens at each position, the log of the rest mass last; None: no top-k term
    teacher_topk_ids: torch.Tensor | None = None  # (B, R, k) int32: those tokens' ids


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
    shared_prefix: bool = False  # each distinct prompt run once for its rows (vlrl.models.shared_prefix)
    logprob_chunk: int | str = "auto"  # tokens per chunk of the LM head + log-softmax (vlrl.models.logprobs.chunk_tokens)
    skip_zero_advantage: bool = False  # leave rows with Â = 0 everywhere out of the forward/backward (loss 0 there)
    on_nonfinite: str = "stop"  # train.on_nonfinite: a NaN/Inf loss or grad norm stops the run, or its update is skipped
    max_tokens_per_micro_batch: int | None = None  # micro-batches by cost, rows rebalanced over ranks (vlrl.train.microbatch)
    distill_coef: float = 0.0  # β of algo.distill's topk loss term (the batch carries the teacher's top-k)

    @property
    def layout(self) -> PassLayout:
        """How every teacher-forced pass of the step lays out its micro-batches (`vlrl.models.forward`)."""
        return PassLayout(padding_free=self.padding_free, shared_prefix=self.shared_prefix,
                          logprob_chunk=self.logprob_chunk)


def ppo_update(policy: Policy, batch: UpdateBatch, settings: UpdateSettings, optimizer, scheduler, *, seed: int,
               step: int, critic: Any = None, runtime: Runtime | None = None) -> UpdateStats:
    """``ppo_epochs`` × ``minibatches`` optimizer steps on ``batch``; returns what they measured.
    With a ``critic`` (`vlrl.train.critic.Critic`) its clipped value loss is minimised on the same minibatches.

    Under torchrun (``runtime``, `vlrl.train.runtime`) ``batch`` is this rank's shard: every rank splits its
    rows into the same number of minibatches, the normaliser is all-reduced, and gradients are reduced once per
    minibatch, so N ranks take the optimizer steps of one big batch — the critic's too (wrapped like the actor,
    `vlrl.train.critic`, with the same normaliser). With ``settings.max_tokens_per_micro_batch`` each minibatch's
    rows are cut by cost and rebalanced over the ranks (`minibatches`, `vlrl.train.microbatch`)."""
    rt = runtime or Runtime.single(policy.model)
    model = rt.module
    model.train()
    stats = UpdateStats(behaviour_weight_cap=settings.behaviour_weight_cap,
                        skipped=0 if settings.on_nonfinite == "skip" else None)
    for mb in minibatches(policy, batch, settings, rt, seed=seed, step=step):
        for name, value in mb.metrics.items():
            stats.add(name, value)
        stats.peak("perf/micro_batch_cost_max", mb.largest)
        part = accumulate(policy, mb.batch, [], settings, normaliser=mb.normaliser, runtime=rt,
                          cov_selection=mb.selection, micro_batches=mb.micro_batches)
        stats.extend(part)
        grad_norm = step_or_skip(model, optimizer, scheduler, settings.grad_clip, loss=part.values["policy/loss"][0],
                                 ctx=rt.ctx, on_nonfinite=settings.on_nonfinite, where=f"rl step {step + 1}")
        if grad_norm is not None:
            stats.add("policy/grad_norm", grad_norm)
        if settings.on_nonfinite == "skip":
            stats.skipped += grad_norm is None
        if critic is not None:
            stats.extend(critic.accumulate(mb.batch, mb.critic_micro_batches, loss_agg=settings.loss_agg,
                                           normaliser=mb.normaliser))
            critic_norm = critic.step(on_nonfinite=settings.on_nonfinite, where=f"rl step {step + 1} (critic)")
            if critic_norm is not None:
                stats.add("critic/grad_norm", critic_norm)
    model.eval()
    return stats


@dataclass
class Minibatch:
    """One optimizer step's rows as this rank runs them (`minibatches`)."""

    batch: UpdateBatch  # this rank's batch, or (a budget over ranks) the step's rows of every rank side by side
    micro_batches: list[MicroBatch]  # the actor's, rows of ``batch``
    critic_micro_batches: list[MicroBatch]  # every row of the minibatch this rank runs (no zero-advantage skipping)
    normaliser: float  # the minibatch's, over every rank, ÷ world size
    selection: torch.Tensor | None  # Clip-Cov / KL-Cov tokens, (B, R) of ``batch``
    metrics: dict[str, float]  # policy/skipped_rows_frac, perf/micro_batches, perf/rank_imbalance, …
    largest: float  # the cost of this rank's costliest micro-batch (`vlrl.train.microbatch.CostModel`)


def minibatches(policy: Policy, batch: UpdateBatch, settings: UpdateSettings, rt: Runtime, *, seed: int,
                step: int) -> Iterator[Minibatch]:
    """The step's ``ppo_epochs`` × ``minibatches`` minibatches (rows shuffled per epoch with a seeded generator, the
    same on every rank): each rank's own rows in micro-batches of ``micro_batch_size`` — or, with
    ``max_tokens_per_micro_batch``, the same minibatches of every rank's rows rebalanced over the ranks and cut by
    cost (`vlrl.train.microbatch.plan_ranks`; the rows a rank runs are sent to it once for the whole step)."""
    B, ctx = len(batch.trajectories), rt.ctx
    generator = torch.Generator().manual_seed(seed * 7919 + step)
    selection_generator = torch.Generator().manual_seed(seed * 104729 + step)  # the same on every rank
    chunks = [[c.tolist() for c in (torch.randperm(B, generator=generator) if settings.minibatches > 1
                                    else torch.arange(B)).chunk(settings.minibatches)] for _ in range(settings.ppo_epochs)]
    cost = CostModel.of(policy.model, padding_free=settings.padding_free, shared_prefix=settings.shared_prefix)
    layout = StepLayout.of(batch, chunks, cost, ctx)
    skippable = zero_advantage_rows(batch, settings, world_size=ctx.world_size)  # (B,) bool, one process only
    if settings.max_tokens_per_micro_batch is None:
        for e, epoch in enumerate(chunks):
            for m, rows in enumerate(epoch):
                normaliser = rt.global_normaliser(normaliser_for(settings.loss_agg, batch.loss_mask[rows],
                                                                 max_length=settings.loss_agg_max_length))  # all rows
                selection = minibatch_cov_selection(batch, rows, settings, generator=selection_generator, runtime=rt)
                trained = [r for r in rows if not skippable[r]] or rows[:1]  # ≥ 1 row: AdamW steps on a real gradient
                if settings.shared_prefix and settings.micro_batch_size < len(trained):  # a group's rows side by side:
                    trained = rows_by_prompt(batch.trajectories, trained)  # its micro-batches then share their prompt
                micro = by_count(trained, settings.micro_batch_size)
                yield Minibatch(batch, micro, by_count(rows, settings.micro_batch_size), normaliser, selection,
                                layout.metrics(e, m, micro, trained, rows), layout.largest(micro, layout.offsets[ctx.rank]))
        return
    plans = [[layout.plan(e, m, settings.max_tokens_per_micro_batch, skippable) for m in range(len(epoch))]
             for e, epoch in enumerate(chunks)]
    every = layout.rows_of(plans)
    step_batch = batch if not ctx.enabled else gather_rows(batch, ctx, layout.offsets, every)
    for e, epoch in enumerate(plans):
        for m, (actor, critic_plan, trained) in enumerate(epoch):
            rows = layout.global_rows(e, m)  # every rank's rows of the minibatch, in rank order
            normaliser = ctx.local_normaliser(normaliser_for(settings.loss_agg, step_batch.loss_mask[rows],
                                                             max_length=settings.loss_agg_max_length))
            selection = minibatch_cov_selection(step_batch, rows, settings, generator=selection_generator)
            micro = actor.micro_batches[ctx.rank]
            yield Minibatch(step_batch, micro, critic_plan.micro_batches[ctx.rank], normaliser, selection,
                            layout.metrics(e, m, micro, trained, rows, parts=actor.rows), layout.largest(micro, 0))


def zero_advantage_rows(batch: UpdateBatch, settings: UpdateSettings, *, world_size: int = 1) -> torch.Tensor:
    """(B,) bool: rows `ppo_update` may leave out of the forward/backward with ``settings.skip_zero_advantage``.

    A row whose advantages are 0 on every trained token adds exactly 0 to the loss when there is no KL loss term
    (every registered policy loss is Â · f(ratio); `build_algorithm` checks the configured one), while the
    normaliser, computed over all rows, still counts its tokens — so the gradient is unchanged. Only in one
    process: data-parallel ranks must run the same number of backward passes."""
    mask = batch.loss_mask.bool()
    zero = ~((batch.advantages != 0) & mask).any(dim=1)
    if (not settings.skip_zero_advantage or world_size > 1 or (batch.ref_logp is not None and settings.kl_coef > 0)
            or batch.teacher_topk_ids is not None):  # a loss term beside Â · f(ratio): every row counts
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
               normaliser: float, runtime: Runtime | None = None, cov_selection: torch.Tensor | None = None,
               micro_batches: Sequence[MicroBatch] | None = None) -> UpdateStats:
    """Forward + backward over ``rows`` of ``batch`` in micro-batches of ``settings.micro_batch_size`` (or the
    given ``micro_batches``, `vlrl.train.microbatch`: then ``rows`` is unused), adding to the parameters' ``.grad``
    (no optimizer step). ``normaliser`` is the `aggregate` denominator of the whole minibatch (all micro-batches, all
    ranks; ÷ world size under a ``runtime``, whose DDP/FSDP2 module trains and reduces gradients in the last
    micro-batch's backward); ``cov_selection`` (B, R), the minibatch's Clip-Cov / KL-Cov tokens
    (`minibatch_cov_selection`); unset for those losses, each micro-batch selects within itself. Returns the
    statistics of the rows: ``policy/loss`` once, the sum of the micro-batches' losses (this rank's share of the
    minibatch loss), per-token statistics pooled over the rows' tokens (a no-op micro-batch counts nothing)."""
    rt = runtime or Runtime.single(policy.model)
    stats = UpdateStats(behaviour_weight_cap=settings.behaviour_weight_cap)
    micro_batches = by_count(list(rows), settings.micro_batch_size) if micro_batches is None else micro_batches
    total_loss = 0.0
    for k, part in enumerate(micro_batches):
        with rt.gradient_sync(last=k == len(micro_batches) - 1):  # DDP/FSDP2 reduce gradients in the last backward
            loss = _micro_loss(policy, rt, batch, list(part.rows), settings, normaliser=normaliser,
                               cov_selection=cov_selection, stats=None if part.noop else stats)
            (loss * 0.0 if part.noop else loss).backward()  # a no-op pass: lockstep only, nothing learnt
        if not part.noop:
            total_loss += float(loss.detach())
    stats.add("policy/loss", total_loss)
    return stats


def _micro_loss(policy: Policy, rt: Runtime, batch: UpdateBatch, micro: list[int], settings: UpdateSettings, *,
                normaliser: float, cov_selection: torch.Tensor | None, stats: UpdateStats | None) -> torch.Tensor:
    """The loss of one micro-batch ``micro`` (rows of ``batch``) over the minibatch's ``normaliser``, its
    statistics added to ``stats`` (None: a no-op micro-batch, nothing counted)."""
    trajectories = [batch.trajectories[i] for i in micro]
    topk = batch.teacher_topk_ids  # algo.distill topk: the student's log-probs at the teacher's top-k, with grad
    query = HeadQuery(at=topk[micro], argmax=True) if topk is not None else None
    with rt.autocast():
        scores = teacher_forced(
            rt.module, policy.adapter, [t.prompt_ids for t in trajectories], [t.response_ids for t in trajectories],
            [t.vision for t in trajectories], pad_token_id=policy.pad_token_id, temperature=settings.temperature,
            with_entropy=True, layout=settings.layout, sums=stats.token_sums if stats is not None else None,
            query=query)
    logp, entropy = scores.logp, scores.entropy  # (b, R) each, 0 at padding
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
    kl = None
    if batch.ref_logp is not None and settings.kl_coef > 0:
        kl = kl_estimate(logp, rows_of(batch.ref_logp), settings.kl_estimator)
        loss = loss + settings.kl_coef * aggregate(kl, mask, settings.loss_agg, normaliser=normaliser)
    if query is not None:
        loss = loss + _distill_term(query.result, rows_of(batch.teacher_topk_logp), rows_of(topk), mask, settings,
                                    normaliser=normaliser, stats=stats)
    if stats is None:
        return loss
    if kl is not None:
        stats.add_tokens("policy/kl_ref", kl, mask)
    stats.add_tokens("policy/entropy", entropy, mask)
    stats.add_tokens("policy/approx_kl_old", 0.5 * (logp.detach() - old) ** 2, mask)
    for name, values in out.metrics.items():
        stats.add_tokens(f"policy/{name}", values, mask)
    stats.behaviour_weights.append(w[mask.bool()].detach())
    stats.behaviour_capped += int((capped & mask.bool()).sum())
    same = rows_of(batch.same_version) if batch.same_version.dim() == 2 else batch.same_version[micro].to(logp.device)
    drift, n = logp_drift(behaviour, old, mask, same)
    stats.drift_sum += float(drift) * int(n)
    stats.drift_tokens += int(n)
    stats.drift_max = max(stats.drift_max, float(logp_drift_max(behaviour, old, mask, same)))  # rollout/logprob_diff_max
    return loss


def _distill_term(student: dict[str, torch.Tensor], teacher_logp: torch.Tensor, teacher_ids: torch.Tensor,
                  mask: torch.Tensor, settings: UpdateSettings, *, normaliser: float,
                  stats: UpdateStats | None) -> torch.Tensor:
    """β · aggregate(D_t) of algo.distill's topk estimator (`vlrl.algos.distill.topk_reverse_kl`) of a micro-batch:
    the student's log-probs at the teacher's top-k and its rest mass (``student``, the pass's `HeadQuery` result),
    the teacher's (b, R, k + 1) and ids (b, R, k); ``distill/reverse_kl`` and ``distill/agreement`` (the student's
    argmax is the teacher's top-1) into ``stats``."""
    term = topk_reverse_kl(student["at_logp"], student["at_rest"], teacher_logp[..., :-1], teacher_logp[..., -1])
    if stats is not None:
        stats.add_tokens("distill/reverse_kl", term, mask)
        stats.add_tokens("distill/agreement", (student["argmax"] == teacher_ids[..., 0]).to(mask.dtype), mask)
    return settings.distill_coef * aggregate(term, mask, settings.loss_agg, normaliser=normaliser)


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
