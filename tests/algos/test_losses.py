import math

import pytest
import torch

from vlrl.algos import (
    POLICY_LOSSES,
    PolicyLossInputs,
    aggregate,
    get_policy_loss,
    kl_estimate,
    normaliser_for,
)


def _inputs(logp, old, adv, mask=None):
    logp = torch.tensor(logp, requires_grad=True)
    return PolicyLossInputs(logp=logp, old_logp=torch.tensor(old), advantages=torch.tensor(adv),
                            loss_mask=torch.ones_like(logp) if mask is None else torch.tensor(mask))


def test_ppo_clip_by_hand():
    # ratios: e^0.5 = 1.6487 (A=+1: clipped at 1.28 → loss −1.28, no gradient),
    #         e^-0.5 = .6065 (A=−1: clipped at .8 → loss max(.6065, .8) = .8, no gradient),
    #         e^0.1 = 1.1052 (A=+2: inside → loss −2.2103, gradient −2·1.1052)
    inputs = _inputs([[0.5, -0.5, 0.1]], [[0.0, 0.0, 0.0]], [[1.0, -1.0, 2.0]])
    out = get_policy_loss("ppo_clip")(inputs, clip_low=0.2, clip_high=0.28)
    assert torch.allclose(out.per_token_loss, torch.tensor([[-1.28, 0.8, -2 * math.exp(0.1)]]), atol=1e-4)
    assert out.metrics["clip_high"].tolist() == [[1.0, 0.0, 0.0]]
    assert out.metrics["clip_low"].tolist() == [[0.0, 1.0, 0.0]]
    out.per_token_loss.sum().backward()
    assert torch.allclose(inputs.logp.grad, torch.tensor([[0.0, 0.0, -2 * math.exp(0.1)]]), atol=1e-4)


def test_ppo_clip_on_policy_gradient_is_minus_advantage():
    inputs = _inputs([[-1.0, -2.0]], [[-1.0, -2.0]], [[0.5, -0.25]])
    get_policy_loss("ppo_clip")(inputs).per_token_loss.sum().backward()
    assert torch.allclose(inputs.logp.grad, torch.tensor([[-0.5, 0.25]]))


def test_aggregation_modes_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert aggregate(loss, mask, "token_mean").item() == pytest.approx(10 / 4)
    assert aggregate(loss, mask, "seq_mean_token_mean").item() == pytest.approx((6 / 3 + 4 / 1) / 2)
    assert aggregate(loss, mask, "seq_mean_token_sum").item() == pytest.approx(10 / 2)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate(loss, mask, "mean")


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_micro_batches_with_global_normaliser_equal_one_big_batch(mode):
    torch.manual_seed(0)
    per_token = torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.3).float()
    mask[:, 0] = 1
    full = aggregate(per_token, mask, mode)
    normaliser = normaliser_for(mode, mask)
    parts = sum(aggregate(per_token[i : i + 2], mask[i : i + 2], mode, normaliser=normaliser) for i in range(0, 6, 2))
    assert parts.item() == pytest.approx(full.item(), rel=1e-6)


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])  # δ = ref − logp = −0.5
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.125)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(math.exp(-0.5) + 0.5 - 1)
    assert kl_estimate(logp, logp, "k3").item() == 0.0
    with pytest.raises(ValueError):
        kl_estimate(logp, ref, "k9")


def test_every_policy_loss_runs_on_a_fake_batch():
    for name, fn in POLICY_LOSSES.items():
        inputs = _inputs([[-1.0, -0.5]], [[-1.1, -0.4]], [[1.0, -1.0]])
        inputs.behaviour_logp = torch.tensor([[-1.2, -0.4]])
        out = fn(inputs, clip_low=0.2, clip_high=0.28)
        assert out.per_token_loss.shape == (1, 2), name
        out.per_token_loss.sum().backward()
        assert inputs.logp.grad is not None and torch.isfinite(inputs.logp.grad).all(), name


def test_dual_clip_by_hand():
    # A = −1, r = e^1.5 = 4.4817: PPO clip gives max(4.4817, 1.28) = 4.4817 > c·(−A) = 3 → 3, no gradient
    # A = −1, r = e^0.1 = 1.1052: 1.1052 < 3 → unchanged, gradient −A·r = 1.1052
    # A = +1, r = e^1.5: clipped at 1 + ε_high → −1.28 (the dual clip only bounds negative advantages)
    inputs = _inputs([[1.5, 0.1, 1.5]], [[0.0, 0.0, 0.0]], [[-1.0, -1.0, 1.0]])
    out = get_policy_loss("dual_clip")(inputs, clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0)
    assert torch.allclose(out.per_token_loss, torch.tensor([[3.0, math.exp(0.1), -1.28]]), atol=1e-4)
    assert out.metrics["clip_dual"].tolist() == [[1.0, 0.0, 0.0]]
    out.per_token_loss.sum().backward()
    assert torch.allclose(inputs.logp.grad, torch.tensor([[0.0, math.exp(0.1), 0.0]]), atol=1e-4)
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        get_policy_loss("dual_clip")(inputs, clip_ratio_c=1.0)


