import pytest
import torch

from vlrl.config import SFTStage
from vlrl.data import generate
from vlrl.models.forward import teacher_forced
from vlrl.report import MetricsLogger
from vlrl.train.sft import encode_sft, train_sft


def sft_nll(policy, samples) -> torch.Tensor:
    """Mean assistant-token NLL of ``samples`` under the policy (no gradient)."""
    examples = [encode_sft(policy, s) for s in samples]
    with torch.no_grad():
        logp = teacher_forced(policy.model, policy.adapter, [e.prompt_ids for e in examples],
                              [e.target_ids for e in examples], [e.vision for e in examples],
                              pad_token_id=policy.pad_token_id).logp
    return -logp.sum() / sum(len(e.target_ids) for e in examples)


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
    loss0 = sft_nll(tiny_vlm, samples)
    train_sft(tiny_vlm, samples, _stage(steps=5), logger=MetricsLogger(None, quiet=True), seed=0)
    changed = [k for k, v in tiny_vlm.model.state_dict().items() if not torch.equal(v, before[k])]
    assert any("visual" in k for k in changed) and any("lm_head" in k for k in changed)
    assert sft_nll(tiny_vlm, samples) < loss0


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


# ----------------------------------------------------------------------------------------------- padding-free, plans
def test_padding_free_gives_the_same_update_as_padding(tiny_vlm):
    """A step of padded SFT and one of padding-free SFT (rows packed at run time) reach the same weights."""
    from vlrl.models import load_policy

    samples = generate("shapes", 6, tasks=["count", "ocr", "locate"])  # different target lengths
    other = load_policy("tiny-qwen2-vl")
    log = MetricsLogger(None, quiet=True)
    # AdamW's first step is ≈ lr · sign(g): it turns rounding noise of near-zero gradients into ± lr. With eps = 1
    # the step is ≈ lr · g / (|g| + 1), linear in the gradient, so equal weights mean equal gradients.
    stage = _stage(batch_size=6, micro_batch_size=3)
    stage.optim.eps = 1.0
    before = {k: v.clone() for k, v in tiny_vlm.model.state_dict().items()}
    train_sft(tiny_vlm, samples, stage, logger=log, seed=0)
    stage.train.padding_free = True
    stats = train_sft(other, samples, stage, logger=log, seed=0)
    moved = 0.0
    for (k, a), b in zip(tiny_vlm.model.state_dict().items(), other.model.state_dict().values(), strict=True):
        padded_step, packed_step = a - before[k], b - before[k]
        assert torch.allclose(packed_step, padded_step, atol=1e-8, rtol=1e-3), k
        moved = max(moved, float(padded_step.abs().max()))
    assert moved > 1e-4  # the comparison is not between two steps that did nothing
    assert stats.metrics["perf/padding_frac"] < 0.2  # first-fit rows as long as the longest sample: little end padding


def _plan(policy, samples, capacity, **options):
    from vlrl.data.packing import plan_samples
    from vlrl.models.lengths import TokenCounter

    return plan_samples(samples, TokenCounter(policy), capacity, model={"path": "tiny-qwen2-vl"}, **options)


def test_training_from_a_packing_plan(tiny_vlm):
    samples = generate("shapes", 8, tasks=["count", "color", "ocr"])
    plan = _plan(tiny_vlm, samples, capacity=200)
    assert plan.num_bins < len(samples)  # several samples per packed sequence
    loss0 = sft_nll(tiny_vlm, samples)
    log = MetricsLogger(None, quiet=True)
    stats = train_sft(tiny_vlm, samples, _stage(steps=2, batch_size=2, micro_batch_size=2), logger=log, seed=0, plan=plan)
    assert stats.steps == 2 and stats.metrics["perf/padding_frac"] < 0.25
    assert sft_nll(tiny_vlm, samples) < loss0


def test_plan_errors_name_the_cause(tiny_vlm):
    from vlrl.data.packing import PackingError

    samples = generate("shapes", 6)
    plan = _plan(tiny_vlm, samples, capacity=200)
    log = MetricsLogger(None, quiet=True)
    with pytest.raises(PackingError, match="differ from those"):
        train_sft(tiny_vlm, generate("shapes", 6, seed=1), _stage(), logger=log, seed=0, plan=plan)
    with pytest.raises(ValueError, match="max_samples cannot be combined"):
        train_sft(tiny_vlm, samples, _stage(max_samples=3), logger=log, seed=0, plan=plan)
    plan.lengths = plan.lengths // 2  # a plan computed with another processor: bins overflow with this one
    plan.capacity = int(plan.packed_lengths().max())
    with pytest.raises(ValueError, match=r"bin \d+ holds \d+ tokens .* re-run `vlrl data pack`"):
        train_sft(tiny_vlm, samples, _stage(), logger=log, seed=0, plan=plan)


def test_truncated_samples_are_cut_to_the_capacity(tiny_vlm):
    sample = generate("shapes", 1, tasks=["ocr"])[0]
    full = encode_sft(tiny_vlm, sample)
    cut = encode_sft(tiny_vlm, sample, max_tokens=full.length - 2)
    assert cut.length == full.length - 2 and cut.target_ids == full.target_ids[:-2]
    with pytest.raises(ValueError, match="leaves no room for a target"):
        encode_sft(tiny_vlm, sample, max_tokens=len(full.prompt_ids))


def test_trainable_freezes_the_rest_and_is_restored(tiny_vlm):
    samples = generate("shapes", 4)
    before = {k: v.clone() for k, v in tiny_vlm.model.state_dict().items()}
    stage = _stage(steps=1, batch_size=4, micro_batch_size=4, trainable=["projector"])
    train_sft(tiny_vlm, samples, stage, logger=MetricsLogger(None, quiet=True), seed=0)
    changed = {k for k, v in tiny_vlm.model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and all(k.startswith("model.visual.merger.") for k in changed)
    assert all(p.requires_grad for p in tiny_vlm.model.parameters())  # the next stage starts unfrozen
