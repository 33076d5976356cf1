"""2 gloo ranks (DDP and FSDP2) compute the gradient of one big batch; checkpoints move between world sizes.

One torchrun job (`dist_worker.py`, the session fixture ``two_ranks``) produces every 2-rank result; the tests
compare them with the same computation on 1 rank in this process.
"""

import pytest
import torch

from vlrl.algos import AGGREGATIONS, normaliser_for
from vlrl.config import CheckpointConfig, DistConfig
from vlrl.models import load_policy
from vlrl.train.checkpoint import Checkpointer
from vlrl.train.common import make_optimizer
from vlrl.train.distributed import DistContext, fsdp_units
from vlrl.train.runtime import Runtime
from vlrl.train.sft import sft_backward
from vlrl.train.update import accumulate, minibatch_cov_selection

from .dist_helpers import (
    MICRO,
    RL_LOSSES,
    full_state,
    grads_of,
    lora_policy,
    lora_steps,
    rl_loss_batch,
    rl_settings,
    rl_update_batch,
    sft_batch,
    sft_stage,
)


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


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_sft_gradient_on_2_ranks_equals_the_1_rank_big_batch_gradient(two_ranks, tiny_vlm_dir, strategy):
    out, _ = two_ranks
    policy = load_policy(str(tiny_vlm_dir))
    policy.model.train()
    sft_backward(policy, Runtime.single(policy.model), sft_batch(policy), MICRO)
    reference = grads_of(policy.model)
    distributed = torch.load(out / f"grads_sft_{strategy}.pt")
    assert distributed.keys() == reference.keys()
    assert any("visual" in k for k in reference)  # the vision tower is trained too
    for name, grad in reference.items():
        # same sums in another order: equal to float32 rounding; a per-rank normaliser or a missing
        # ×world-size correction would be off by ~10-100 %
        torch.testing.assert_close(distributed[name], grad, rtol=1e-4, atol=1e-7, msg=name)


@pytest.fixture(scope="module")
def rl_reference(two_ranks, tiny_vlm_dir):
    """1-rank gradients of the whole RL batch for each aggregation mode (micro-batches of 2: accumulation)."""
    out, _ = two_ranks
    policy = load_policy(str(tiny_vlm_dir))
    trajectories = torch.load(out / "trajectories.pt", weights_only=False)
    batch = rl_update_batch(policy, trajectories)
    policy.model.train()
    grads = {}
    for mode in AGGREGATIONS:
        policy.model.zero_grad(set_to_none=True)
        accumulate(policy, batch, range(len(trajectories)), rl_settings(mode),
                   normaliser=normaliser_for(mode, batch.loss_mask, max_length=8))  # L of *_norm
        grads[mode] = grads_of(policy.model)
    return batch, grads


