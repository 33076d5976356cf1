"""`FlopMeter` against torch's own FLOP counter, and the control budget's arithmetic."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from vlrl.data import generate
from vlrl.data.sample import load_image
from vlrl.models import collate, load_policy, response_logprobs
from vlrl.rollout import HFEngine, SamplingParams
from vlrl.train.budget import FlopMeter, Flops, PhaseMeter, control_budget, control_steps

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def eager_policy(tiny_vlm_dir):
    """Eager attention: torch's FlopCounterMode does not count the CPU SDPA kernel, it does count matmuls."""
    policy = load_policy(str(tiny_vlm_dir))
    policy.model.set_attn_implementation("eager")
    return policy


def _batch(policy, n=4):
    samples = generate("shapes", n, split="test", tasks=["count"])
    encoded = [policy.adapter.encode_prompt(s.messages, [load_image(x) for x in s.images]) for s in samples]
    responses = [policy.adapter.encode_text(s.response) + [policy.eos_token_ids[0]] for s in samples]
    return samples, collate([e.input_ids for e in encoded], responses, [e.vision for e in encoded],
                            pad_token_id=policy.pad_token_id)


def test_a_training_pass_counts_as_torch_counts_it(eager_policy):
    _, tokens = _batch(eager_policy)
    with FlopMeter(eager_policy.model) as meter, FlopCounterMode(display=False) as counter:
        logp, _ = response_logprobs(eager_policy.model, eager_policy.adapter, tokens)
        (-logp.sum()).backward()
    eager_policy.model.zero_grad(set_to_none=True)
    assert meter.flops.inference == 0 and meter.flops.train > 0
    # within 5 %: the meter charges backward 2× forward everywhere, while the patch embedding (a convolution
    # of the pixels, which need no gradient) only computes its weight gradient — measured +3.8 % here
    assert meter.flops.train == pytest.approx(counter.get_total_flops(), rel=0.05)
    assert meter.flops.train >= counter.get_total_flops()


def test_generation_counts_as_torch_counts_it_and_as_inference(eager_policy):
    samples, _ = _batch(eager_policy)
    engine = HFEngine(eager_policy)
    requests = [engine.encode(s) for s in samples]
    torch.manual_seed(0)
    with FlopMeter(eager_policy.model) as meter, FlopCounterMode(display=False) as counter:
        engine.generate(requests, SamplingParams(n=2, temperature=1.0, max_new_tokens=6))
    assert meter.flops.train == 0
    assert meter.flops.inference == pytest.approx(counter.get_total_flops(), rel=0.02)


def test_the_meter_stops_counting_when_removed(eager_policy):
    _, tokens = _batch(eager_policy, n=2)
    meter = FlopMeter(eager_policy.model)
    with meter, torch.no_grad():
        response_logprobs(eager_policy.model, eager_policy.adapter, tokens)
    counted = meter.snapshot()
    with torch.no_grad():
        response_logprobs(eager_policy.model, eager_policy.adapter, tokens)
    assert meter.flops == counted and counted.inference > 0 and counted.train == 0


def test_control_steps_and_budget_arithmetic():
    rl = Flops(train=3e12, inference=1e12)
    assert control_steps(rl, 1e11) == 40  # 4e12 / 1e11
    # SFT: 100 steps, 2e13 FLOPs, 50 s → 2e11 FLOPs and 0.5 s per step; RL: 4e12 FLOPs in 30 s
    budget = control_budget("flops", rl_flops=rl, rl_seconds=30.0, sft_flops=Flops(train=2e13), sft_steps=100,
                            sft_seconds=50.0)
    assert (budget["flops_matched_steps"], budget["wall_matched_steps"]) == (20, 60)
    assert (budget["control_steps"], budget["max_seconds"]) == (20, None)
    wall = control_budget("wall", rl_flops=rl, rl_seconds=30.0, sft_flops=Flops(train=2e13), sft_steps=100,
                          sft_seconds=50.0)
    assert (wall["control_steps"], wall["max_seconds"]) == (None, 30.0)
    with pytest.raises(ValueError, match="sft.train.steps"):
        control_budget("flops", rl_flops=rl, rl_seconds=1, sft_flops=Flops(), sft_steps=0, sft_seconds=0)


def test_a_wall_time_control_refuses_a_decaying_sft_schedule():
    """The wall-time control learns its step count only when its time runs out: nothing to decay over."""
    from pathlib import Path

    from vlrl.config import ConfigError, DemoConfig, load_config

    demo = Path(__file__).resolve().parents[2] / "src" / "vlrl" / "configs" / "demo.yaml"
    assert load_config(DemoConfig, demo, ["sft.optim.schedule=cosine"]).sft.optim.schedule == "cosine"  # flops: fine
    with pytest.raises(ConfigError, match="sft.optim.schedule=cosine with control_budget=wall"):
        load_config(DemoConfig, demo, ["sft.optim.schedule=cosine", "control_budget=wall"])


