"""Every GRPO-family preset trains the tiny VLM for a few steps on shapes prompts without NaNs, and its
distinctive machinery (critic, KL reward penalty, dynamic sampling, greedy baseline) shows in the metrics."""

import math
from pathlib import Path

import pytest
import torch

import vlrl
from vlrl.config import RLConfig, load_config
from vlrl.data import generate
from vlrl.models import load_policy
from vlrl.report import MetricsLogger
from vlrl.rewards import register_reward
from vlrl.rollout import HFEngine
from vlrl.rollout.threaded_engine import ThreadedEngine
from vlrl.train.loop import train_rl

from .fakes import train_async

CONFIGS = Path(vlrl.__file__).parent / "configs"
PRESETS = ["grpo", "dapo", "ppo", "rloo", "reinforce_pp", "dr_grpo", "remax"]
TINY = ["rollout.n=4", "rollout.max_new_tokens=6", "train.steps=2", "train.prompts_per_step=2",
        "train.micro_batch_size=8", "train.ppo_epochs=1", "train.log_every=1", "optim.lr=3e-3"]


pytestmark = pytest.mark.usefixtures("one_thread")


@register_reward("test_preset_length_reward")
def _length_reward(response, answer, **meta):
    """Dense: shorter responses score higher, so groups have mixed rewards (the random tiny model never
    answers a shapes question right)."""
    return 1.0 / (1.0 + len(response))


def _samples(n=8):
    samples = generate("shapes", n, tasks=["count", "color"])
    for s in samples:
        s.reward = "test_preset_length_reward"
    return samples


@pytest.fixture(scope="module")
def fresh_policy():
    """``make()`` → the tiny preset with its initial weights (built once per module, reset for each test)."""
    policy = load_policy("tiny-qwen2-vl")
    initial = {k: v.clone() for k, v in policy.model.state_dict().items()}

    def make():
        policy.model.load_state_dict(initial)
        return policy

    return make


def _finite(record):
    return all(math.isfinite(v) for k, v in record.items() if isinstance(v, float))


@pytest.mark.parametrize("name", PRESETS)
def test_preset_trains_without_nans(name, fresh_policy):
    cfg = load_config(RLConfig, CONFIGS / f"shapes_{name}.yaml", TINY)
    policy = fresh_policy()
    before = [p.detach().clone() for p in policy.model.parameters()]
    logger = MetricsLogger(None, quiet=True)
    stats = train_rl(policy, HFEngine(policy), _samples(), cfg, logger=logger, seed=0)
    assert stats.steps == 2 and len(logger.records) == 2
    assert all(_finite(r) for r in logger.records), logger.records
    assert any(not torch.equal(p, b) for p, b in zip(policy.model.parameters(), before, strict=True))
    for key in ("policy/entropy", "rollout/gen_prob", "policy/clip_low", "policy/clip_high", "policy/approx_kl_old",
                "rollout/diversity", "policy/zero_adv_groups_frac", "response/length_mean", "response/length_max",
                "response/truncated_frac", "policy/behaviour_weight_mean", "policy/behaviour_weight_max",
                "policy/behaviour_weight_capped_frac"):
        assert key in stats.metrics, (name, key)
    if cfg.algo.kl_coef > 0:
        assert stats.metrics["policy/kl_ref"] != 0.0  # the policy moved away from the reference after one step
    if cfg.algo.advantage == "gae":
        assert stats.metrics["critic/value_loss"] > 0 and "critic/grad_norm" in stats.metrics
    if cfg.algo.dynamic_sampling.enabled:
        assert stats.metrics["sampling/prompts_used"] == 2 and stats.metrics["policy/zero_adv_groups_frac"] == 0.0
        assert "shaping/overlong_penalty/penalised_frac" in stats.metrics


