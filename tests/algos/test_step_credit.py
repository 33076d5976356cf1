import math

import pytest
import torch

from vlrl.algos.step_credit import (
    STEP_INJECTIONS,
    STEP_MATCHERS,
    STEP_PROXIES,
    InjectionInputs,
    broadcast_steps,
    contrast_scores,
    flip_counts,
    grpo_step,
    match_exact,
    match_lcs,
    match_prefix,
    median_residual,
    prefix_reward,
    residual_contrast_scores,
    robust_mean,
    rule_step_rewards,
    stepopsd,
)


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def test_registries_hold_exactly_the_documented_entries():
    assert STEP_MATCHERS.names() == ["exact", "lcs", "prefix"]
    assert STEP_PROXIES.names() == ["contrast", "residual_contrast"]
    assert STEP_INJECTIONS.names() == ["grpo_step", "stepopsd"]


@pytest.mark.parametrize("n,k,expected", [
    (0, 3, 0.0), (1, 3, 2 / 12), (2, 3, 6 / 12), (3, 3, 1.0),  # n(n+1) / (k(k+1)), k(k+1) = 12
    (1, 1, 1.0), (2, 5, 6 / 30),
])
def test_prefix_reward_by_hand(n, k, expected):
    assert prefix_reward(n, k) == pytest.approx(expected)


def test_prefix_reward_rejects_impossible_counts():
    with pytest.raises(ValueError, match="0 ≤ n ≤ k"):
        prefix_reward(4, 3)
    with pytest.raises(ValueError):
        prefix_reward(0, 0)


@pytest.mark.parametrize("predicted,gold,exact,prefix,lcs", [
    # one wrong step in the middle: exact and lcs keep the last step, prefix stops at the error
    ("abxd", "abcd", [1, 1, 0, 1], [1, 1, 0, 0], [1, 1, 0, 1]),
    # an inserted step shifts the rest: only lcs realigns (a, b, c in order)
    ("axbc", "abc", [1, 0, 0, 0], [1, 0, 0, 0], [1, 0, 1, 1]),
    # extra steps after the gold plan are wrong
    ("abcde", "abc", [1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0]),
    # a repeated step: lcs matches the earliest one
    ("aa", "a", [1, 0], [1, 0], [1, 0]),
    # a swapped pair: exact and prefix neither of the two, lcs one of them (a predicted step is skipped first)
    ("bac", "abc", [0, 0, 1], [0, 0, 0], [0, 1, 1]),
    ("", "abc", [], [], []),
])
def test_matchers_by_hand(predicted, gold, exact, prefix, lcs):
    assert match_exact(list(predicted), list(gold)) == [bool(x) for x in exact]
    assert match_prefix(list(predicted), list(gold)) == [bool(x) for x in prefix]
    assert match_lcs(list(predicted), list(gold)) == [bool(x) for x in lcs]


def test_rule_step_rewards_are_plus_minus_one():
    assert rule_step_rewards([3, 7, 1], [3, 7, 9], mode="exact") == [1.0, 1.0, -1.0]
    assert rule_step_rewards([3, 1, 9], [3, 7, 9], mode="prefix") == [1.0, -1.0, -1.0]
    assert rule_step_rewards([3, 1, 9], [3, 7, 9], mode="lcs") == [1.0, -1.0, 1.0]


def test_broadcast_steps_writes_only_target_tokens():
    scores = torch.tensor([[0.5, -1.0]])
    target_index = torch.tensor([[-1, 0, 0, -1, 1]])
    assert broadcast_steps(scores, target_index).tolist() == [[0.0, 0.5, 0.5, 0.0, -1.0]]
    assert broadcast_steps(torch.zeros(1, 0), torch.full((1, 3), -1)).tolist() == [[0.0, 0.0, 0.0]]


def test_robust_mean_by_hand():
    # [1, 2, 3, 100]: median 2.5, MAD = median(1.5, .5, .5, 97.5) = 1.0, spread 2 · 1.4826 → 100 clipped to 5.4652
    assert float(robust_mean(torch.tensor([1.0, 2.0, 3.0, 100.0]))) == pytest.approx((6 + 2.5 + 2 * 1.4826) / 4)
    assert float(robust_mean(torch.tensor([1.0, 3.0]))) == pytest.approx(2.0)  # two values: their mean
    assert float(robust_mean(torch.tensor([-4.0]))) == pytest.approx(-4.0)


def test_contrast_scores_by_hand():
    delta = torch.tensor([[0.4, 0.4, 2.0, -1.0, 0.0]])
    score_index = torch.tensor([[0, 0, -1, 1, -1]])  # token 2 belongs to no step: its Δ is ignored
    mask = torch.ones(1, 5)
    out = contrast_scores(delta, score_index, mask, num_steps=2)
    assert out.scores[0].tolist() == pytest.approx([math.tanh(0.4), math.tanh(-1.0)], abs=1e-6)
    out = contrast_scores(delta, score_index, mask, num_steps=2, tau=2.0)
    assert out.scores[0].tolist() == pytest.approx([math.tanh(0.2), math.tanh(-0.5)], abs=1e-6)
    # per_response: divide by the population std of the response's Δ: mean .36, Σ(d − mean)² = 4.672 over 5 tokens
    std = math.sqrt(4.672 / 5)
    out = contrast_scores(delta, score_index, mask, num_steps=2, norm="per_response")
    assert out.scores[0].tolist() == pytest.approx([math.tanh(0.4 / std), math.tanh(-1.0 / std)], abs=1e-5)
    assert out.valid.tolist() == [[True, True]]