@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_grpo_gradient_on_2_ranks_equals_the_1_rank_big_batch_gradient(two_ranks, rl_reference, strategy, mode):
    """8 responses of lengths 2..6 (rank 0: 2, 3, 4, 5; rank 1: 6, 2, 3, 4 tokens): token_mean divides by all 34
    tokens, the seq modes by all 8 sequences — a rank normalising by its own 14 or 20 tokens would be off."""
    out, _ = two_ranks
    batch, reference = rl_reference
    saved = torch.load(out / f"grads_rl_{strategy}_{mode}.pt")
    half = len(batch.trajectories) // 2
    assert torch.equal(saved["advantages"], batch.advantages[:half, : saved["advantages"].shape[1]])  # global GRPO
    assert saved["grads"].keys() == reference[mode].keys()
    for name, grad in reference[mode].items():
        torch.testing.assert_close(saved["grads"][name], grad, rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.parametrize("loss", sorted(RL_LOSSES))
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_new_losses_on_2_ranks_equal_the_1_rank_big_batch_gradient(two_ranks, tiny_vlm_dir, strategy, loss):
    """The issue-25 losses bound from config on the same 8 responses: the entropy from each rank's forward pass,
    and Clip-Cov / KL-Cov tokens chosen over both ranks' rows (gathered, one seeded selection) — the 1-rank
    gradient of the whole batch with the selection made over all 8 rows."""
    out, _ = two_ranks
    policy = load_policy(str(tiny_vlm_dir))
    trajectories = torch.load(out / "trajectories.pt", weights_only=False)
    settings, batch = rl_loss_batch(policy, trajectories, loss)
    rows = list(range(len(trajectories)))
    selection = minibatch_cov_selection(batch, rows, settings, generator=torch.Generator().manual_seed(0))
    policy.model.train()
    policy.model.zero_grad(set_to_none=True)
    accumulate(policy, batch, rows, settings, normaliser=normaliser_for(settings.loss_agg, batch.loss_mask),
               cov_selection=selection)
    reference = grads_of(policy.model)
    saved = torch.load(out / f"grads_loss_{strategy}_{loss}.pt")
    if loss in ("clip_cov", "kl_cov"):  # k = ⌊0.2 · 28⌋ = 5 over both ranks (Clip-Cov: fewer if fewer qualify)
        assert saved["selected"] == int(selection.sum()) >= 1
    for name, grad in reference.items():
        torch.testing.assert_close(saved["grads"][name], grad, rtol=1e-4, atol=1e-7, msg=f"{loss} {name}")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_checkpoint_saved_on_2_ranks_loads_on_1(two_ranks, tiny_vlm_dir, strategy):
    out, one_rank = two_ranks
    policy = load_policy(str(tiny_vlm_dir))
    optimizer, scheduler = make_optimizer(policy.model, sft_stage().optim)
    state = Checkpointer(out / "unused", CheckpointConfig(), DistContext()).load(
        out / f"ckpt_{strategy}" / "step_00000001", stage="sft", module=policy.model, optimizer=optimizer,
        scheduler=scheduler)
    assert state["world_size"] == 2 and len(state["rng"]) == 2  # one RNG state per rank
    assert state["carry_over"] == {"rank": 0}  # rank 0's own loop state
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


def test_features_that_run_in_one_process_are_refused_under_several_ranks_naming_the_field():
    from vlrl.config import RLConfig, load_config
    from vlrl.train.distributed import check_scalable

    cfg = load_config(RLConfig, None, ["synth.enabled=true"])
    check_scalable(cfg, 1)  # one process: fine
    check_scalable(cfg, 2)  # Syn-GRPO: rank 0's synthesis client, swaps broadcast (tests/train/test_syn_grpo_ranks.py)
    with pytest.raises(ValueError, match="rollout.mode=async"):  # Syn-GRPO: no step boundary the async ranks share
        check_scalable(load_config(RLConfig, None, ["synth.enabled=true", "rollout.mode=async"]), 2)
    check_scalable(load_config(RLConfig, None, ["algo.advantage=gae", "checkpoint.every=2"]), 2)  # the critic is wrapped
    check_scalable(load_config(RLConfig, None, ["algo.dynamic_sampling.enabled=true", "checkpoint.every=2"]), 1)
    check_scalable(load_config(RLConfig, None, ["algo.dynamic_sampling.enabled=true"]), 2)  # gathered filter
    servers = ["rollout.servers.urls=[http://127.0.0.1:30000]"]
    check_scalable(load_config(RLConfig, None, servers), 2)  # every rank generates on them, rank 0 updates them
    check_scalable(load_config(RLConfig, None, [*servers, "rollout.mode=async"]), 2)  # rank 0 drives the rollout
    check_scalable(load_config(RLConfig, None, ["synth.enabled=true", "checkpoint.every=2"]), 1)  # SynthState resumes
    check_scalable(load_config(RLConfig, None, ["synth.enabled=true", "rollout.mode=async", "checkpoint.every=2"]), 1)
    check_scalable(load_config(RLConfig, None, ["model.lora.r=4"]), 2)  # FSDP2 (tests/train/test_lora_fsdp.py)
    check_scalable(load_config(RLConfig, None, ["model.lora.r=4", "dist.strategy=ddp"]), 2)


@pytest.mark.parametrize("recipe", ["sft", "rl"])
def test_gradient_checkpointing_under_fsdp2_gives_the_same_gradients(two_ranks, recipe):
    """2 gloo ranks, FSDP2: with train.gradient_checkpointing the decoder and vision blocks recompute their
    activations in backward inside FSDP2's all-gathers; every gradient equals the one without (fp32, atol 1e-6)."""
    out, _ = two_ranks
    plain = torch.load(out / (f"grads_{recipe}_fsdp.pt" if recipe == "sft" else "grads_rl_fsdp_token_mean.pt"))
    plain = plain if recipe == "sft" else plain["grads"]
    checkpointed = torch.load(out / f"grads_{recipe}_fsdp_checkpointed.pt")
    assert checkpointed.keys() == plain.keys() and any("visual.blocks" in k for k in plain)
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=0, atol=1e-6, msg=name)


