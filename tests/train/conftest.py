"""The 2-rank torchrun job the distributed tests share (tests/train/dist_worker.py), run once per session."""

import pytest
import torch

from vlrl.config import CheckpointConfig
from vlrl.models import load_policy
from vlrl.train.checkpoint import Checkpointer
from vlrl.train.common import clip_and_step, make_optimizer
from vlrl.train.distributed import DistContext
from vlrl.train.runtime import Runtime
from vlrl.train.sft import sft_backward

from .dist_helpers import (
    MICRO,
    REPO,
    full_state,
    rl_trajectories,
    run_checked,
    sft_batch,
    sft_stage,
    torchrun,
    write_rl_data,
)


@pytest.fixture(scope="session")
def two_ranks(tiny_vlm_dir, tmp_path_factory):
    """Inputs made here (a 1-rank checkpoint and its full state, the RL trajectories, the RL data file), then
    the 2-rank job that reads them. Returns (out_dir, the 1-rank checkpoint's full state)."""
    out = tmp_path_factory.mktemp("two_ranks")
    policy = load_policy(str(tiny_vlm_dir))
    optimizer, scheduler = make_optimizer(policy.model, sft_stage().optim)
    sft_backward(policy, Runtime.single(policy.model), sft_batch(policy), MICRO)
    clip_and_step(policy.model, optimizer, scheduler, 1.0)
    Checkpointer(out / "ckpt_1rank", CheckpointConfig(every=1), DistContext()).save(
        1, stage="sft", module=policy.model, optimizer=optimizer, scheduler=scheduler,
        cursor={"epoch": 0, "position": 8}, carry_over={"rank": 0})
    one_rank = full_state(policy.model, optimizer)
    torch.save(rl_trajectories(load_policy(str(tiny_vlm_dir))), out / "trajectories.pt")
    write_rl_data(out / "rl_data" / "train.jsonl")
    job = torchrun(2, str(REPO / "tests/train/dist_worker.py"), str(tiny_vlm_dir), str(out))
    run_checked(job, timeout=900, retry_native_abort=True, real_torchrun=True)  # the real launcher, once
    return out, one_rank
