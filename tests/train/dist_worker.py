"""The 2-rank side of tests/train/test_distributed.py, run under torchrun (gloo on loopback).

    torchrun --standalone --nproc_per_node 2 tests/train/dist_worker.py MODEL_DIR OUT_DIR

Writes into OUT_DIR (rank 0): ``grads_sft_{ddp,fsdp}.pt`` (the full gradient after one accumulated backward
over this rank's half of `test_distributed.sft_batch()`), ``ckpt_{ddp,fsdp}/`` (a checkpoint after one SFT
step on 2 ranks) with ``state_{ddp,fsdp}.pt`` (the full model + optimizer state at that moment), and
``loaded_{ddp,fsdp}.pt`` (the full state after loading OUT_DIR/ckpt_1rank/step_00000001 on 2 ranks).
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dist_helpers import MICRO, full_state, grads_of, sft_batch, sft_stage  # noqa: E402

from vlrl.config import CheckpointConfig, DistConfig  # noqa: E402
from vlrl.models import load_policy  # noqa: E402
from vlrl.train.checkpoint import Checkpointer  # noqa: E402
from vlrl.train.common import clip_and_step, make_optimizer  # noqa: E402
from vlrl.train.distributed import Runtime, init_distributed, shutdown_distributed, wrap_model  # noqa: E402
from vlrl.train.sft import sft_backward  # noqa: E402


def main(model_dir: str, out: str) -> None:
    out_dir = Path(out)
    for strategy in ("ddp", "fsdp"):
        cfg = DistConfig(strategy=strategy)
        ctx = init_distributed(cfg)
        # 1. the gradient of this rank's half of the batch, reduced over both ranks
        policy = load_policy(model_dir)
        rt = Runtime(ctx, wrap_model(policy.model, ctx, cfg), cfg)
        rt.module.train()
        batch = ctx.shard(sft_batch(policy), what="batch")
        sft_backward(policy, rt, batch, MICRO)
        grads = grads_of(rt.module)
        if ctx.is_main:
            torch.save(grads, out_dir / f"grads_sft_{strategy}.pt")
        # 2. one SFT step on 2 ranks, checkpointed
        policy = load_policy(model_dir)
        rt = Runtime(ctx, wrap_model(policy.model, ctx, cfg), cfg)
        optimizer, scheduler = make_optimizer(rt.module, sft_stage().optim)
        sft_backward(policy, rt, ctx.shard(sft_batch(policy), what="batch"), MICRO)
        clip_and_step(rt.module, optimizer, scheduler, 1.0)
        Checkpointer(out_dir / f"ckpt_{strategy}", CheckpointConfig(every=1), ctx).save(
            1, stage="sft", module=rt.module, optimizer=optimizer, scheduler=scheduler,
            cursor={"epoch": 0, "position": 8}, carry_over={})
        state = full_state(rt.module, optimizer)
        if ctx.is_main:
            torch.save(state, out_dir / f"state_{strategy}.pt")
        # 3. the 1-rank checkpoint loaded on 2 ranks
        policy = load_policy(model_dir)
        module = wrap_model(policy.model, ctx, cfg)
        optimizer, scheduler = make_optimizer(module, sft_stage().optim)
        Checkpointer(out_dir / "unused", CheckpointConfig(), ctx).load(
            out_dir / "ckpt_1rank" / "step_00000001", stage="sft", module=module, optimizer=optimizer, scheduler=scheduler)
        state = full_state(module, optimizer)
        if ctx.is_main:
            torch.save(state, out_dir / f"loaded_{strategy}.pt")
        ctx.barrier()
    shutdown_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:3])
