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


def test_needs_of_each_estimator():
    from vlrl.algos import advantage_needs

    assert {name: set(advantage_needs(fn)) for name, fn in ADVANTAGES.items() if not name.startswith("test_")} == {
        "dr_grpo": set(), "gae": {"values"}, "grpo": set(), "reinforce_pp": set(), "remax": {"baseline_rewards"},
        "rloo": set()}


def test_dr_grpo_by_hand():
    # group 0: 1, 0, .5 → mean .5 → Â = .5, −.5, 0 (no std division); group 1: 1, 1 → 0
    inputs = _inputs([1, 0, 0.5, 1, 1], [0, 0, 0, 1, 1], [2, 1, 3, 1, 2])
    out = get_advantage("dr_grpo")(inputs)
    assert torch.allclose(out.advantages[:, 0], torch.tensor([0.5, -0.5, 0.0, 0.0, 0.0]))
    assert out.advantages[0].tolist() == [0.5, 0.5, 0.0]  # broadcast over the 2 model tokens only


def test_rloo_by_hand():
    # group 0: 1, 0, .5 — leave-one-out baselines mean(0, .5) = .25, mean(1, .5) = .75, mean(1, 0) = .5
    #   → Â = .75, −.75, 0  (= 3/2 · (r − .5)); group 1 is a singleton: no baseline → 0
    inputs = _inputs([1, 0, 0.5, 0.3], [0, 0, 0, 1], [1, 1, 1, 1])
    out = get_advantage("rloo")(inputs)
    assert torch.allclose(out.advantages[:, 0], torch.tensor([0.75, -0.75, 0.0, 0.0]))


def test_reinforce_pp_by_hand():
    # two responses (one group), outcome on the last token: token rewards [[0, 1], [0, ·]] (row 1 has 1 token)
    inputs = _inputs([1, 0], [0, 0], [2, 1])
    # γ = 1: returns [[1, 1], [0, ·]]; whitened over the 3 model tokens: mean 2/3, unbiased std √(1/3) = .57735
    out = get_advantage("reinforce_pp")(inputs)
    assert torch.allclose(out.advantages, torch.tensor([[0.57735, 0.57735], [-1.1547, 0.0]]), atol=1e-4)
    assert out.returns.tolist() == [[1.0, 1.0], [0.0, 0.0]]
    # γ = .5: returns [[.5, 1], [0, ·]]: mean .5, std .5 → [[0, 1], [−1, ·]]
    out = get_advantage("reinforce_pp")(inputs, gamma=0.5)
    assert torch.allclose(out.advantages, torch.tensor([[0.0, 1.0], [-1.0, 0.0]]), atol=1e-6)


def test_reinforce_pp_with_group_baseline_by_hand():
    inputs = _inputs([1, 0, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1])
    # no baseline: 1, 0, 1, 1 → mean .75, unbiased std .5 → .5, −1.5, .5, .5
    plain = get_advantage("reinforce_pp")(inputs).advantages[:, 0]
    assert torch.allclose(plain, torch.tensor([0.5, -1.5, 0.5, 0.5]), atol=1e-5)
    # group means .5 and 1 subtracted: .5, −.5, 0, 0 → mean 0, std √(.5/3) = .40825 → ±1.2247, 0, 0
    based = get_advantage("reinforce_pp")(inputs, group_baseline=True).advantages[:, 0]
    assert torch.allclose(based, torch.tensor([1.2247, -1.2247, 0.0, 0.0]), atol=1e-4)


def test_gae_by_hand():
    # one response of 3 model tokens, reward 1 on the last; V = .5, .2, .4
    inputs = _inputs([1], [0], [3])
    inputs.values = torch.tensor([[0.5, 0.2, 0.4]])
    # γ = λ = 1: Â_t = Σ r − V_t = .5, .8, .6; returns = Â + V = 1, 1, 1
    out = get_advantage("gae")(inputs, whiten=False)
    assert torch.allclose(out.advantages, torch.tensor([[0.5, 0.8, 0.6]]))
    assert torch.allclose(out.returns, torch.ones(1, 3))
    # γ = .9, λ = .5: δ2 = 1 − .4 = .6 → Â2 = .6;  δ1 = .9·.4 − .2 = .16 → Â1 = .16 + .45·.6 = .43;
    #                 δ0 = .9·.2 − .5 = −.32 → Â0 = −.32 + .45·.43 = −.1265;  returns = Â + V = .3735, .63, 1
    out = get_advantage("gae")(inputs, gamma=0.9, lam=0.5, whiten=False)
    assert torch.allclose(out.advantages, torch.tensor([[-0.1265, 0.43, 0.6]]), atol=1e-6)
    assert torch.allclose(out.returns, torch.tensor([[0.3735, 0.63, 1.0]]), atol=1e-6)
    # whitened (default): mean 0, unbiased std 1 over the model tokens
    white = get_advantage("gae")(inputs).advantages
    assert abs(float(white.mean())) < 1e-6 and abs(float(white.std()) - 1) < 1e-4


def test_gae_steps_over_observation_tokens():
    # mask 1, 0, 1 (a tool output in the middle), reward 1 on the last model token, V = .5, 9 (ignored), .4
    # γ = .9, λ = .5: Â2 = .6; the next state of token 0 is token 2: δ0 = .9·.4 − .5 = −.14 → Â0 = −.14 + .45·.6 = .13
    inputs = AdvantageInputs(token_rewards=torch.tensor([[0.0, 0.0, 1.0]]), loss_mask=torch.tensor([[1.0, 0.0, 1.0]]),
                             group_index=torch.tensor([0]), values=torch.tensor([[0.5, 9.0, 0.4]]))
    out = get_advantage("gae")(inputs, gamma=0.9, lam=0.5, whiten=False)
    assert torch.allclose(out.advantages, torch.tensor([[0.13, 0.0, 0.6]]), atol=1e-6)


def test_remax_by_hand():
    inputs = _inputs([1, 0, 1], [0, 0, 1], [1, 2, 1])
    inputs.baseline_rewards = torch.tensor([0.5, 0.5, 1.0])  # greedy rewards of prompt 0 (.5) and prompt 1 (1)
    out = get_advantage("remax")(inputs)
    assert out.advantages.tolist() == [[0.5, 0.0], [-0.5, -0.5], [0.0, 0.0]]


def test_estimators_missing_their_inputs_say_so():
    inputs = _inputs([1, 0], [0, 0], [1, 1])
    with pytest.raises(ValueError, match="gae needs critic values"):
        get_advantage("gae")(inputs)
    with pytest.raises(ValueError, match="remax needs baseline_rewards"):
        get_advantage("remax")(inputs)


def test_group_variance_is_syn_grpo_diversity():
    from vlrl.algos import group_variance

    # group 0: accuracies 1, 0 → population variance .25 (the maximum); group 1: 1, 1 → 0
    assert group_variance(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1])).tolist() == [0.25, 0.25, 0, 0]