def test_residual_contrast_gate_by_hand():
    delta = torch.tensor([[3.0, 5.0, 1.0, 0.0, 2.0]])
    score_index = torch.tensor([[0, 0, 1, 1, -1]])
    mask = torch.ones(1, 5)
    # the response median of Δ is 2, so d' = [1, 3, −1, −2, 0]
    assert median_residual(delta, mask).tolist() == [[1.0, 3.0, -1.0, -2.0, 0.0]]
    out = residual_contrast_scores(delta, score_index, mask, num_steps=2)
    soft = [math.tanh(2.0), math.tanh(-1.5)]  # robust means of [1, 3] and [−1, −2]
    decision = [sigmoid(1.0), sigmoid(-1.0)]  # importance [2, 1.5]: mean 1.75, std .25 → z = [1, −1]
    budget = [1.0, 2 * sigmoid(-0.5)]  # softmax([2, 1.5]) · 2 = [1.245 → 1, .755]
    confidence = [1 / (1 + 1.0), 1 / (1 + 0.5)]  # 2 tokens each (≥ min 2); std of the residuals 1 and .5
    gate = [d * b * c for d, b, c in zip(decision, budget, confidence, strict=True)]
    assert out.parts["gate"][0].tolist() == pytest.approx(gate, abs=1e-5)
    assert out.scores[0].tolist() == pytest.approx([g * s for g, s in zip(gate, soft, strict=True)], abs=1e-5)
    assert out.scores[0].tolist() == pytest.approx([0.35238, -0.12254], abs=1e-4)


def test_residual_gate_single_token_step_has_lower_confidence():
    delta = torch.tensor([[2.0, 2.0, 2.0, -5.0]])
    out = residual_contrast_scores(delta, torch.tensor([[0, 0, 1, -1]]), torch.ones(1, 4), num_steps=2)
    assert out.parts["confidence"][0, 1] == pytest.approx(0.5)  # 1 of min_score_tokens=2, no spread


def test_grpo_step_adds_and_may_flip_signs():
    episode = torch.tensor([[0.5, 0.5, 0.5, 0.5]])
    inputs = InjectionInputs(episode_advantages=episode, step_advantages=torch.tensor([[0.0, 1.0, -1.0, 0.0]]),
                             delta=torch.zeros(1, 4), target_mask=torch.tensor([[0.0, 1.0, 1.0, 0.0]]),
                             loss_mask=torch.ones(1, 4))
    out = grpo_step(inputs, weight=1.0)
    assert out.tolist() == [[0.5, 1.5, -0.5, 0.5]]  # the wrong step of a good trajectory turns negative
    assert torch.equal(grpo_step(inputs, weight=0.0), episode)
    assert grpo_step(inputs, weight=0.25).tolist() == [[0.5, 0.75, 0.25, 0.5]]
    counts = flip_counts(episode, out, inputs.target_mask)
    assert (counts.flips, counts.signed, counts.ratio) == (1, 2, 0.5)


def test_stepopsd_by_hand_and_sign_preserving():
    episode = torch.tensor([[-1.0, -1.0, -1.0]])
    delta = torch.tensor([[0.0, 3.0, -3.0]])
    inputs = InjectionInputs(episode_advantages=episode, step_advantages=torch.zeros(1, 3), delta=delta,
                             target_mask=torch.tensor([[0.0, 1.0, 1.0]]), loss_mask=torch.ones(1, 3))
    # token 1: w = 2σ(−1 · 3) = 0.095 → clipped to 0.5; token 2: 2σ(3) = 1.905 → 1.5; token 0: Δ = 0 → w = 1
    assert stepopsd(inputs, alpha=0.5, mix=1.0)[0].tolist() == pytest.approx([-1.0, -0.5, -1.5])
    assert stepopsd(inputs, alpha=0.5, mix=0.5)[0].tolist() == pytest.approx([-1.0, -0.75, -1.25])
    # unclipped: w = 2σ(−3) exactly
    assert stepopsd(inputs, alpha=0.99, mix=1.0)[0, 1] == pytest.approx(-2 * sigmoid(-3.0))
    torch.manual_seed(0)
    episode = torch.randn(8, 16)
    delta = 10 * torch.randn(8, 16)
    shaped = stepopsd(InjectionInputs(episode, torch.zeros(8, 16), delta, torch.ones(8, 16), torch.ones(8, 16)),
                      alpha=0.9, mix=1.0)
    assert torch.equal(torch.sign(shaped), torch.sign(episode))  # never a flip
    assert flip_counts(episode, shaped, torch.ones(8, 16)).flips == 0
    with pytest.raises(ValueError, match="alpha"):
        stepopsd(inputs, alpha=1.0)


def test_flip_counts_separate_zero_episode_advantage():
    episode = torch.tensor([[0.0, 0.0, 1.0, -1.0]])
    final = torch.tensor([[0.3, 0.0, -0.5, -2.0]])
    counts = flip_counts(episode, final, torch.ones(1, 4))
    assert (counts.flips, counts.signed, counts.new_signal, counts.unsigned) == (1, 2, 1, 2)
