import pytest
import torch

from vlrl.algos import ADVANTAGES, AdvantageInputs, get_advantage


def _inputs(rewards, groups, lengths):
    B, T = len(rewards), max(lengths)
    mask = torch.zeros(B, T)
    token_rewards = torch.zeros(B, T)
    for i, (r, n) in enumerate(zip(rewards, lengths, strict=True)):
        mask[i, :n] = 1
        token_rewards[i, n - 1] = r
    return AdvantageInputs(token_rewards=token_rewards, loss_mask=mask, group_index=torch.tensor(groups))


def test_grpo_by_hand():
    # group 0: rewards 1, 1, 1, .5, 0 (the seed's example): mean .7,
    # unbiased std = sqrt((3·.09 + .04 + .49) / 4) = sqrt(.2) = .44721
    # group 1: rewards 0, 1: mean .5, std = sqrt((.25 + .25) / 1) = .70711
    inputs = _inputs([1, 1, 1, 0.5, 0, 0, 1], [0, 0, 0, 0, 0, 1, 1], [2, 3, 1, 2, 2, 3, 1])
    out = get_advantage("grpo")(inputs, eps=0.0)
    expected = torch.tensor([0.3, 0.3, 0.3, -0.2, -0.7, -0.5, 0.5]) / torch.tensor([0.44721] * 5 + [0.70711] * 2)
    seq = out.advantages.sum(-1) / inputs.loss_mask.sum(-1)
    assert torch.allclose(seq, expected, atol=1e-4)
    assert torch.all(out.advantages[inputs.loss_mask == 0] == 0)  # broadcast only onto response tokens
    assert torch.allclose(out.advantages[0, :2], torch.full((2,), 0.3 / 0.44721), atol=1e-4)


def test_grpo_without_std_and_uniform_group():
    inputs = _inputs([1, 0, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1])
    out = get_advantage("grpo")(inputs, norm_by_std=False)
    assert out.advantages[:, 0].tolist() == [0.5, -0.5, 0.0, 0.0]  # group 1 all equal → zero signal


def test_every_estimator_runs_on_a_fake_batch():
    inputs = _inputs([1, 0, 0.5, 1], [0, 0, 1, 1], [3, 2, 1, 3])
    inputs.values = torch.zeros_like(inputs.loss_mask)
    inputs.baseline_rewards = torch.tensor([0.5, 0.5, 0.0, 0.0])
    for name, fn in ADVANTAGES.items():
        out = fn(inputs)
        assert out.advantages.shape == inputs.loss_mask.shape, name
        assert torch.isfinite(out.advantages).all(), name
        assert torch.all(out.advantages[inputs.loss_mask == 0] == 0), name


def test_unknown_estimator():
    with pytest.raises(KeyError, match="unknown advantage"):
        get_advantage("nope")
