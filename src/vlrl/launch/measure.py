"""`vlrl plan --measure`: one real training step on this machine's CPU, its peak memory by category (torch's
`MemTracker`), for the planner to compare with its estimate (`vlrl.launch.planner.format_measurement`)."""

from __future__ import annotations

import torch

from vlrl.launch.shapes import Workload


def measure_train_step(cfg, policy, w: Workload) -> dict[str, float]:
    """Peak memory (bytes, by category) of one real training step of ``policy`` on this machine's CPU: a warm-up
    step (so AdamW moments exist), then one step of two micro-batches of ``w.micro_batch`` sequences of
    P + R tokens tracked by torch's `MemTracker` — the quantity `activations` + `trained_state` estimate."""
    from vlrl.compat import memory_tracker
    from vlrl.data import load_image
    from vlrl.data.splits import generate_split
    from vlrl.models import collate, response_logprobs
    from vlrl.train.common import make_optimizer
    from vlrl.train.modules import stage_modules

    samples = generate_split(cfg.data, "train", w.micro_batch)
    encoded = [policy.adapter.encode_prompt(s.messages, [load_image(x) for x in s.images]) for s in samples]
    filler = policy.adapter.encode_text("a")[0]
    tokens = collate([e.input_ids for e in encoded], [[filler] * w.response_tokens] * len(encoded),
                     [e.vision for e in encoded], pad_token_id=policy.pad_token_id)
    if cfg.model.lora is not None and policy.lora is None:
        from vlrl.models.lora import apply_lora

        apply_lora(policy, cfg.model.lora)
    model = policy.model
    model.train()
    with stage_modules(policy, cfg.train):  # train.trainable / model.lora, train.gradient_checkpointing
        optimizer, scheduler = make_optimizer(model, cfg.optim, policy.adapter.module_groups)

        def micro_step() -> None:
            logp, _ = response_logprobs(model, policy.adapter, tokens)
            (-logp.sum()).backward()

        micro_step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tracker = memory_tracker(model, optimizer)
        with tracker:
            micro_step()
            tracker.reset_mod_stats()
            micro_step()  # gradients of the first micro-batch are held while the second one's activations peak
            optimizer.step()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    return {str(kind).split(".")[-1].lower(): float(value) for kind, value in peak.items()}
