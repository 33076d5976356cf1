"""The 2-rank side of tests/train/test_distributed.py and test_resume.py, run once under torchrun (gloo on
loopback) so that the ranks' start-up (imports, process group) is paid once:

    torchrun --standalone --nproc_per_node 2 tests/train/dist_worker.py MODEL_DIR OUT_DIR

Writes into OUT_DIR (rank 0 writes files):
    grads_sft_{ddp,fsdp}.pt            the full gradient after one accumulated backward over this rank's half of
                                       `dist_helpers.sft_batch`
    grads_rl_{ddp,fsdp}_{mode}.pt      the same for the RL update (`accumulate`) on half of OUT_DIR/trajectories.pt,
                                       for each loss aggregation mode
    grads_loss_{ddp,fsdp}_{loss}.pt    the same for each issue-25 loss (`dist_helpers.RL_LOSSES`), Clip-Cov / KL-Cov
                                       tokens selected over both ranks' rows (`minibatch_cov_selection`)


    grads_{sft,rl}_fsdp_checkpointed.pt  the FSDP2 SFT and RL (token_mean) gradients with gradient checkpointing on
    ckpt_{ddp,fsdp}/, state_*.pt       a checkpoint after one SFT step on 2 ranks, and the full state it holds
    loaded_{ddp,fsdp}.pt               the full state after loading OUT_DIR/ckpt_1rank/step_00000001 on 2 ranks
    reference_{sft,rl}/                uninterrupted 2-rank runs of `vlrl sft|rl` with `dist_helpers.run_args`
    lora_ddp.pt                        model.lora under DDP: `dist_helpers.lora_steps` on this rank's half of
                                       OUT_DIR/trajectories.pt (first gradients, adapters after 2 steps), and
                                       whether the two ranks' adapters are equal
    lora_rl/                           a 2-rank `vlrl rl` run (DDP) with model.lora and a KL term
    budget_{ddp,fsdp}.pt               train.max_tokens_per_micro_batch: gradients, splits and losses by budget and the
                                       count-based ones of the same long-tail batch (`budget_gradients`)
    budget_rl/, budget_sft/            2-rank `vlrl rl|sft` runs (FSDP2) with train.max_tokens_per_micro_batch
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dist_helpers import (  # noqa: E402
    MICRO,
    RL_LOSSES,
    full_state,
    grads_of,
    lora_policy,
    lora_steps,
    rl_loss_batch,
    rl_settings,
    rl_update_batch,
    run_args,
    sft_batch,
    sft_stage,
)

from vlrl.algos import AGGREGATIONS, normaliser_for  # noqa: E402
from vlrl.config import CheckpointConfig, DistConfig, RLConfig, SFTConfig, load_config  # noqa: E402
from vlrl.models import load_policy  # noqa: E402
from vlrl.train.checkpoint import Checkpointer  # noqa: E402
from vlrl.train.common import clip_and_step, make_optimizer  # noqa: E402
from vlrl.train.distributed import init_distributed, shutdown_distributed, wrap_model  # noqa: E402
from vlrl.train.modules import gradient_checkpointing  # noqa: E402
from vlrl.train.recipes import run_rl, run_sft  # noqa: E402
from vlrl.train.runtime import Runtime  # noqa: E402
from vlrl.train.sft import sft_backward  # noqa: E402
from vlrl.train.update import accumulate, minibatch_cov_selection  # noqa: E402


def runtime(model_dir: str, strategy: str):
    cfg = DistConfig(strategy=strategy)
    ctx = init_distributed(cfg)
    policy = load_policy(model_dir)
    rt = Runtime(ctx, wrap_model(policy.model, ctx, cfg), cfg)
    rt.module.train()
    return policy, rt


def sft_gradients(model_dir: str, out: Path, strategy: str) -> None:
    policy, rt = runtime(model_dir, strategy)
    sft_backward(policy, rt, rt.ctx.shard(sft_batch(policy), what="batch"), MICRO)
    grads = grads_of(rt.module)
    if rt.ctx.is_main:
        torch.save(grads, out / f"grads_sft_{strategy}.pt")


def rl_gradients(model_dir: str, out: Path, strategy: str) -> None:
    policy, rt = runtime(model_dir, strategy)
    trajectories = rt.ctx.shard(torch.load(out / "trajectories.pt", weights_only=False), what="trajectories")
    batch = rl_update_batch(policy, trajectories, rt)  # GRPO advantages over both ranks' responses
    for mode in AGGREGATIONS:
        rt.module.zero_grad(set_to_none=True)
        normaliser = rt.global_normaliser(normaliser_for(mode, batch.loss_mask, max_length=8))  # L of *_norm
        accumulate(policy, batch, range(len(trajectories)), rl_settings(mode), normaliser=normaliser, runtime=rt)
        grads = grads_of(rt.module)
        if rt.ctx.is_main:
            torch.save({"grads": grads, "advantages": batch.advantages}, out / f"grads_rl_{strategy}_{mode}.pt")


def loss_gradients(model_dir: str, out: Path, strategy: str) -> None:
    policy, rt = runtime(model_dir, strategy)
    trajectories = rt.ctx.shard(torch.load(out / "trajectories.pt", weights_only=False), what="trajectories")
    rows = list(range(len(trajectories)))
    for loss in RL_LOSSES:
        settings, batch = rl_loss_batch(policy, trajectories, loss, first_row=rt.ctx.rank * len(rows), runtime=rt)
        selection = minibatch_cov_selection(batch, rows, settings, generator=torch.Generator().manual_seed(0), runtime=rt)
        rt.module.zero_grad(set_to_none=True)
        normaliser = rt.global_normaliser(normaliser_for(settings.loss_agg, batch.loss_mask))
        accumulate(policy, batch, rows, settings, normaliser=normaliser, runtime=rt, cov_selection=selection)
        grads = grads_of(rt.module)
        selected = rt.ctx.all_reduce_sum([float(selection.sum()) if selection is not None else 0.0])[0]  # both ranks
        if rt.ctx.is_main:
            torch.save({"grads": grads, "selected": int(selected)},
                       out / f"grads_loss_{strategy}_{loss}.pt")


BUDGETS = (1, 100)  # every row alone; the long row alone on one rank, micro-batches of ~1 short row on the other


def budget_gradients(model_dir: str, out: Path, strategy: str) -> None:
    """train.max_tokens_per_micro_batch on 2 ranks (`minibatches`: rows rebalanced over the ranks and sent where they
    run, micro-batches by cost, as many on each rank — no-op ones where a rank has fewer rows): the first minibatch's
    gradient and split per (aggregation, padding_free, budget), and the count-based gradient of the same batch —
    rank 0's responses with row 0's made 200 tokens long (a long tail)."""
    import dataclasses

    from vlrl.train.update import minibatches

    policy, rt = runtime(model_dir, strategy)
    trajectories = rt.ctx.shard(torch.load(out / "trajectories.pt", weights_only=False), what="trajectories")
    if rt.ctx.rank == 0:
        t = trajectories[0]
        t.response_ids = t.response_ids.repeat(100)[:200]
        t.loss_mask, t.behaviour_logp = torch.ones(200, dtype=torch.long), torch.full((200,), -1.0)
    batch = rl_update_batch(policy, trajectories, rt)
    results = {}
    for mode in ("token_mean", "seq_mean_token_mean"):
        for padding_free in (False, True):
            for budget in (None, *BUDGETS):
                settings = dataclasses.replace(rl_settings(mode), padding_free=padding_free,
                                               max_tokens_per_micro_batch=budget)
                rt.module.zero_grad(set_to_none=True)
                mb = next(minibatches(policy, batch, settings, rt, seed=0, step=0))
                stats = accumulate(policy, mb.batch, [], settings, normaliser=mb.normaliser, runtime=rt,
                                   micro_batches=mb.micro_batches)
                grads = grads_of(rt.module)
                split = rt.ctx.gather_objects([list(m.rows) if not m.noop else None for m in mb.micro_batches])
                loss = rt.ctx.all_reduce_sum(stats.values["policy/loss"])[0] / 2  # the minibatch's loss
                results[(mode, padding_free, budget)] = {"grads": grads, "split": split, "metrics": mb.metrics,
                                                         "loss": loss}
    if rt.ctx.is_main:
        torch.save(results, out / f"budget_{strategy}.pt")


def checkpointed_gradients(model_dir: str, out: Path) -> None:
    """`sft_gradients` and `rl_gradients` (token_mean) under FSDP2 with train.gradient_checkpointing on."""
    policy, rt = runtime(model_dir, "fsdp")
    with gradient_checkpointing(policy.model, True):
        sft_backward(policy, rt, rt.ctx.shard(sft_batch(policy), what="batch"), MICRO)
        sft = grads_of(rt.module)
        rt.module.zero_grad(set_to_none=True)
        trajectories = rt.ctx.shard(torch.load(out / "trajectories.pt", weights_only=False), what="trajectories")
        batch = rl_update_batch(policy, trajectories, rt)
        normaliser = rt.global_normaliser(normaliser_for("token_mean", batch.loss_mask, max_length=8))
        accumulate(policy, batch, range(len(trajectories)), rl_settings("token_mean"), normaliser=normaliser, runtime=rt)
        rl = grads_of(rt.module)
    if rt.ctx.is_main:
        torch.save(sft, out / "grads_sft_fsdp_checkpointed.pt")
        torch.save(rl, out / "grads_rl_fsdp_checkpointed.pt")


def checkpoints(model_dir: str, out: Path, strategy: str) -> None:
    # one SFT step on 2 ranks, checkpointed
    policy, rt = runtime(model_dir, strategy)
    optimizer, scheduler = make_optimizer(rt.module, sft_stage().optim)
    sft_backward(policy, rt, rt.ctx.shard(sft_batch(policy), what="batch"), MICRO)
    clip_and_step(rt.module, optimizer, scheduler, 1.0)
    Checkpointer(out / f"ckpt_{strategy}", CheckpointConfig(every=1), rt.ctx).save(
        1, stage="sft", module=rt.module, optimizer=optimizer, scheduler=scheduler,
        cursor={"epoch": 0, "position": 8}, carry_over={"rank": rt.ctx.rank})
    state = full_state(rt.module, optimizer)
    if rt.ctx.is_main:
        torch.save(state, out / f"state_{strategy}.pt")
    # the 1-rank checkpoint loaded on 2 ranks
    policy, rt = runtime(model_dir, strategy)
    optimizer, scheduler = make_optimizer(rt.module, sft_stage().optim)
    Checkpointer(out / "unused", CheckpointConfig(), rt.ctx).load(
        out / "ckpt_1rank" / "step_00000001", stage="sft", module=rt.module, optimizer=optimizer, scheduler=scheduler)
    state = full_state(rt.module, optimizer)
    if rt.ctx.is_main:
        torch.save(state, out / f"loaded_{strategy}.pt")


def lora_ddp(model_dir: str, out: Path) -> None:
    policy = lora_policy(model_dir)
    cfg = DistConfig(strategy="ddp")
    ctx = init_distributed(cfg)
    rt = Runtime(ctx, wrap_model(policy.model, ctx, cfg), cfg)
    trajectories = rt.ctx.shard(torch.load(out / "trajectories.pt", weights_only=False), what="trajectories")
    grads, adapters = lora_steps(policy, trajectories, rt.module, rt)
    everyone = rt.ctx.gather_objects(adapters)
    if rt.ctx.is_main:
        same = all(torch.equal(everyone[0][k], everyone[1][k]) for k in adapters)
        torch.save({"grads": grads, "adapters": adapters, "ranks_equal": same}, out / "lora_ddp.pt")


def main(model_dir: str, out: str) -> None:
    out_dir = Path(out)
    ctx = init_distributed(DistConfig())
    for strategy in ("ddp", "fsdp"):
        sft_gradients(model_dir, out_dir, strategy)
        rl_gradients(model_dir, out_dir, strategy)
        loss_gradients(model_dir, out_dir, strategy)
        budget_gradients(model_dir, out_dir, strategy)
        checkpoints(model_dir, out_dir, strategy)
    checkpointed_gradients(model_dir, out_dir)
    lora_ddp(model_dir, out_dir)
    # the uninterrupted 2-rank runs test_resume.py compares its killed-and-resumed runs with (what `vlrl sft|rl
    # ARGS` runs: load_config + the recipe, here in the process group this script joined)
    run_sft(load_config(SFTConfig, None, [*run_args("sft", model_dir, None, nproc=2), f"out={out_dir / 'reference_sft'}"]))
    data = out_dir / "rl_data" / "train.jsonl"
    run_rl(load_config(RLConfig, None, [*run_args("rl", model_dir, data, nproc=2), f"out={out_dir / 'reference_rl'}"]))
    run_rl(load_config(RLConfig, None, [*run_args("rl", model_dir, data, nproc=2), "model.lora.r=4",
                                        "train.steps=2", f"out={out_dir / 'lora_rl'}"]))
    # the token budget through the recipes, FSDP2 (lockstep), the same data and seed as reference_{rl,sft}
    run_rl(load_config(RLConfig, None, [*run_args("rl", model_dir, data, nproc=2), "dist.strategy=fsdp",
                                        "train.max_tokens_per_micro_batch=200", "train.steps=2", "checkpoint.every=0",
                                        f"out={out_dir / 'budget_rl'}"]))
    run_sft(load_config(SFTConfig, None, [*run_args("sft", model_dir, None, nproc=2), "train.max_tokens_per_micro_batch=150",
                                          "train.steps=2", "checkpoint.every=0", f"out={out_dir / 'budget_sft'}"]))
    shutdown_distributed(ctx)


if __name__ == "__main__":
    main(*sys.argv[1:3])
