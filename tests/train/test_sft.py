import pytest
import torch

from vlrl.config import SFTStage
from vlrl.data import generate
from vlrl.report import MetricsLogger
from vlrl.train.sft import encode_sft, sft_step_check, train_sft


def _stage(**train):
    return SFTStage.model_validate({"optim": {"lr": 3e-3}, "train": {"steps": 1, "batch_size": 8, "micro_batch_size": 8, **train}})


def test_targets_are_the_response_plus_eos(tiny_vlm):
    sample = generate("shapes", 1)[0]
    example = encode_sft(tiny_vlm, sample)
    assert tiny_vlm.tokenizer.decode(example.target_ids) == sample.response + "<|im_end|>"
    assert tiny_vlm.tokenizer.decode(example.prompt_ids).endswith("<|im_start|>assistant\n")


def test_one_step_changes_weights_and_lowers_loss(tiny_vlm):
    samples = generate("shapes", 8)
    before = {k: v.clone() for k, v in tiny_vlm.model.state_dict().items()}
    loss0 = sft_step_check(tiny_vlm, samples)
    train_sft(tiny_vlm, samples, _stage(steps=5), logger=MetricsLogger(None, quiet=True), seed=0)
    changed = [k for k, v in tiny_vlm.model.state_dict().items() if not torch.equal(v, before[k])]
    assert any("visual" in k for k in changed) and any("lm_head" in k for k in changed)
    assert sft_step_check(tiny_vlm, samples) < loss0


def test_micro_batching_gives_the_same_update(tiny_vlm):
    from vlrl.models import load_policy

    samples = generate("shapes", 8, tasks=["count", "ocr"])  # different target lengths
    other = load_policy("tiny-qwen2-vl")
    log = MetricsLogger(None, quiet=True)
    train_sft(tiny_vlm, samples, _stage(micro_batch_size=8), logger=log, seed=0)
    train_sft(other, samples, _stage(micro_batch_size=3), logger=log, seed=0)
    for (k, a), b in zip(tiny_vlm.model.state_dict().items(), other.model.state_dict().values(), strict=True):
        assert torch.allclose(a, b, atol=1e-5), k


def test_missing_response_is_named(tiny_vlm):
    sample = generate("shapes", 1)[0]
    sample.response = None
    with pytest.raises(ValueError, match="needs a reference 'response'"):
        encode_sft(tiny_vlm, sample)
