"""train.gradient_checkpointing (`vlrl.train.modules.gradient_checkpointing`): transformers' activation
checkpointing on the decoder and vision blocks gives the loss and every gradient of the plain pass (fp32,
atol 1e-6) — SFT padded and packed, the GRPO update — and `vlrl rl` logs it on. (2 gloo ranks under FSDP2:
tests/train/test_distributed.py.)"""

import json

import pytest
import torch

from vlrl.train.modules import checkpointed_blocks, checkpointing_wanted, gradient_checkpointing
from vlrl.train.runtime import Runtime
from vlrl.train.sft import sft_backward
from vlrl.train.update import accumulate

from .dist_helpers import rl_settings, rl_trajectories, rl_update_batch, sft_batch


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def assert_same(plain: dict, checkpointed: dict) -> None:
    assert plain.keys() == checkpointed.keys() and any("visual.blocks" in k for k in plain)
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=0, atol=1e-6, msg=name)


def test_the_decoder_and_vision_blocks_are_checkpointed_and_restored(tiny_vlm):
    with gradient_checkpointing(tiny_vlm.model, True) as on:
        blocks = checkpointed_blocks(tiny_vlm.model)
    assert on
    # tiny-qwen2-vl: 4 decoder layers and 2 vision blocks (every GradientCheckpointingLayer)
    assert {b for b in blocks if ".layers." in b} == {f"model.language_model.layers.{k}" for k in range(4)}
    assert {b for b in blocks if ".blocks." in b} == {f"model.visual.blocks.{k}" for k in range(2)}
    assert checkpointed_blocks(tiny_vlm.model) == []  # off again after the block
    with gradient_checkpointing(tiny_vlm.model, "auto") as on:  # 1M parameters: auto is off
        assert not on and checkpointed_blocks(tiny_vlm.model) == []
    assert not checkpointing_wanted(tiny_vlm.model, "auto") and checkpointing_wanted(tiny_vlm.model, True)


@pytest.mark.parametrize("packed", [False, True])
def test_sft_loss_and_gradients_equal_without_checkpointing(tiny_vlm, packed):
    policy = tiny_vlm
    policy.model.train()
    batch = sft_batch(policy)
    loss, _, _ = sft_backward(policy, Runtime.single(policy.model), batch, 3, packed=packed)
    plain = grads(policy.model)
    with gradient_checkpointing(policy.model, True):
        loss_ckpt, _, _ = sft_backward(policy, Runtime.single(policy.model), batch, 3, packed=packed)
    assert abs(loss - loss_ckpt) <= 1e-6
    assert_same(plain, grads(policy.model))


def test_grpo_update_gradients_equal_without_checkpointing(tiny_vlm):
    policy = tiny_vlm
    batch = rl_update_batch(policy, rl_trajectories(policy))
    policy.model.train()
    rows = range(len(batch.trajectories))
    stats = accumulate(policy, batch, rows, rl_settings("token_mean"), normaliser=float(batch.loss_mask.sum()))
    plain = grads(policy.model)
    with gradient_checkpointing(policy.model, True):
        stats_ckpt = accumulate(policy, batch, rows, rl_settings("token_mean"), normaliser=float(batch.loss_mask.sum()))
    for a, b in zip(stats.values["policy/loss"], stats_ckpt.values["policy/loss"], strict=True):
        assert abs(a - b) <= 1e-6
    assert_same(plain, grads(policy.model))


@pytest.mark.parametrize("recipe", ["sft", "rl"])
def test_cli_runs_log_checkpointing_on_with_the_plain_runs_numbers(tiny_vlm_dir, tmp_path, recipe):
    """`vlrl sft|rl train.gradient_checkpointing=true`: the run says it is on, and its first step's loss and
    gradient norm are the plain run's (the same sampled batch: the weights are equal before step 1)."""
    from vlrl.config import RLConfig, SFTConfig, load_config
    from vlrl.recipes import run_rl, run_sft

    common = [f"model.path={tiny_vlm_dir}", "train.steps=1", "data.n_train=8", "data.n_test=2", "eval.samples=1",
              "eval.max_new_tokens=2", "report.html=false", "check.enabled=false"]
    if recipe == "sft":
        args, run, cls, keys = [*common, "train.batch_size=4", "train.micro_batch_size=2"], run_sft, SFTConfig, \
            ("sft/loss", "sft/grad_norm")
    else:
        args, run, cls, keys = [*common, "train.prompts_per_step=2", "rollout.n=4", "rollout.max_new_tokens=6"], \
            run_rl, RLConfig, ("policy/loss", "policy/grad_norm", "policy/entropy")
    logged = {}
    for on in (False, True):
        out = tmp_path / str(on)
        run(load_config(cls, None, [*args, f"train.gradient_checkpointing={str(on).lower()}", f"out={out}"]))
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        logged[on] = next(r for r in records if r["stage"] == recipe and r["step"] == 1)
    assert logged[True]["perf/gradient_checkpointing"] == 1.0 and logged[False]["perf/gradient_checkpointing"] == 0.0
    for key in keys:
        assert abs(logged[True][key] - logged[False][key]) <= 1e-6, key