def test_decoupled_by_hand():
    # π_prox − π_behave = 0 − (−0.5) → w = e^0.5 = 1.6487; r = e^0.1 = 1.1052 (inside the clip), A = 1
    #   → L = −w·r = −1.8221, ∂L/∂logp = −w·r
    # second token: π_behave = −2 → e^2 = 7.39 > cap 5 → w = 5 (capped); r = 1, A = −1 → L = 5·1 = 5, grad 5
    inputs = _inputs([[0.1, 0.0]], [[0.0, 0.0]], [[1.0, -1.0]])
    inputs.behaviour_logp = torch.tensor([[-0.5, -2.0]])
    out = get_policy_loss("decoupled")(inputs, clip_low=0.2, clip_high=0.28, cap=5.0)
    w_r = math.exp(0.5) * math.exp(0.1)
    assert torch.allclose(out.per_token_loss, torch.tensor([[-w_r, 5.0]]), atol=1e-4)
    assert out.metrics["behaviour_weight_capped"].tolist() == [[0.0, 1.0]]
    out.per_token_loss.sum().backward()
    assert torch.allclose(inputs.logp.grad, torch.tensor([[-w_r, 5.0]]), atol=1e-4)
    with pytest.raises(ValueError, match="needs behaviour_logp"):
        get_policy_loss("decoupled")(_inputs([[0.0]], [[0.0]], [[1.0]]))


def test_decoupled_equals_ppo_clip_on_policy():
    """π_behave = π_prox (synchronous, fresh samples): w = 1 and the decoupled loss is PPO clip."""
    inputs = _inputs([[0.3, -0.2]], [[0.0, 0.1]], [[1.0, -0.5]])
    inputs.behaviour_logp = inputs.old_logp.clone()
    a = get_policy_loss("decoupled")(inputs, clip_low=0.2, clip_high=0.28).per_token_loss
    b = get_policy_loss("ppo_clip")(inputs, clip_low=0.2, clip_high=0.28).per_token_loss
    assert torch.equal(a, b)


def test_which_losses_apply_the_behaviour_weight_themselves():
    import functools

    from vlrl.algos import applies_behaviour_weight

    assert applies_behaviour_weight(get_policy_loss("decoupled"))
    assert applies_behaviour_weight(functools.partial(get_policy_loss("decoupled"), cap=2.0))
    assert not applies_behaviour_weight(get_policy_loss("ppo_clip"))
    assert not applies_behaviour_weight(get_policy_loss("dual_clip"))


def test_value_loss_by_hand():
    from vlrl.algos import value_loss

    # token 0: V = 1, V_old = .5, R = 2: V_clip = .5 + clip(.5, ±.2) = .7; errors 1 and 1.69 → ½·1.69 = .845,
    #          the clipped branch wins → no gradient through V
    # token 1: V = .4, V_old = .5, R = 0: V_clip = .4 (inside); errors .16 = .16 → .08, gradient V − R = .4
    values = torch.tensor([[1.0, 0.4]], requires_grad=True)
    out = value_loss(values, torch.tensor([[0.5, 0.5]]), torch.tensor([[2.0, 0.0]]), clip=0.2)
    assert torch.allclose(out.per_token_loss, torch.tensor([[0.845, 0.08]]), atol=1e-6)
    assert out.metrics["value_clip"].tolist() == [[1.0, 0.0]]
    out.per_token_loss.sum().backward()
    assert torch.allclose(values.grad, torch.tensor([[0.0, 0.4]]), atol=1e-6)


def test_kl_reward_penalty_by_hand():
    from vlrl.algos import kl_reward_penalty

    # k1 = log π − log π_ref = .5 and −.5; β = .1 → rewards 0 − .05 and 1 + .05; no gradient into π
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    rewards, kl = kl_reward_penalty(torch.tensor([[0.0, 1.0]]), logp, torch.tensor([[-1.5, -0.5]]),
                                    torch.tensor([[1.0, 1.0]]), coef=0.1, kind="k1")
    assert torch.allclose(rewards, torch.tensor([[-0.05, 1.05]])) and torch.allclose(kl, torch.tensor([[0.5, -0.5]]))
    assert not rewards.requires_grad
    # masked tokens get no penalty
    rewards, _ = kl_reward_penalty(torch.zeros(1, 2), logp, torch.tensor([[-1.5, -0.5]]), torch.tensor([[1.0, 0.0]]),
                                   coef=1.0, kind="k2")
    assert torch.allclose(rewards, torch.tensor([[-0.125, 0.0]]))


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_gradients_by_hand(kind):
    # ∂/∂logp at δ = ref − logp = −.5:  k1 = logp − ref → 1;  k2 = ½δ² → −δ = .5;  k3 = e^δ − δ − 1 → 1 − e^δ = .3935
    logp = torch.tensor([-1.0], requires_grad=True)
    kl_estimate(logp, torch.tensor([-1.5]), kind).sum().backward()
    expected = {"k1": 1.0, "k2": 0.5, "k3": 1 - math.exp(-0.5)}[kind]
    assert logp.grad.item() == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("name", ["ppo_clip", "dual_clip", "decoupled"])
def test_on_policy_gradient_of_every_loss_is_minus_advantage(name):
    """At π_θ = π_old = π_behave every loss is the policy gradient: ∂L_t/∂log π_θ(t) = −A_t (r = w = 1, no clip
    active), and nothing flows into the constants (π_old, π_behave, Â are built without grad)."""
    logp = torch.tensor([[-1.0, -0.5, -2.0]], requires_grad=True)
    constant = logp.detach().clone()
    inputs = PolicyLossInputs(logp=logp, old_logp=constant, advantages=torch.tensor([[1.0, -1.0, 0.5]]),
                              loss_mask=torch.ones(1, 3), behaviour_logp=constant)
    get_policy_loss(name)(inputs, clip_low=0.2, clip_high=0.28).per_token_loss.sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1.0, 1.0, -0.5]]))