def test_the_phase_meter_divides_each_phases_flops_by_its_seconds_and_the_peak(eager_policy, monkeypatch):
    import time

    from vlrl.report.perf import Peak

    _, tokens = _batch(eager_policy)
    with PhaseMeter(eager_policy.model, "cpu", torch.float32) as perf:
        perf.peak = Peak(1e12, "test")  # 1 TFLOP/s
        clock = iter([10.0, 12.0, 15.0])  # begin, after generation (2 s), after the update (3 s)
        monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
        perf.begin()
        with torch.no_grad():
            response_logprobs(eager_policy.model, eager_policy.adapter, tokens)
        perf.phase("gen_")
        generated = perf.meter.snapshot()
        logp, _ = response_logprobs(eager_policy.model, eager_policy.adapter, tokens)
        (-logp.sum()).backward()
        perf.phase("")
        trained = perf.meter.snapshot() - generated
    eager_policy.model.zero_grad(set_to_none=True)
    metrics = perf.metrics()
    assert metrics["perf/gen_tflops"] == pytest.approx(generated.inference / 2 / 1e12)
    assert metrics["perf/gen_mfu"] == pytest.approx(generated.inference / 2 / 1e12)  # of 1 TFLOP/s
    assert metrics["perf/mfu"] == pytest.approx(trained.train / 3 / 1e12) and trained.inference == 0
    assert metrics["perf/peak_tflops"] == 1.0
    assert perf.metrics() == {}  # the phases were consumed


def test_every_sft_and_grpo_step_logs_its_mfu(tiny_vlm):
    from vlrl.config import RLStage, SFTStage
    from vlrl.report import MetricsLogger
    from vlrl.report.perf import device_peak
    from vlrl.train.loop import train_rl
    from vlrl.train.sft import train_sft

    sft = SFTStage.model_validate({"train": {"steps": 1, "batch_size": 4, "micro_batch_size": 4}})
    stats = train_sft(tiny_vlm, generate("shapes", 4), sft, logger=MetricsLogger(None, quiet=True), seed=0)
    rl = RLStage.model_validate({"rollout": {"n": 2, "max_new_tokens": 4},
                                 "train": {"steps": 1, "prompts_per_step": 2, "micro_batch_size": 4}})
    logger = MetricsLogger(None, quiet=True)
    train_rl(tiny_vlm, HFEngine(tiny_vlm), generate("shapes", 2), rl, logger=logger, seed=0)
    (record,) = logger.records
    peak = device_peak("cpu").tflops  # this process's measured CPU matmul peak, the one the loops divide by
    for metrics, phases in ((stats.metrics, [""]), (record, ["", "gen_"])):
        assert metrics["perf/peak_tflops"] == peak
        for prefix in phases:
            mfu = metrics[f"perf/{prefix}mfu"]
            assert 0 < mfu < 1 and mfu == pytest.approx(metrics[f"perf/{prefix}tflops"] / peak)


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-qwen3-vl", "tiny-qwen3.5", "tiny-glm4v", "tiny-internvl",
                                  "tiny-gemma3", "tiny-llava-onevision", "tiny-smolvlm", "tiny-qwen2"])
def test_the_meter_counts_every_familys_passes(name):
    """Every SFT and RL run meters its passes (`PhaseMeter`): each family's tower and decoder are counted, whatever
    its vision inputs look like (Qwen-style patch rows, or tiles of pixels)."""
    policy = load_policy(name)
    if policy.is_vision:
        samples = generate("shapes", 2, split="test", tasks=["count"])
        encoded = [policy.adapter.encode_prompt(s.messages, [load_image(x) for x in s.images]) for s in samples]
        responses = [policy.adapter.encode_text(s.response) for s in samples]
    else:
        samples = generate("arith", 2)
        encoded = [policy.adapter.encode_prompt(s.messages, []) for s in samples]
        responses = [policy.adapter.encode_text(s.response) for s in samples]
    tokens = collate([e.input_ids for e in encoded], responses, [e.vision for e in encoded],
                     pad_token_id=policy.pad_token_id)
    with FlopMeter(policy.model) as meter:
        logp, _ = response_logprobs(policy.model, policy.adapter, tokens)
        (-logp.sum()).backward()
        trained = meter.snapshot()
        with torch.no_grad():
            response_logprobs(policy.model, policy.adapter, tokens)
    assert trained.train > 0 and meter.flops.inference == pytest.approx(trained.train / 3)  # 3×: fwd + bwd
    if meter.vision is not None:
        counted = []
        handle = meter.vision.register_forward_hook(lambda *a: counted.append(1))
        with FlopMeter(policy.model) as vision_only:
            vision_only._on_decoder = vision_only._on_head = lambda *a, **k: None
            with torch.no_grad():
                response_logprobs(policy.model, policy.adapter, tokens)
        handle.remove()
        assert counted and vision_only.flops.inference > 0  # the tower ran, and was counted
