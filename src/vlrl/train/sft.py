"""Supervised fine-tuning: cross-entropy on the assistant's tokens only.

For each sample the target is its reference ``response`` followed by EOS; the prompt (system, user text,
image tokens) is context, never a target. The loss is the token mean over the whole batch:

    L = − Σ_i Σ_t log π_θ(y_it | x_i, y_i<t) / Σ_i |y_i|

with the denominator taken over the full optimizer batch, so micro-batching does not change the gradient.
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
) -> dict[str, float]:
    """Run the SFT loop on ``samples``; returns the last logged metrics plus ``steps`` and ``seconds``."""
    train = stage.train
    budget = max_seconds if max_seconds is not None else train.max_seconds
    if train.max_samples is not None:
        samples = samples[: train.max_samples]
    examples = {s.id: encode_sft(policy, s) for s in samples}
    cursor = PromptCursor(samples, seed)
    model = policy.model
    model.train()
    optimizer, scheduler = make_optimizer(model, stage.optim)
    start, last, step = time.time(), {}, 0
    while step < train.steps and not (budget is not None and time.time() - start >= budget):
        step_start = time.time()
        batch = [examples[s.id] for s in cursor.next(train.batch_size)]
        n_tokens = sum(len(e.target_ids) for e in batch)  # the normaliser of the whole optimizer batch
        total_loss = 0.0
        for k in range(0, len(batch), train.micro_batch_size):
            micro = batch[k : k + train.micro_batch_size]
            tokens = collate([e.prompt_ids for e in micro], [e.target_ids for e in micro], [e.vision for e in micro],
                             pad_token_id=policy.pad_token_id)
            logp, _ = response_logprobs(model, policy.adapter, tokens)  # (b, R), 0 at padding
            loss = -logp.sum() / n_tokens
            loss.backward()
            total_loss += float(loss.detach())
        grad_norm = clip_and_step(model, optimizer, scheduler, stage.optim.grad_clip)
        step += 1
        seconds = time.time() - step_start
        last = {"sft/loss": total_loss, "sft/grad_norm": grad_norm, "perf/step_seconds": seconds,
                "perf/tokens_per_s": sum(len(e.prompt_ids) + len(e.target_ids) for e in batch) / max(seconds, 1e-9),
                "sft/lr": scheduler.get_last_lr()[0]}
        if step % train.log_every == 0 or step == train.steps:
            logger.log(stage_name, step, last, show=("sft/loss", "sft/grad_norm", "perf/step_seconds"))
    model.eval()
    return {**last, "steps": step, "seconds": time.time() - start, "epochs": cursor.epoch}


def sft_step_check(policy: Policy, samples: list[Sample]) -> torch.Tensor:
    """Mean assistant-token NLL of ``samples`` under the policy (no gradient), for tests and reports."""
    examples = [encode_sft(policy, s) for s in samples]
    tokens = collate([e.prompt_ids for e in examples], [e.target_ids for e in examples], [e.vision for e in examples],
                     pad_token_id=policy.pad_token_id)
    with torch.no_grad():
        logp, _ = response_logprobs(policy.model, policy.adapter, tokens)
    return -logp.sum() / tokens.response_mask.sum()
