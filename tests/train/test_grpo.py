import json

import torch

from vlrl.config import RLStage
from vlrl.data import generate
from vlrl.report import MetricsLogger
from vlrl.rewards import register_reward
from vlrl.rollout import HFEngine
from vlrl.train.loop import train_rl


def _stage(**overrides):
    raw = {"optim": {"lr": 1e-3}, "rollout": {"n": 4, "max_new_tokens": 6},
           "train": {"steps": 1, "prompts_per_step": 4, "micro_batch_size": 8}}
    for key, value in overrides.items():
        raw.setdefault(key, {}).update(value)
    return RLStage.model_validate(raw)


@register_reward("test_length_reward")
def _length_reward(response, answer, **meta):
    """A dense test reward: shorter responses are better (so every group has mixed rewards)."""
    return 1.0 / (1.0 + len(response))


@register_reward("test_constant_reward")
def _constant_reward(response, answer, **meta):
    return 0.5


def _samples(n=8):
    samples = generate("shapes", n, tasks=["count"])
    for s in samples:
        s.reward = "test_length_reward"
    return samples


def test_one_step_changes_weights_and_logs_metrics(tiny_vlm, tmp_path):
    before = {k: v.clone() for k, v in tiny_vlm.model.state_dict().items()}
    engine = HFEngine(tiny_vlm)
    logger = MetricsLogger(tmp_path / "metrics.jsonl", quiet=True)
    stats = train_rl(tiny_vlm, engine, _samples(), _stage(), logger=logger, seed=0)
    assert any(not torch.equal(v, before[k]) for k, v in tiny_vlm.model.state_dict().items())
    assert engine.weight_version == 1
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    for key in ("reward/mean", "reward/std", "policy/entropy", "policy/clip_low", "policy/clip_high",
                "policy/grad_norm", "policy/approx_kl_old", "response/length_mean", "response/truncated_frac",
                "perf/tokens_per_s", "policy/zero_adv_groups_frac"):
        assert key in record, key
    assert stats.steps == 1 and stats.metrics["policy/approx_kl_old"] == 0.0  # one update: exactly on-policy


def test_zero_advantage_batch_leaves_weights_unchanged(tiny_vlm):
    """All rewards equal → all advantages 0 → zero gradient (with grad clipping and no weight decay)."""
    samples = generate("shapes", 4, tasks=["count"])
    for s in samples:
        s.reward = "test_constant_reward"
    before = {k: v.clone() for k, v in tiny_vlm.model.state_dict().items()}
    stats = train_rl(tiny_vlm, HFEngine(tiny_vlm), samples, _stage(), logger=MetricsLogger(None, quiet=True), seed=0)
    assert stats.metrics["policy/zero_adv_groups_frac"] == 1.0
    assert all(torch.equal(v, before[k]) for k, v in tiny_vlm.model.state_dict().items())


def test_kl_term_and_several_minibatches_run(tiny_vlm):
    stage = _stage(algo={"kl_coef": 0.1}, train={"steps": 2, "minibatches": 2, "ppo_epochs": 2, "micro_batch_size": 3})
    stats = train_rl(tiny_vlm, HFEngine(tiny_vlm), _samples(), stage, logger=MetricsLogger(None, quiet=True), seed=0)
    assert stats.steps == 2
    assert stats.metrics["policy/kl_ref"] > 0  # the policy moved away from the frozen reference
    assert stats.metrics["policy/approx_kl_old"] > 0  # later minibatches are off-policy w.r.t. π_old


def test_rl_raises_a_dense_reward(tiny_vlm):
    """A few dozen steps on the shorter-is-better reward must raise it (learning signal end to end)."""
    engine = HFEngine(tiny_vlm)
    stage = _stage(rollout={"n": 8, "max_new_tokens": 12}, train={"steps": 25, "prompts_per_step": 8, "micro_batch_size": 64},
                   optim={"lr": 3e-3})
    logger = MetricsLogger(None, quiet=True)
    train_rl(tiny_vlm, engine, _samples(16), stage, logger=logger, seed=0)
    rewards = [r["reward/mean"] for r in logger.records]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.05, rewards