def test_critic_kl_reward_and_minibatches_work_in_the_async_recipe(fresh_policy):
    """The ppo preset (critic, KL reward penalty, 2 minibatches) through the async recipe at η = 0 logs what
    the sync recipe logs, to float noise (the step is the same code)."""
    cfg = load_config(RLConfig, CONFIGS / "shapes_ppo.yaml", TINY + ["staleness.eta=0",
                                                                     "staleness.apply_behaviour_weight=false"])
    samples = _samples()
    sync_policy = fresh_policy()
    torch.manual_seed(0)
    sync_logger = MetricsLogger(None, quiet=True)
    train_rl(sync_policy, HFEngine(sync_policy), samples, cfg, logger=sync_logger, seed=0)
    async_policy = load_policy("tiny-qwen2-vl")  # a second instance: the sync run trained the first
    torch.manual_seed(0)
    engine = ThreadedEngine(async_policy)
    async_logger = MetricsLogger(None, quiet=True)
    try:
        train_async(async_policy, engine, samples, cfg, logger=async_logger, seed=0)
    finally:
        engine.close()
    for sync, asynchronous in zip(sync_logger.records, async_logger.records, strict=True):
        for key in ("reward/mean", "critic/value_loss", "policy/kl_ref", "policy/loss", "policy/grad_norm"):
            assert asynchronous[key] == pytest.approx(sync[key], rel=1e-4, abs=1e-6), (sync["step"], key)


@register_reward("test_preset_flat_or_length")
def _flat_or_length(response, answer, *, flat=False, **meta):
    """0.5 for every response to a ``flat`` prompt (a zero-advantage group), else shorter-is-better."""
    return 0.5 if flat else 1.0 / (1.0 + len(response))


def test_dynamic_sampling_and_greedy_baseline_in_the_async_recipe():
    """DAPO's filter on the async path: groups of flat prompts are dropped (their quota returned, so replacements
    are generated) and never reach the loss; ReMax's greedy baseline is generated by the rollout workers."""
    samples = _samples(8)
    for k, s in enumerate(samples):
        s.reward, s.metadata["flat"] = "test_preset_flat_or_length", k % 2 == 0
    cfg = load_config(RLConfig, CONFIGS / "shapes_dapo.yaml", TINY + ["staleness.eta=1", "algo.advantage=remax"])
    policy = load_policy("tiny-qwen2-vl")
    engine = ThreadedEngine(policy)
    logger, state = MetricsLogger(None, quiet=True), {}
    try:
        train_async(policy, engine, samples, cfg, logger=logger, seed=0, state_out=state)
    finally:
        engine.close()
    assert state["filtered"]  # some flat groups were drawn and dropped
    assert sum(r["sampling/groups_dropped"] for r in logger.records) == len(state["filtered"])
    buckets = state["trained"] + state["discarded"] + state["filtered"] + state["buffered"] + state["pending"]
    assert sorted(buckets) == list(range(state["drawn"]))  # every drawn prompt accounted for
    for record in logger.records:  # a flat group reaching the loss would have zero advantage (0.5 − 0.5)
        assert record["sampling/prompts_used"] == 2 and record["policy/zero_adv_groups_frac"] == 0.0
        assert _finite(record)


def test_async_dynamic_sampling_with_no_informative_group_trains_the_last_batch():
    """Every prompt flat: each step drops one batch of 2 (cap (1 + 1) × 2 = 4 groups), then trains the next 2
    (zero advantage), flagged starved. Those 2 count as trained, not filtered, and keep their admission quota:
    every drawn prompt is in exactly one bucket."""
    samples = _samples(8)
    for s in samples:
        s.reward, s.metadata["flat"] = "test_preset_flat_or_length", True
    cfg = load_config(RLConfig, CONFIGS / "shapes_dapo.yaml",
                      TINY + ["staleness.eta=1", "algo.dynamic_sampling.max_extra_rounds=1"])
    policy = load_policy("tiny-qwen2-vl")
    engine = ThreadedEngine(policy)
    logger, state = MetricsLogger(None, quiet=True), {}
    try:
        train_async(policy, engine, samples, cfg, logger=logger, seed=0, state_out=state)
    finally:
        engine.close()
    for record in logger.records:
        assert record["sampling/starved"] == 1.0 and record["sampling/groups_dropped"] == 2
        assert record["sampling/prompts_used"] == 2 and record["policy/zero_adv_groups_frac"] == 1.0
    assert len(state["trained"]) == 4 and len(state["filtered"]) == 4
    buckets = state["trained"] + state["discarded"] + state["filtered"] + state["buffered"] + state["pending"]
    assert sorted(buckets) == list(range(state["drawn"]))
