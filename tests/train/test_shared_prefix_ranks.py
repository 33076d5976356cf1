"""train.shared_prefix where real models train: the update's forward shares each group's prompt (one grouped
forward per micro-batch, `vlrl.models.grouped`) under DDP and FSDP2 on 2 gloo ranks, with and without gradient
checkpointing, and its loss and every gradient equal the plain pass's (atol 1e-6, fp32) — the pass the update ran
under these wrappers before (tests/train/dist_shared_prefix_worker.py)."""

import pytest
import torch

from vlrl.models import load_policy

from .dist_helpers import REPO, rl_trajectories, run_checked, torchrun

ARMS = ["ddp", "ddp_checkpointed", "fsdp", "fsdp_checkpointed"]


@pytest.fixture(scope="module")
def two_rank_runs(tiny_vlm_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("shared_prefix_ranks")
    torch.save(rl_trajectories(load_policy(str(tiny_vlm_dir))), out / "trajectories.pt")
    run_checked(torchrun(2, str(REPO / "tests/train/dist_shared_prefix_worker.py"), str(tiny_vlm_dir), str(out)),
                timeout=600, retry_native_abort=True)
    return out


@pytest.mark.parametrize("arm", ARMS)
def test_the_shared_pass_on_two_ranks_equals_the_plain_one(two_rank_runs, arm):
    result = torch.load(two_rank_runs / f"shared_prefix_{arm}.pt", weights_only=False)
    plain, shared = result["plain"], result["shared"]
    assert plain["rows"] == (0.0, 8.0) and shared["rows"] == (8.0, 8.0)  # every micro-batch shared its prompt
    assert abs(plain["loss"]) > 1e-3 and abs(shared["loss"] - plain["loss"]) < 1e-6
    assert plain["grads"].keys() == shared["grads"].keys() and any("visual.blocks" in k for k in plain["grads"])
    assert max(float(g.abs().max()) for g in plain["grads"].values()) > 1e-3
    for name, grad in plain["grads"].items():
        torch.testing.assert_close(shared["grads"][name], grad, rtol=0, atol=1e-6, msg=name)
