import pytest
import torch

from vlrl.algos import (
    ADVANTAGE_SHAPING,
    REWARD_SHAPING,
    AdvantageShapingInputs,
    RewardShapingInputs,
    get_reward_shaping,
)
from vlrl.rewards.format import overlong


def _inputs(rewards, lengths, max_new_tokens=10):
    n = len(rewards)
    return RewardShapingInputs(rewards=torch.tensor(rewards), group_index=torch.zeros(n, dtype=torch.long),
                               response_length=torch.tensor(lengths), truncated=torch.tensor(lengths) >= max_new_tokens,
                               max_new_tokens=max_new_tokens)


def test_reward_scale_is_the_llava_ov_rule():
    # r′ = (r − 0.5) × 10: 1 → 5, 0 → −5, .5 → 0
    out = get_reward_shaping("reward_scale")(_inputs([1.0, 0.0, 0.5], [1, 1, 1]))
    assert out.values.tolist() == [5.0, -5.0, 0.0]
    assert get_reward_shaping("reward_scale")(_inputs([1.0], [1]), scale=2.0, bias=0.0).values.tolist() == [2.0]


def test_overlong_penalty_by_hand():
    # L_max = 10, L_cache = 4: |y| ≤ 6 → 0; 7 → (6 − 7)/4 = −.25; 10 → −1; 11 → −1 (past L_max); added to r = 1
    out = get_reward_shaping("overlong_penalty")(_inputs([1.0, 1.0, 1.0, 1.0, 1.0], [6, 7, 8, 10, 11]), cache_length=4)
    assert torch.allclose(out.values, torch.tensor([1.0, 0.75, 0.5, 0.0, 0.0]))
    assert out.metrics["penalised_frac"] == pytest.approx(0.8)
    # the formula is the `overlong` verifier's, not a second copy
    for n in range(0, 13):
        assert get_reward_shaping("overlong_penalty")(_inputs([0.0], [n]), cache_length=4).values.item() == pytest.approx(
            overlong("", max_length=10, cache_length=4, response_length=n))
    # max_length given explicitly overrides max_new_tokens
    out = get_reward_shaping("overlong_penalty")(_inputs([0.0], [7]), cache_length=2, max_length=8)
    assert out.values.item() == pytest.approx(-0.5)  # (6 − 7) / 2


def test_every_registered_shaper_runs_on_a_fake_batch():
    import dataclasses

    from tests.train.fakes import fake_trajectories

    options = {"overlong_penalty": {"cache_length": 4}}
    trajectories = fake_trajectories([1.0, 0.0, 0.5], [0, 0, 0], [3, 9, 12], accuracy=[1.0, 0.0, 0.5])
    for t, v in zip(trajectories, ["0.5", "0.2", "0.9"], strict=True):  # the Syn-GRPO template, for syn_diversity
        t.response_text = f"<diversity>{v}</diversity><description>a wall</description><answer>1</answer>"
    for name, fn in REWARD_SHAPING.items():
        if not fn.__module__.startswith("vlrl."):  # plug-ins registered by other tests
            continue
        inputs = dataclasses.replace(_inputs([1.0, 0.0, 0.5], [3, 9, 12]), trajectories=tuple(trajectories))
        out = fn(inputs, **options.get(name, {}))
        assert out.values.shape == (3,) and torch.isfinite(out.values).all(), name
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    for name, fn in ADVANTAGE_SHAPING.items():
        inputs = AdvantageShapingInputs(advantages=torch.tensor([[0.5, 0.5, 0.0], [-0.5, 0.0, 0.0]]), loss_mask=mask,
                                        group_index=torch.tensor([0, 0]), rewards=torch.tensor([1.0, 0.0]),
                                        token_rewards=torch.zeros(2, 3))
        try:
            out = fn(inputs)
        except (TypeError, ValueError):  # plug-ins registered by other tests may need options or trajectories;
            # step_credit needs the loop's context (the policy, a teacher): tests/train/test_step_credit.py runs it
            assert name.startswith("test_") or name == "step_credit", name
            continue
        assert out.values.shape == (2, 3), name
