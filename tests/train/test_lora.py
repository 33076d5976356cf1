"""LoRA through peft (`vlrl.models.lora`, ``model.lora``): only the adapters train, the KL reference is the base
with the adapters disabled (exactly the base model's log-probs), the export is a merged model plain transformers
loads (same logits as base + adapters) plus the adapter directory, and a resumed run continues exactly."""

import json

import pytest
import torch

from vlrl.config import ConfigError, LoraConfig, RLConfig, SFTConfig, load_config
from vlrl.models import load_policy
from vlrl.models.forward import score
from vlrl.models.lora import AdaptersOff, apply_lora, lora_parameter_names, merged_state_dict
from vlrl.recipes import run_rl, run_sft
from vlrl.train.batch import reference_model

from .dist_helpers import rl_trajectories, write_rl_data

RL_ARGS = ["train.prompts_per_step=2", "rollout.n=4", "rollout.max_new_tokens=6",
           "eval.samples=1", "eval.max_new_tokens=2", "report.html=false", "check.enabled=false", "train.log_every=1",
           "model.lora.r=4", "model.lora.alpha=8", "algo.kl_coef=0.05", "optim.lr=1e-2"]


@pytest.fixture
def dense_reward(tmp_path):
    """Prompts scored by DAPO's soft overlong punishment (dense: a random model's groups get non-zero advantages)."""
    data = write_rl_data(tmp_path / "data" / "train.jsonl")
    return [f"data.train={data}", f"data.test={data}"]


def lora_policy(path, **options):
    policy = apply_lora(load_policy(str(path)), LoraConfig(**options))
    with torch.no_grad():  # peft starts B at 0 (ΔW = 0): give the adapters a non-zero update
        g = torch.Generator().manual_seed(0)
        for name, p in policy.model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return policy


def test_only_adapters_require_grad_and_the_base_is_untouched(tiny_vlm_dir):
    base = load_policy(str(tiny_vlm_dir)).model.state_dict()
    policy = apply_lora(load_policy(str(tiny_vlm_dir)), LoraConfig(r=4, modules_to_save=["lm_head"]))
    trainable = {n for n, p in policy.model.named_parameters() if p.requires_grad}
    assert trainable == set(lora_parameter_names(policy.model)) and trainable
    assert "lm_head.modules_to_save.default.weight" in trainable
    assert not any("visual" in n for n in trainable)  # q_proj … down_proj: the language model only
    assert merged_state_dict(policy).keys() == base.keys()  # plain transformers names
    for key, value in merged_state_dict(policy).items():  # B = 0 at the start: merged = base, bit for bit
        assert torch.equal(value, base[key]), key


def test_reference_with_adapters_disabled_is_exactly_the_base_model(tiny_vlm_dir):
    policy = lora_policy(tiny_vlm_dir, r=4, modules_to_save=["lm_head"])
    trajectories = rl_trajectories(load_policy(str(tiny_vlm_dir)))
    reference = reference_model(policy)
    assert isinstance(reference, AdaptersOff)
    assert {id(p) for p in reference.parameters()} <= {id(p) for p in policy.model.parameters()}  # no second copy
    base = load_policy(str(tiny_vlm_dir))
    expected = score(base.model, base, trajectories, 1.0)
    assert torch.equal(score(reference, policy, trajectories, 1.0), expected)
    adapted = score(policy.model, policy, trajectories, 1.0)
    assert (adapted - expected).abs().max() > 1e-3  # the adapters are on outside the reference


def test_merged_weights_are_peft_merge_and_unload(tiny_vlm_dir):
    import copy

    policy = lora_policy(tiny_vlm_dir, r=4, modules_to_save=["lm_head"])
    with torch.no_grad():
        policy.model.lm_head.modules_to_save["default"].weight.add_(0.01)
    expected = copy.deepcopy(policy.lora).merge_and_unload().state_dict()
    merged = merged_state_dict(policy)
    assert merged.keys() == expected.keys()
    for key in merged:
        torch.testing.assert_close(merged[key], expected[key], rtol=0, atol=1e-7, msg=key)


