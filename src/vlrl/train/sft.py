"""Supervised fine-tuning: cross-entropy on the assistant's tokens only.

For each sample the target is its reference ``response`` followed by EOS; the prompt (system, user text,
image tokens) is context, never a target. The loss is the token mean over the whole batch:

    L = − Σ_i Σ_t log π_θ(y_it | x_i, y_i<t) / Σ_i |y_i|

with the denominator taken over the full optimizer batch, so micro-batching does not change the gradient.
Under torchrun each rank trains on its contiguous share of every batch and the denominator is all-reduced
over the ranks, so N ranks compute the gradient of the same big batch (`vlrl.train.distributed`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from vlrl.config import SFTStage
from vlrl.data import Sample
from vlrl.data.sample import load_image
from vlrl.models import Policy, collate, response_logprobs
from vlrl.models.adapters import VisionInputs
from vlrl.report import MetricsLogger
from vlrl.train.common import PromptCursor, clip_and_step, make_optimizer
from vlrl.train.distributed import Runtime


@dataclass
class SFTExample:
    prompt_ids: list[int]
    target_ids: list[int]
    vision: VisionInputs | None


def encode_sft(policy: Policy, sample: Sample) -> SFTExample:
    """Prompt ids (chat template, generation prompt) and target ids (response + EOS) of one sample."""
    if sample.response is None:
        raise ValueError(
            f"sample {sample.id} ({sample.source or 'generated'}): SFT needs a reference 'response' "
            "(or a final assistant message)"
        )
    encoded = policy.adapter.encode_prompt(sample.messages, [load_image(src) for src in sample.images])
    target = policy.adapter.encode_text(sample.response) + [policy.eos_token_ids[0]]
    return SFTExample(encoded.input_ids, target, encoded.vision)


def train_sft(
    policy: Policy,
    samples: list[Sample],
    stage: SFTStage,
    *,
    logger: MetricsLogger,
    seed: int,
    stage_name: str = "sft",
    max_seconds: float | None = None,
    runtime: Runtime | None = None,
) -> dict[str, float]:
    """Run the SFT loop on ``samples``; returns the last logged metrics plus ``steps`` and ``seconds``.

    ``runtime`` (`vlrl.train.distributed`): the ranks, the wrapped module and the checkpointer; default one
    process, no checkpoints. Resuming restores the step, cursor, optimizer and RNG from its checkpoint."""
    train = stage.train
    rt = runtime or Runtime.single(policy.model)
    budget = max_seconds if max_seconds is not None else train.max_seconds
    if train.max_samples is not None:
        samples = samples[: train.max_samples]
    examples = {s.id: encode_sft(policy, s) for s in samples}
    cursor = PromptCursor(samples, seed)
    model = rt.module
    model.train()
    optimizer, scheduler = make_optimizer(model, stage.optim)
    step, _ = rt.restore(stage_name, optimizer, scheduler, cursor)
    start, last = time.time(), {}
    while step < train.steps and not rt.out_of_time(time.time() - start, budget):
        step_start = time.time()
        batch = [examples[s.id] for s in rt.ctx.shard(cursor.next(train.batch_size), what="train.batch_size")]
        total_loss, n_seen = sft_backward(policy, rt, batch, train.micro_batch_size)
        grad_norm = clip_and_step(model, optimizer, scheduler, stage.optim.grad_clip)
        step += 1
        seconds = time.time() - step_start
        last = {"sft/loss": total_loss, "sft/grad_norm": grad_norm, "perf/step_seconds": seconds,
                "perf/tokens_per_s": n_seen / max(seconds, 1e-9), "sft/lr": scheduler.get_last_lr()[0]}
        if step % train.log_every == 0 or step == train.steps:
            logger.log(stage_name, step, last, show=("sft/loss", "sft/grad_norm", "perf/step_seconds"))
        rt.after_step(step, stage_name, optimizer, scheduler, cursor)
    model.eval()
    return {**last, "steps": step, "seconds": time.time() - start, "epochs": cursor.epoch}


def sft_backward(policy: Policy, rt: Runtime, batch: list[SFTExample], micro_batch_size: int) -> tuple[float, float]:
    """Accumulate the gradient of this rank's share ``batch`` of a global batch; return (global loss, global
    tokens seen). The normaliser is all ranks' target tokens, so the ranks' summed gradients are the gradient
    of the whole batch; gradients are reduced across ranks only in the last micro-batch's backward."""
    # the normaliser of the whole optimizer batch, over all ranks (÷ world size: DDP/FSDP average gradients)
    n_tokens, n_seen = rt.ctx.all_reduce_sum([sum(len(e.target_ids) for e in batch),
                                              sum(len(e.prompt_ids) + len(e.target_ids) for e in batch)])
    normaliser = rt.ctx.local_normaliser(n_tokens)
    total_loss = 0.0
    starts = range(0, len(batch), micro_batch_size)
    for k in starts:
        micro = batch[k : k + micro_batch_size]
        tokens = collate([e.prompt_ids for e in micro], [e.target_ids for e in micro], [e.vision for e in micro],
                         pad_token_id=policy.pad_token_id)
        with rt.gradient_sync(last=k == starts[-1]):
            with rt.autocast():
                logp, _ = response_logprobs(rt.module, policy.adapter, tokens)  # (b, R), 0 at padding
            loss = -logp.sum() / normaliser
            loss.backward()
        total_loss += float(loss.detach())
    return rt.ctx.all_reduce_sum([total_loss])[0] / rt.ctx.world_size, n_seen  # Σ_i ℓ_i / N over all ranks


def sft_step_check(policy: Policy, samples: list[Sample]) -> torch.Tensor:
    """Mean assistant-token NLL of ``samples`` under the policy (no gradient), for tests and reports."""
    examples = [encode_sft(policy, s) for s in samples]
    tokens = collate([e.prompt_ids for e in examples], [e.target_ids for e in examples], [e.vision for e in examples],
                     pad_token_id=policy.pad_token_id)
    with torch.no_grad():
        logp, _ = response_logprobs(policy.model, policy.adapter, tokens)
    return -logp.sum() / tokens.response_mask.sum()
