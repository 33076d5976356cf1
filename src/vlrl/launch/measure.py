"""`vlrl plan --measure`: one real training step on this machine's CPU, its peak memory by category and by phase
(torch's `MemTracker`), for the planner to compare with its estimate (`vlrl.launch.planner.format_measurement`,
`vlrl.launch.memory.estimate_phases`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from vlrl.launch.shapes import Workload


def measure_train_step(cfg, policy, w: Workload) -> dict[str, float]:
    """Peak memory (bytes, by category) of one real training step of ``policy`` on this machine's CPU: a warm-up
    step (so AdamW moments exist), then one step of two micro-batches of ``w.micro_batch`` sequences of
    P + R tokens tracked by torch's `MemTracker` — the quantity `activations` + `trained_state` estimate."""
    from vlrl.compat import memory_tracker

    with _step(cfg, policy, w.micro_batch, w.response_tokens) as (model, optimizer, micro_step, _):
        tracker = memory_tracker(model, optimizer)
        with tracker:
            micro_step()
            tracker.reset_mod_stats()
            micro_step()  # gradients of the first micro-batch are held while the second one's activations peak
            optimizer.step()
    return _peak(tracker)


def measure_phases(cfg, policy, w: Workload) -> dict[str, float]:
    """Peak memory (bytes) of each phase of a training step on this CPU, one `MemTracker` per phase, over micro-
    batches of m = `vlrl.launch.memory.micro_rows` sequences (rounded; the token budget's): ``old/ref log-probs`` (a
    no-grad pass), ``forward + backward`` (two micro-batches: the first one's gradients held during the second) and
    ``optimizer step`` — what `vlrl.launch.memory.estimate_phases` estimates."""
    from vlrl.compat import memory_tracker
    from vlrl.launch.memory import micro_rows

    rows = max(1, round(micro_rows(w)))
    out: dict[str, float] = {}
    with _step(cfg, policy, rows, w.response_tokens) as (model, optimizer, micro_step, score):
        phases: dict[str, list[Callable[[], None]]] = {"old/ref log-probs": [score],
                                                       "forward + backward": [micro_step, micro_step],
                                                       "optimizer step": [optimizer.step]}
        for phase, calls in phases.items():
            tracker = memory_tracker(model, optimizer)
            with tracker:
                for run in calls:
                    tracker.reset_mod_stats()  # a second micro-batch: MemTracker's per-module stats start again
                    run()
            out[phase] = _peak(tracker)["total"]
    return out


@contextmanager
def _step(cfg, policy, rows: int, response_tokens: int) -> Iterator[tuple]:
    """(model, optimizer, one micro-batch's forward + backward, one no-grad scoring pass) of ``rows`` generated
    samples with ``response_tokens`` filler tokens, after a warm-up step (AdamW's moments exist), inside
    train.trainable / model.lora / gradient checkpointing as configured."""
    from vlrl.data import load_image
    from vlrl.data.splits import generate_split
    from vlrl.models import collate, response_logprobs
    from vlrl.train.common import make_optimizer
    from vlrl.train.modules import stage_modules

    samples = generate_split(cfg.data, "train", rows)
    encoded = [policy.adapter.encode_prompt(s.messages, [load_image(x) for x in s.images]) for s in samples]
    filler = policy.adapter.encode_text("a")[0]
    tokens = collate([e.input_ids for e in encoded], [[filler] * response_tokens] * len(encoded),
                     [e.vision for e in encoded], pad_token_id=policy.pad_token_id)
    if cfg.model.lora is not None and policy.lora is None:
        from vlrl.models.lora import apply_lora

        apply_lora(policy, cfg.model.lora)
    model = policy.model
    model.train()
    with stage_modules(policy, cfg.train):  # train.trainable / model.lora, train.gradient_checkpointing
        optimizer, _ = make_optimizer(model, cfg.optim, policy.adapter.module_groups)

        def micro_step() -> None:
            logp, _ = response_logprobs(model, policy.adapter, tokens)
            (-logp.sum()).backward()

        def score() -> None:
            model.eval()
            with torch.no_grad():
                response_logprobs(model, policy.adapter, tokens)
            model.train()

        micro_step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        yield model, optimizer, micro_step, score


def _peak(tracker) -> dict[str, float]:
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    return {str(kind).split(".")[-1].lower(): float(value) for kind, value in peak.items()}


