"""2 gloo ranks (DDP and FSDP2) compute the gradient of one big batch; checkpoints move between world sizes.

One torchrun job (`dist_worker.py`, ~10 s) produces every 2-rank result; the tests compare them with the same
computation on 1 rank in this process.
"""

import pytest
import torch

from vlrl.config import CheckpointConfig, DistConfig
from vlrl.models import load_policy
from vlrl.train.checkpoint import Checkpointer
from vlrl.train.common import clip_and_step, make_optimizer
from vlrl.train.distributed import DistContext, Runtime, fsdp_units
from vlrl.train.sft import sft_backward

from .dist_helpers import MICRO, REPO, full_state, grads_of, run_checked, sft_batch, sft_stage, torchrun


def assert_states_equal(a, b, *, exact=True):
    (model_a, optim_a), (model_b, optim_b) = a, b
    assert model_a.keys() == model_b.keys()
    # not exact: an Adam step moves a weight by up to lr = 1e-3, and near-zero gradients summed in another
    # order move it slightly differently (measured ≤ 2e-6): 1e-5 is 1 % of a step
    check = torch.equal if exact else (lambda x, y: torch.allclose(x, y, rtol=1e-3, atol=1e-5))
    bad = [k for k in model_a if not check(model_a[k], model_b[k])]
    assert not bad, f"weights differ: {bad[:5]}"
    assert optim_a["state"].keys() == optim_b["state"].keys()
    bad = [(k, f) for k, s in optim_a["state"].items() for f in s if not check(torch.as_tensor(s[f]),
                                                                            torch.as_tensor(optim_b["state"][k][f]))]
    assert not bad, f"optimizer state differs: {bad[:5]}"
    assert [g["lr"] for g in optim_a["param_groups"]] == [g["lr"] for g in optim_b["param_groups"]]


@pytest.fixture(scope="module")
def two_ranks(tiny_vlm_dir, tmp_path_factory):
    """A 1-rank checkpoint (and its state) made here, then the 2-rank torchrun job that reads it."""
    out = tmp_path_factory.mktemp("two_ranks")
    policy = load_policy(str(tiny_vlm_dir))
    rt = Runtime.single(policy.model)
    optimizer, scheduler = make_optimizer(policy.model, sft_stage().optim)
    sft_backward(policy, rt, sft_batch(policy), MICRO)
    clip_and_step(policy.model, optimizer, scheduler, 1.0)
    Checkpointer(out / "ckpt_1rank", CheckpointConfig(every=1), DistContext()).save(
        1, stage="sft", module=policy.model, optimizer=optimizer, scheduler=scheduler,
        cursor={"epoch": 0, "position": 8}, carry_over={})
    one_rank = full_state(policy.model, optimizer)
    run_checked(torchrun(2, str(REPO / "tests/train/dist_worker.py"), str(tiny_vlm_dir), str(out)))
    return out, one_rank


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_sft_gradient_on_2_ranks_equals_the_1_rank_big_batch_gradient(two_ranks, tiny_vlm_dir, strategy):
    out, _ = two_ranks
    policy = load_policy(str(tiny_vlm_dir))
    policy.model.train()
    loss, _ = sft_backward(policy, Runtime.single(policy.model), sft_batch(policy), MICRO)
    reference = grads_of(policy.model)
    distributed = torch.load(out / f"grads_sft_{strategy}.pt")
    assert distributed.keys() == reference.keys()
    assert any("visual" in k for k in reference)  # the vision tower is trained too
    for name, grad in reference.items():
        # same sums in another order: equal to float32 rounding; a per-rank normaliser or a missing
        # ×world-size correction would be off by ~10-100 %
        torch.testing.assert_close(distributed[name], grad, rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_checkpoint_saved_on_2_ranks_loads_on_1(two_ranks, tiny_vlm_dir, strategy):
    out, one_rank = two_ranks
    policy = load_policy(str(tiny_vlm_dir))
    optimizer, scheduler = make_optimizer(policy.model, sft_stage().optim)
    state = Checkpointer(out / "unused", CheckpointConfig(), DistContext()).load(
        out / f"ckpt_{strategy}" / "step_00000001", stage="sft", module=policy.model, optimizer=optimizer,
        scheduler=scheduler)
    assert state["world_size"] == 2 and len(state["rng"]) == 2  # one RNG state per rank
    saved = torch.load(out / f"state_{strategy}.pt", weights_only=False)
    assert_states_equal(full_state(policy.model, optimizer), saved)  # exactly what the 2 ranks held
    assert_states_equal(saved, one_rank, exact=False)  # and one 2-rank step ≈ one 1-rank step (same gradient)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_checkpoint_saved_on_1_rank_loads_on_2(two_ranks, strategy):
    out, one_rank = two_ranks
    assert_states_equal(torch.load(out / f"loaded_{strategy}.pt", weights_only=False), one_rank)


def test_fsdp_units_are_the_blocks_and_the_vision_tower(tiny_vlm):
    units = fsdp_units(tiny_vlm.model)
    names = [type(u).__name__ for u in units]
    assert names.count("Qwen2VLDecoderLayer") == 4 and names.count("Qwen2VLVisionBlock") == 2
    assert units[-1] is tiny_vlm.model.model.visual  # the tower last: its blocks are units first


def test_shard_and_normaliser():
    ctx = DistContext(rank=1, world_size=2)
    assert ctx.shard(list(range(6)), what="train.batch_size") == [3, 4, 5]
    assert ctx.local_normaliser(10) == 5.0  # N / W: DDP's mean over 2 ranks restores Σ / N
    with pytest.raises(ValueError, match="train.batch_size: 5 does not split evenly over 2 ranks"):
        ctx.shard(list(range(5)), what="train.batch_size")


def test_single_process_runtime_is_the_plain_loop():
    model = torch.nn.Linear(2, 2)
    rt = Runtime.single(model)
    assert rt.module is model and not rt.ctx.enabled
    assert rt.ctx.all_reduce_sum([1.5, 2]) == [1.5, 2.0] and rt.ctx.gather_objects("x") == ["x"]
    assert not rt.out_of_time(5.0, None) and rt.out_of_time(5.0, 4.0)
    assert DistConfig().strategy == "fsdp"