def test_lora_under_ddp_on_2_ranks_equals_1_rank(two_ranks, tiny_vlm_dir):
    """model.lora on 2 gloo ranks (DDP): the adapters' gradients of the whole batch (a KL term to the adapter-free
    base included) equal the 1-rank gradients, the base gets none, and after 2 AdamW steps the adapters equal the
    1-rank adapters (tolerance as `assert_states_equal`'s: 1 % of a 1e-3 step) and each other exactly."""
    out, _ = two_ranks
    saved = torch.load(out / "lora_ddp.pt")
    policy = lora_policy(tiny_vlm_dir)
    grads, adapters = lora_steps(policy, torch.load(out / "trajectories.pt", weights_only=False), policy.model)
    assert saved["grads"].keys() == grads.keys() and all(".lora_" in k for k in grads)
    assert any(".lora_A." in k and grads[k].abs().sum() > 0 for k in grads)  # B ≠ 0: A's gradients are not 0
    for name, grad in grads.items():
        torch.testing.assert_close(saved["grads"][name], grad, rtol=1e-4, atol=1e-7, msg=name)
    assert saved["ranks_equal"]
    for name, weight in adapters.items():
        torch.testing.assert_close(saved["adapters"][name], weight, rtol=1e-3, atol=1e-5, msg=name)
    assert any(not torch.equal(weight, lora_policy(tiny_vlm_dir).model.get_parameter(name)) for name, weight in
               adapters.items())  # they trained


def test_lora_rl_run_on_2_ranks_exports_merged_weights_and_adapters(two_ranks):
    """`vlrl rl` with model.lora under torchrun (2 ranks, DDP, kl_coef 0.05): the KL to the adapter-free base is
    logged, and checkpoints/final holds the merged model and adapter/ with the configured rank."""
    import json

    out, _ = two_ranks
    run = out / "lora_rl"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("stage") == "rl" and "policy/kl_ref" in r]
    assert [r["step"] for r in steps] == [1, 2] and steps[-1]["policy/trainable_params"] < 0.2 * 1.06e6
    final = run / "checkpoints" / "final"
    assert json.loads((final / "adapter" / "adapter_config.json").read_text())["r"] == 4
    from safetensors.torch import load_file

    merged = load_file(final / "model.safetensors")
    assert merged and not any(".lora_" in k or "base_layer" in k for k in merged)  # plain transformers names


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_token_budget_on_2_ranks_gives_the_count_based_loss_and_gradient(two_ranks, strategy):
    """train.max_tokens_per_micro_batch on 2 gloo ranks, a long tail (rank 0 holds a 200-token response among
    2–6-token ones): at budgets 1 (every row alone) and 100 (the long row alone), padded and packed, token- and
    sequence-mean,
    the loss and gradient equal the count-based split's of the same batch (fp32, 1e-6) — the rows rebalanced over
    the ranks (imbalance below the count-based split's), every row run once, both ranks the same number of
    micro-batches (FSDP2 would hang otherwise), and a rank short of rows running no-op micro-batches."""
    out, _ = two_ranks
    results = torch.load(out / f"budget_{strategy}.pt", weights_only=False)
    noops = 0
    for (mode, padding_free, budget), got in results.items():
        if budget is None:
            continue
        count = results[(mode, padding_free, None)]
        assert got["loss"] == pytest.approx(count["loss"], rel=1e-6, abs=1e-7), (mode, padding_free, budget)
        assert got["grads"].keys() == count["grads"].keys()
        for name, grad in count["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=0, atol=1e-6, msg=f"{mode} {budget} {name}")
        assert len(got["split"][0]) == len(got["split"][1])  # lockstep
        rows = sorted(r for split in got["split"] for micro in split if micro is not None for r in micro)
        assert rows == list(range(8))
        noops += sum(micro is None for split in got["split"] for micro in split)
        assert got["metrics"]["perf/rank_imbalance"] < count["metrics"]["perf/rank_imbalance"]
    assert noops > 0  # budget 100: the long row alone on one rank, three micro-batches on the other


def test_token_budget_through_the_recipes_on_2_ranks(two_ranks):
    """`vlrl rl` and `vlrl sft` with train.max_tokens_per_micro_batch on 2 ranks (FSDP2): the split's own signature in
    metrics.jsonl — more micro-batches, each within the budget, perf/rank_imbalance at most the count-based run's (the
    same first batch: same data and seed) and ≤ 1.1 — and the second step's loss equal to the count-based run's (the
    first update was the same)."""
    import json

    out, _ = two_ranks

    def at(run, stage, step):
        records = [json.loads(line) for line in (out / run / "metrics.jsonl").read_text().splitlines()]
        return next(r for r in records if r.get("stage") == stage and r.get("step") == step)

    for recipe, budget, loss in (("rl", 200, "policy/loss"), ("sft", 150, "sft/loss")):
        got, count = at(f"budget_{recipe}", recipe, 1), at(f"reference_{recipe}", recipe, 1)
        assert got["perf/micro_batch_cost_max"] <= budget < count["perf/micro_batch_cost_max"], recipe
        assert got["perf/micro_batches"] > count["perf/micro_batches"], recipe
        assert got["perf/rank_imbalance"] <= min(count["perf/rank_imbalance"], 1.1), recipe
        second, second_count = at(f"budget_{recipe}", recipe, 2)[loss], at(f"reference_{recipe}", recipe, 2)[loss]
        assert abs(second) > 1e-4 and second == pytest.approx(second_count, rel=1e-3), recipe
