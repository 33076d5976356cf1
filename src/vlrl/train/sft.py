"""Supervised fine-tuning: cross-entropy on the assistant's tokens only.

For each sample the target is its reference ``response`` followed by EOS; the prompt (system, user text,
image tokens) is context, never a target. The loss is the token mean over the whole batch:

    L = − Σ_i Σ_t log π_θ(y_it | x_i, y_i<t) / Σ_i |y_i|

with the denominator taken over the full optimizer batch, so micro-batching does not change the gradient.

Batches are padded (`collate`) or padding-free (`vlrl.models.packed`: sequences packed into rows, each with
its own positions, none attending to another), which gives the same loss and gradients with fewer tokens
processed. With a packing plan (``data.packing_plan``, written by `vlrl data pack`) the unit of a batch is a
planned bin of samples, read from the plan with no packing at run time; ``train.padding_free`` packs each
micro-batch of samples at run time instead. ``train.trainable`` freezes everything else for the stage (the
`align` stage trains only the projector) and ``optim.module_lr`` sets per-module learning rates.

Under torchrun each rank trains on its contiguous share of every batch's units and the denominator is
all-reduced over the ranks, so N ranks compute the gradient of the same big batch (`vlrl.train.distributed`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vlrl.config import SFTStage
from vlrl.data import Sample
from vlrl.data.cursor import PromptCursor
from vlrl.data.packing import PackingPlan
from vlrl.data.sample import load_image
from vlrl.models import Policy
from vlrl.models.adapters import VisionInputs
from vlrl.models.forward import PassLayout, teacher_forced
from vlrl.report import MetricsLogger
from vlrl.train.budget import PhaseMeter, compute_dtype
from vlrl.train.common import make_optimizer, step_or_skip
from vlrl.train.microbatch import CostModel, MicroBatch, RowSize, by_count, plan_ranks, rank_imbalance
from vlrl.train.modules import stage_modules
from vlrl.train.result import StageResult
from vlrl.train.runtime import Runtime


@dataclass
class SFTExample:
    prompt_ids: list[int]
    target_ids: list[int]
    vision: VisionInputs | None
    name: str = ""  # the sample's id (named in warnings)

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.target_ids)


def encode_sft(policy: Policy, sample: Sample, *, max_tokens: int | None = None) -> SFTExample:
    """Prompt ids (chat template, generation prompt) and target ids (response + EOS) of one sample.

    ``max_tokens``: cut the target's tail so that prompt + target fit (a sample a packing plan marked as
    truncated); a prompt that does not leave room for one target token is an error.
    """
    if sample.response is None:
        raise ValueError(
            f"sample {sample.id} ({sample.source or 'generated'}): SFT needs a reference 'response' "
            "(or a final assistant message)"
        )
    encoded = policy.adapter.encode_prompt(sample.messages, [load_image(src) for src in sample.images])
    target = policy.adapter.encode_text(sample.response) + [policy.eos_token_ids[0]]
    if max_tokens is not None and len(encoded.input_ids) + len(target) > max_tokens:
        room = max_tokens - len(encoded.input_ids)
        if room < 1:
            raise ValueError(f"sample {sample.id} ({sample.source or 'generated'}): its prompt of "
                             f"{len(encoded.input_ids)} tokens leaves no room for a target within {max_tokens} tokens")
        target = target[:room]
    return SFTExample(encoded.input_ids, target, encoded.vision, str(sample.id))


def train_sft(
    policy: Policy,
    samples: list[Sample],
    stage: SFTStage,
    *,
    logger: MetricsLogger,
    seed: int,
    stage_name: str = "sft",
    max_seconds: float | None = None,
    plan: PackingPlan | None = None,
    runtime: Runtime | None = None,
    validate: Callable[[int], None] | None = None,
) -> StageResult:
    """Run the SFT loop on ``samples`` (or on the bins of ``plan``, a plan computed for ``samples``); returns
    the `StageResult` (the last step's metrics, ``steps``, ``seconds``, ``epochs``). ``validate(step)`` runs after every step
    (``eval.every``: `vlrl.train.validation.Validation`; the model is in eval mode meanwhile).

    ``runtime`` (`vlrl.train.runtime`): the ranks, the wrapped module and the checkpointer; default one
    process, no checkpoints. Resuming restores the step, cursor, optimizer and RNG from its checkpoint."""
    train = stage.train
    rt = runtime or Runtime.single(policy.model)
    budget = max_seconds if max_seconds is not None else train.max_seconds
    units, examples = _units(policy, samples, stage, plan)
    packed = plan is not None or train.padding_free
    cursor = PromptCursor(list(range(len(units))), seed)  # type: ignore[arg-type]  (any list works)
    model = rt.module
    perf = PhaseMeter(policy.model, rt.ctx.device, compute_dtype(policy.model, rt.cfg.mixed_precision), rt.ctx)
    cost = CostModel.of(policy.model, padding_free=packed)  # a unit's cost (train.max_tokens_per_micro_batch)
    with stage_modules(policy, train) as modules, perf:  # train.trainable (model.lora: the adapters), gradient checkpointing
        model.train()
        optimizer, scheduler = make_optimizer(policy.model, stage.optim, policy.adapter.module_groups,  # names unwrapped
                                              total_steps=stage.train.steps)
        step, _ = rt.restore(stage_name, optimizer, scheduler, cursor)
        start, last = time.time(), {}
        try:
            while step < train.steps and not rt.out_of_time(time.time() - start, budget):
                step_start = time.time()
                perf.begin()
                drawn = cursor.next(train.batch_size)
                batch, micro_batches, layout = sft_micro_batches([[examples[i] for i in units[u]] for u in drawn],
                                                                 rt.ctx, train, cost)
                total_loss, processed, real = sft_backward(policy, rt, batch, train.micro_batch_size, packed=packed,
                                                           planned=plan is not None, micro_batches=micro_batches)
                grad_norm = step_or_skip(model, optimizer, scheduler, stage.optim.grad_clip, loss=total_loss,
                                         ctx=rt.ctx, on_nonfinite=train.on_nonfinite,
                                         where=f"{stage_name} step {step + 1}")
                step += 1
                perf.phase("")  # perf/mfu, perf/tflops of the step
                seconds = time.time() - step_start
                last = {"sft/loss": total_loss, "perf/step_seconds": seconds,
                        "perf/tokens_per_s": real / max(seconds, 1e-9), "perf/padding_frac": 1 - real / max(processed, 1),
                        "sft/lr": scheduler.get_last_lr()[0], "sft/trainable_params": modules.trainable_params,
                        "perf/gradient_checkpointing": float(modules.gradient_checkpointing), **layout,
                        **perf.metrics()}
                if grad_norm is not None:
                    last["sft/grad_norm"] = grad_norm
                if train.on_nonfinite == "skip":
                    last["train/nonfinite_skipped"] = int(grad_norm is None)  # this step's update dropped
                if step % train.log_every == 0 or step == train.steps:
                    logger.log(stage_name, step, last, show=("sft/loss", "sft/grad_norm", "perf/step_seconds"))
                rt.after_step(step, stage_name, optimizer, scheduler, cursor)
                if validate is not None:
                    model.eval()
                    validate(step)
                    model.train()
        finally:
            model.eval()
    return StageResult(step, time.time() - start, last, epochs=cursor.epoch)


def sft_micro_batches(units: list[list[SFTExample]], ctx, train, cost: CostModel
                      ) -> tuple[list[list[SFTExample]], list[MicroBatch], dict[str, float]]:
    """A global batch's ``units`` (one sample, or a planned bin) as this rank runs them: (the units its micro-batches
    index, the micro-batches, their metrics). Count-based: its contiguous share in micro-batches of
    ``train.micro_batch_size``. With ``train.max_tokens_per_micro_batch``: every rank's share rebalanced by cost and
    cut within the budget, the same number of micro-batches on every rank (`vlrl.train.microbatch.plan_ranks`;
    each rank holds every unit, so nothing moves). Metrics: this rank's ``perf/micro_batches``, its costliest
    micro-batch, and over the ranks ``perf/rank_imbalance``."""
    size = len(ctx.shard(units, what="train.batch_size"))  # the count-based share (checks the batch splits evenly)
    held = [list(range(r * size, (r + 1) * size)) for r in range(ctx.world_size)]
    sizes = [RowSize(sum(len(e.prompt_ids) for e in unit), sum(len(e.target_ids) for e in unit),
                     sum(e.vision.patches(cost.patch_size) for e in unit if e.vision is not None),
                     ",".join(e.name for e in unit)) for unit in units]
    budget = train.max_tokens_per_micro_batch
    if budget is None:
        batch, parts = [units[i] for i in held[ctx.rank]], held
        micro_batches = by_count(range(len(batch)), train.micro_batch_size)
        mine = [tuple(held[ctx.rank][i] for i in m.rows) for m in micro_batches]
    else:
        plan = plan_ranks(held, sizes.__getitem__, cost, budget)
        batch, parts, micro_batches = units, plan.rows, plan.micro_batches[ctx.rank]
        mine = [m.rows for m in micro_batches if not m.noop]
    metrics = {"perf/micro_batches": float(len(micro_batches)),
               "perf/micro_batch_cost_max": max((cost.micro([sizes[i] for i in rows]) for rows in mine), default=0.0)}
    if ctx.enabled:
        metrics["perf/rank_imbalance"] = rank_imbalance(parts, lambda i: cost.row(sizes[i]))
        metrics["perf/micro_batch_cost_max"] = max(ctx.gather_objects(metrics["perf/micro_batch_cost_max"]))
    return batch, micro_batches, metrics


def sft_backward(policy: Policy, rt: Runtime, batch: list[list[SFTExample]], micro_batch_size: int, *,
                 packed: bool = False, planned: bool = False,
                 micro_batches: list[MicroBatch] | None = None) -> tuple[float, int, int]:
    """Accumulate the gradient of this rank's share ``batch`` (units: one sample, or a planned bin) of a global
    batch — in micro-batches of ``micro_batch_size`` units, or the given ``micro_batches`` of ``batch``'s units
    (`sft_micro_batches`) —; return (global loss, global token positions processed, global real tokens). The
    normaliser is all ranks' target tokens, so the ranks' summed gradients are the gradient of the whole batch;
    gradients are reduced across ranks only in the last micro-batch's backward (a no-op one's loss × 0)."""
    if micro_batches is None:
        micro_batches = by_count(range(len(batch)), micro_batch_size)
    # the optimizer batch's normaliser, over all ranks (÷ world size: DDP/FSDP2 average gradients)
    local = sum(len(e.target_ids) for m in micro_batches if not m.noop for i in m.rows for e in batch[i])
    normaliser = rt.ctx.local_normaliser(rt.ctx.all_reduce_sum([local])[0])
    total_loss, processed, real = 0.0, 0, 0
    for k, part in enumerate(micro_batches):
        micro = [batch[i] for i in part.rows]
        with rt.gradient_sync(last=k == len(micro_batches) - 1):
            with rt.autocast():
                logp, n_processed = _micro_logprobs(policy, rt.module, micro, packed=packed, planned=planned)
            loss = -logp.sum() / normaliser
            (loss * 0.0 if part.noop else loss).backward()
        if part.noop:
            continue
        total_loss += float(loss.detach())
        processed += n_processed
        real += sum(e.length for unit in micro for e in unit)
    total_loss, processed, real = rt.ctx.all_reduce_sum([total_loss, processed, real])
    return total_loss / rt.ctx.world_size, int(processed), int(real)  # Σ_i ℓ_i / N over all ranks


def _units(policy: Policy, samples: list[Sample], stage: SFTStage, plan: PackingPlan | None):
    """The units a batch is drawn from — a planned bin of sample indices, or one sample — and the encoded
    examples by sample index (truncated samples cut to the plan's capacity)."""
    if plan is None:
        if stage.train.max_samples is not None:
            samples = samples[: stage.train.max_samples]
        return [[k] for k in range(len(samples))], {k: encode_sft(policy, s) for k, s in enumerate(samples)}
    if stage.train.max_samples is not None:
        raise ValueError("train.max_samples cannot be combined with data.packing_plan (the plan covers the whole file)")
    plan.check_samples([s.id for s in samples])
    truncated = set(plan.truncated.tolist())
    units = [[int(i) for i in b] for b in plan.bins()]
    examples = {i: encode_sft(policy, samples[i], max_tokens=plan.capacity if i in truncated else None)
                for unit in units for i in unit}
    _check_bins(units, examples, plan)
    return units, examples


def _micro_logprobs(policy: Policy, model: torch.nn.Module, units: list[list[SFTExample]], *, packed: bool,
                    planned: bool):
    """Target log-probs (b, R) of one micro-batch and the number of token positions the forward processed.

    Padded: one row per sample, padded to the longest. Packed: a planned bin per row (``planned``), or the
    micro-batch's samples first-fit into rows as long as its longest sample; flash-attention gets one flat row.
    """
    flat = [e for unit in units for e in unit]
    groups = None
    if planned:
        groups, offset = [], 0
        for unit in units:
            groups.append(list(range(offset, offset + len(unit))))
            offset += len(unit)
    scores = teacher_forced(model, policy.adapter, [e.prompt_ids for e in flat], [e.target_ids for e in flat],
                            [e.vision for e in flat], pad_token_id=policy.pad_token_id,
                            layout=PassLayout(padding_free=packed), groups=groups)
    return scores.logp, scores.positions


def _check_bins(units: list[list[int]], examples: dict[int, SFTExample], plan: PackingPlan) -> None:
    """The plan's lengths must be this model's: a bin that overflows means it was planned with another
    tokenizer or image processor (or other pixel bounds)."""
    for b, unit in enumerate(units):
        total = sum(examples[i].length for i in unit)
        if total > plan.capacity:
            model = plan.meta.get("model", {})
            raise ValueError(
                f"data.packing_plan: bin {b} holds {total} tokens with this model's processor but the plan's capacity is "
                f"{plan.capacity} (the plan was computed with model {model.get('path', '?')!r}, min_pixels "
                f"{model.get('min_pixels')}, max_pixels {model.get('max_pixels')}); re-run `vlrl data pack` for this model"
            )

