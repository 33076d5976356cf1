"""``train.trainable`` in RL (frozen parameters bit-identical after `vlrl rl`, and without optimizer state) and
``model.dtype=bfloat16`` (a few CPU steps stay finite and close to fp32; what stays fp32 is stated in config)."""

import json
import math

import torch

from vlrl.config import LoraConfig, RLConfig, SFTConfig, load_config
from vlrl.models import load_policy
from vlrl.models.lora import apply_lora
from vlrl.recipes import run_rl, run_sft

TINY_RL = ["train.prompts_per_step=2", "rollout.n=4", "rollout.max_new_tokens=6", "data.n_train=8", "data.n_test=2",
           "eval.samples=1", "eval.max_new_tokens=2", "report.html=false", "check.enabled=false", "train.log_every=1",
           "optim.lr=1e-2", "optim.weight_decay=0.1"]


def test_rl_trainable_llm_leaves_vision_tower_and_projector_bit_identical_without_optimizer_state(tiny_vlm_dir, tmp_path):
    import torch.distributed.checkpoint as dcp

    out = tmp_path / "run"
    run_rl(load_config(RLConfig, None, [f"model.path={tiny_vlm_dir}", *TINY_RL, "train.steps=2", "train.trainable=[llm]",
                                        "checkpoint.every=2", f"out={out}"]))
    before = load_policy(str(tiny_vlm_dir)).model.state_dict()
    after = load_policy(str(out / "checkpoints" / "final")).model.state_dict()
    frozen = [k for k in before if k.startswith("model.visual.")]
    trained = [k for k in before if k.startswith("model.language_model.layers.")]
    assert frozen and all(torch.equal(before[k], after[k]) for k in frozen)  # weight decay 0.1 would move them
    assert any(not torch.equal(before[k], after[k]) for k in trained)
    saved = dcp.FileSystemReader(str(out / "checkpoints" / "step_00000002" / "dcp")).read_metadata().state_dict_metadata
    moments = {k for k in saved if k.startswith("optim.state.")}
    assert not any(".visual." in k for k in moments)  # no AdamW moments for frozen parameters
    assert any(".language_model." in k and k.endswith("exp_avg") for k in moments)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r["stage"] == "rl"]
    llm = sum(p.numel() for n, p in load_policy(str(tiny_vlm_dir)).model.named_parameters()
              if n.startswith(("model.language_model.", "lm_head.")))  # the llm group of Qwen2-VL
    assert rl[-1]["policy/trainable_params"] == llm


def test_bf16_sft_steps_stay_finite_and_close_to_fp32(tiny_vlm_dir, tmp_path):
    """model.dtype=bfloat16: weights, gradients and AdamW moments in bf16 (log-softmax in fp32). 4 SFT steps from
    the same weights: every loss finite and within 2 % of the fp32 run's (bf16 keeps 8 bits of mantissa: ~0.4 %
    per rounding; measured here ≲ 0.5 %)."""
    losses = {}
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / dtype
        run_sft(load_config(SFTConfig, None, [f"model.path={tiny_vlm_dir}", f"model.dtype={dtype}", "train.steps=4",
                                              "train.batch_size=8", "train.micro_batch_size=8", "data.n_train=32",
                                              "data.n_test=2", "eval.samples=1", "eval.max_new_tokens=2", "train.log_every=1",
                                              "report.html=false", "check.enabled=false", f"out={out}"]))
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses[dtype] = [r["sft/loss"] for r in records if r["stage"] == "sft"]
    assert len(losses["bfloat16"]) == 4 and all(math.isfinite(x) for x in losses["bfloat16"])
    for a, b in zip(losses["float32"], losses["bfloat16"], strict=True):
        assert abs(a - b) <= 0.02 * a, (losses["float32"], losses["bfloat16"])
    assert losses["bfloat16"][-1] < losses["bfloat16"][0]  # it learns


def test_lora_on_a_bf16_base_keeps_adapters_in_fp32(tiny_vlm_dir):
    policy = apply_lora(load_policy(str(tiny_vlm_dir), dtype="bfloat16"), LoraConfig(r=4))
    dtypes = {n: p.dtype for n, p in policy.model.named_parameters()}
    assert all(d == torch.float32 for n, d in dtypes.items() if ".lora_" in n)
    assert all(d == torch.bfloat16 for n, d in dtypes.items() if ".lora_" not in n)