def test_lora_rl_run_exports_merged_model_and_adapter_and_trains_only_adapters(tiny_vlm_dir, tmp_path, dense_reward):
    """`vlrl rl` with model.lora: checkpoints/final is a model plain transformers loads, with the logits of the
    base + the exported adapter; every weight outside the adapted projections is the base's, bit for bit."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    out = tmp_path / "run"
    run_rl(load_config(RLConfig, None, [f"model.path={tiny_vlm_dir}", *RL_ARGS, *dense_reward, "train.steps=2",
                                        f"out={out}"]))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r["stage"] == "rl"]
    assert all("policy/kl_ref" in r for r in rl)  # the KL to the adapter-free base is in the loss
    assert 0 < rl[-1]["policy/trainable_params"] < 0.2 * 1.06e6  # r = 4 adapters: a few % of 1.06M
    final = out / "checkpoints" / "final"
    merged = AutoModelForImageTextToText.from_pretrained(final).eval()
    base = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir).eval()
    adapted = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir), final / "adapter").eval()
    base_sd, merged_sd = base.state_dict(), merged.state_dict()
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    changed = [k for k in base_sd if not torch.equal(base_sd[k], merged_sd[k])]
    assert changed and all(k.split(".")[-2] in targets for k in changed)  # only adapted projections moved
    ids = torch.tensor([[1, 5, 9, 13, 2, 7]])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, rtol=0, atol=1e-5)
        assert (merged(input_ids=ids).logits - base(input_ids=ids).logits).abs().max() > 1e-4


def test_lora_rl_resumes_exactly(tiny_vlm_dir, tmp_path, dense_reward):
    """3 steps straight vs 2 steps, stop, `checkpoint.resume=auto` to 3: the same step-3 numbers and weights."""
    common = [f"model.path={tiny_vlm_dir}", *RL_ARGS, *dense_reward, "checkpoint.every=1"]
    run_rl(load_config(RLConfig, None, [*common, "train.steps=3", f"out={tmp_path / 'straight'}"]))
    run_rl(load_config(RLConfig, None, [*common, "train.steps=2", f"out={tmp_path / 'resumed'}"]))
    run_rl(load_config(RLConfig, None, [*common, "train.steps=3", "checkpoint.resume=auto", f"out={tmp_path / 'resumed'}"]))

    def step3(run):
        records = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return next(r for r in records if r["stage"] == "rl" and r["step"] == 3)

    straight, resumed = step3("straight"), step3("resumed")
    assert straight["policy/grad_norm"] > 0 and straight["policy/kl_ref"] > 0  # the adapters moved
    for key in ("reward/mean", "policy/loss", "policy/grad_norm", "policy/kl_ref", "policy/entropy"):
        assert straight[key] == resumed[key], key
    from safetensors.torch import load_file

    a = load_file(tmp_path / "straight" / "checkpoints" / "final" / "adapter" / "adapter_model.safetensors")
    b = load_file(tmp_path / "resumed" / "checkpoints" / "final" / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_qlora_is_refused_on_cpu_and_trainable_with_lora_is_refused(tiny_vlm_dir, tmp_path):
    with pytest.raises(ConfigError, match="model.lora.load_in_4bit.*CUDA GPU"):
        load_config(SFTConfig, None, ["model.lora.load_in_4bit=true"])
    cfg = load_config(SFTConfig, None, [f"model.path={tiny_vlm_dir}", "model.lora.r=4", "train.trainable=[projector]",
                                        "train.steps=1", "data.n_train=4", "data.n_test=2", "check.enabled=false",
                                        "report.html=false", f"out={tmp_path}"])
    with pytest.raises(ValueError, match="train.trainable.*model.lora"):
        run_sft(cfg)
