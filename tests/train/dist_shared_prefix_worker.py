"""The 2-rank side of tests/train/test_shared_prefix_ranks.py: the update's shared-prefix pass (one grouped forward
per micro-batch, `vlrl.models.grouped`) under DDP and FSDP2, with and without gradient checkpointing.

    torchrun --standalone --nproc_per_node 2 tests/train/dist_shared_prefix_worker.py MODEL_DIR OUT_DIR

Reads OUT_DIR/trajectories.pt (`dist_helpers.rl_trajectories`: 4 prompts × 2 responses; a rank's half is 2 prompts,
its micro-batches of 2 rows one prompt each). For every arm (ddp, fsdp) × (checkpointing off, on), rank 0 writes
OUT_DIR/shared_prefix_{arm}.pt: the update's loss (summed over the ranks) and full gradients (`accumulate`,
token_mean) with train.shared_prefix off and on, and the rows the shared pass scored (both ranks).
"""

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dist_helpers import grads_of, rl_settings, rl_update_batch  # noqa: E402

from vlrl.algos import normaliser_for  # noqa: E402
from vlrl.config import DistConfig  # noqa: E402
from vlrl.models import load_policy  # noqa: E402
from vlrl.models.shared_prefix import SHARED_METRIC  # noqa: E402
from vlrl.train.distributed import init_distributed, shutdown_distributed, wrap_model  # noqa: E402
from vlrl.train.modules import gradient_checkpointing  # noqa: E402
from vlrl.train.runtime import Runtime  # noqa: E402
from vlrl.train.update import accumulate  # noqa: E402


def arm(model_dir: str, out: Path, strategy: str, checkpointing: bool) -> None:
    cfg = DistConfig(strategy=strategy)
    ctx = init_distributed(cfg)
    policy = load_policy(model_dir)
    rt = Runtime(ctx, wrap_model(policy.model, ctx, cfg), cfg)
    trajectories = ctx.shard(torch.load(out / "trajectories.pt", weights_only=False), what="trajectories")
    batch = rl_update_batch(policy, trajectories, rt)  # GRPO advantages over both ranks' responses
    rows = list(range(len(trajectories)))
    result = {}
    with gradient_checkpointing(policy.model, checkpointing) as on:
        assert on == checkpointing
        for shared in (False, True):
            rt.module.zero_grad(set_to_none=True)
            rt.module.train()
            settings = dataclasses.replace(rl_settings("token_mean"), shared_prefix=shared)
            normaliser = rt.global_normaliser(normaliser_for("token_mean", batch.loss_mask))
            stats = accumulate(policy, batch, rows, settings, normaliser=normaliser, runtime=rt)
            loss, shared_rows, total_rows = ctx.all_reduce_sum([stats.values["policy/loss"][0],
                                                               *stats.token_sums[SHARED_METRIC]])
            result["shared" if shared else "plain"] = {"loss": loss, "grads": grads_of(rt.module),
                                                       "rows": (shared_rows, total_rows)}
    if ctx.is_main:
        torch.save(result, out / f"shared_prefix_{strategy}{'_checkpointed' if checkpointing else ''}.pt")


def main(model_dir: str, out: str) -> None:
    for strategy in ("ddp", "fsdp"):
        for checkpointing in (False, True):
            arm(model_dir, Path(out), strategy, checkpointing)
    shutdown_distributed(init_distributed(DistConfig()))  # the process group the arms joined (idempotent)


if __name__ == "__main__":
    main(*sys.argv[1:3])
