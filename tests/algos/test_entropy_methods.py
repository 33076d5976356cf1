import math

import pytest
import torch

from vlrl.algos import (
    PolicyLossInputs,
    clip_cov_selection,
    get_policy_loss,
    kl_cov_selection,
    token_covariance,
)
from vlrl.algos.entropy_methods import entropy_shaped_advantages

# The 6-token example (2 responses × 3 tokens, all valid):
#   Â      = [[ 2,    2,    2  ], [−1,   −1,   −1  ]]   mean .5  → centred [[ 1.5,  1.5,  1.5], [−1.5, −1.5, −1.5]]
#   log π  = [[−.5,  −1,   −3.5], [−4,   −1.5, −1.5]]   mean −2  → centred [[ 1.5,  1.0, −1.5], [−2.0,  .5,   .5 ]]
#   Cov_t  = product                                             = [[ 2.25, 1.5, −2.25], [ 3.0, −.75, −.75]]
# KL-Cov, fraction 1/3 → k = ⌊6/3⌋ = 2: the two largest, (1, 0) = 3.0 and (0, 0) = 2.25.
# Clip-Cov, band (1, 5): candidates (0, 0) = 2.25, (0, 1) = 1.5, (1, 0) = 3.0; k = 2 drawn among them.
#           band (1, 2.5): (1, 0) = 3.0 is above it → exactly (0, 0) and (0, 1).
ADV = torch.tensor([[2.0, 2.0, 2.0], [-1.0, -1.0, -1.0]])
LOGP = torch.tensor([[-0.5, -1.0, -3.5], [-4.0, -1.5, -1.5]])
COV = torch.tensor([[2.25, 1.5, -2.25], [3.0, -0.75, -0.75]])


def _inputs(old_shift=None, entropy=None, advantages=ADV):
    logp = LOGP.clone().requires_grad_()
    old = LOGP.clone() if old_shift is None else LOGP - torch.tensor(old_shift)
    return PolicyLossInputs(logp=logp, old_logp=old, advantages=advantages, loss_mask=torch.ones(2, 3), entropy=entropy)


def test_token_covariance_of_the_6_token_example():
    assert torch.allclose(token_covariance(LOGP, ADV, torch.ones(2, 3)), COV)
    # a masked token leaves the means and is never selectable: mask (1, 2) → means over 5 tokens
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    cov = token_covariance(LOGP, ADV, mask)
    assert cov[1, 2] == -torch.inf
    mean_a, mean_l = (6 - 2) / 5, (-0.5 - 1 - 3.5 - 4 - 1.5) / 5  # .8, −2.1
    assert cov[0, 0].item() == pytest.approx((-0.5 - mean_l) * (2 - mean_a))


def test_kl_cov_selects_the_top_k_covariances():
    selection = kl_cov_selection(COV, torch.ones(2, 3), fraction=1 / 3)
    assert selection.tolist() == [[True, False, False], [True, False, False]]
    # at least one token, even when ⌊fraction · N⌋ = 0; the single largest is (1, 0)
    assert kl_cov_selection(COV, torch.ones(2, 3), fraction=1e-4).tolist() == [[False] * 3, [True, False, False]]
    with pytest.raises(ValueError, match="fraction must lie in"):
        kl_cov_selection(COV, torch.ones(2, 3), fraction=1.5)


def test_clip_cov_draws_among_the_band():
    mask = torch.ones(2, 3)
    # band (1, 2.5): exactly two candidates, k = 2 → deterministic
    assert clip_cov_selection(COV, mask, fraction=1 / 3, low=1.0, high=2.5).tolist() == [[True, True, False], [False] * 3]
    # band (1, 5): three candidates, k = 2 drawn at random — always 2, always candidates, all three drawn over seeds
    seen = set()
    for seed in range(30):
        chosen = clip_cov_selection(COV, mask, fraction=1 / 3, generator=torch.Generator().manual_seed(seed))
        picked = {tuple(ij) for ij in chosen.nonzero().tolist()}
        assert len(picked) == 2 and picked <= {(0, 0), (0, 1), (1, 0)}
        seen |= picked
    assert seen == {(0, 0), (0, 1), (1, 0)}
    # the tokens the PPO clip already cut are not drawn: only (0, 1) is left, fewer than k
    exclude = torch.tensor([[True, False, False], [True, False, False]])
    assert clip_cov_selection(COV, mask, fraction=1 / 3, exclude=exclude).tolist() == [[False, True, False], [False] * 3]


def test_clip_cov_loss_detaches_the_selected_tokens():
    # r = 1 everywhere (π_θ = π_old): PPO loss −Â = [[−2, −2, −2], [1, 1, 1]]; band (1, 2.5) selects (0, 0), (0, 1)
    #   → L = [[0, 0, −2], [1, 1, 1]], gradient [[0, 0, −2], [1, 1, 1]]: the selected tokens get none
    inputs = _inputs()
    out = get_policy_loss("clip_cov")(inputs, clip_low=0.2, clip_high=0.2, fraction=1 / 3, cov_low=1.0, cov_high=2.5)
    assert out.per_token_loss.tolist() == [[0.0, 0.0, -2.0], [1.0, 1.0, 1.0]]
    assert out.metrics["clip_cov"].tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]
    out.per_token_loss.sum().backward()
    assert inputs.logp.grad.tolist() == [[0.0, 0.0, -2.0], [1.0, 1.0, 1.0]]


def test_clip_cov_skips_tokens_the_ppo_clip_already_cut():
    # token (0, 0): π_old = π_θ − .5 → r = e^.5 > 1.2 with Â > 0: the PPO clip cuts it (loss −1.2·2, no gradient),
    #   so Clip-Cov draws only (0, 1) from the band (1, 2.5); the covariance is of π_θ, unchanged
    inputs = _inputs(old_shift=[[0.5, 0, 0], [0, 0, 0]])
    out = get_policy_loss("clip_cov")(inputs, clip_low=0.2, clip_high=0.2, fraction=1 / 3, cov_low=1.0, cov_high=2.5)
    assert out.metrics["clip_cov"].tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]
    assert out.metrics["clip_high"].tolist() == [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert torch.allclose(out.per_token_loss, torch.tensor([[-2.4, 0.0, -2.0], [1.0, 1.0, 1.0]]))


def test_clip_cov_uses_a_given_selection():
    inputs = _inputs()
    inputs.cov_selection = torch.tensor([[False, False, True], [False, False, False]])
    out = get_policy_loss("clip_cov")(inputs)
    assert out.per_token_loss.tolist() == [[-2.0, -2.0, 0.0], [1.0, 1.0, 1.0]]
    inputs.cov_selection = torch.zeros(2, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="cov_selection has shape"):
        get_policy_loss("clip_cov")(inputs)


def test_kl_cov_loss_by_hand():
    # Δ = log π_θ − log π_old = [[.1, −.1, .1], [−.1, .1, .1]], r = e^Δ; selected (0, 0), (1, 0); β = 1; no clip
    #   L = −Â·r + β·|Δ|·sel:  row 0 [−2e^.1 + .1, −2e^−.1, −2e^.1] = [−2.110342, −1.809675, −2.210342]
    #                          row 1 [e^−.1 + .1, e^.1, e^.1]      = [ 1.004837,  1.105171,  1.105171]
    #   ∂L/∂log π = −Â·r + β·sign(Δ)·sel:  row 0 [−2e^.1 + 1, −2e^−.1, −2e^.1], row 1 [e^−.1 − 1, e^.1, e^.1]
    inputs = _inputs(old_shift=[[0.1, -0.1, 0.1], [-0.1, 0.1, 0.1]])
    out = get_policy_loss("kl_cov")(inputs, clip_low=0.2, clip_high=0.2, fraction=1 / 3, coef=1.0)
    e, f = math.exp(0.1), math.exp(-0.1)
    assert torch.allclose(out.per_token_loss, torch.tensor([[-2 * e + 0.1, -2 * f, -2 * e], [f + 0.1, e, e]]), atol=1e-6)
    assert out.metrics["kl_cov"].tolist() == [[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    out.per_token_loss.sum().backward()
    assert torch.allclose(inputs.logp.grad, torch.tensor([[-2 * e + 1, -2 * f, -2 * e], [f - 1, e, e]]), atol=1e-6)


def test_entropy_advantage_by_hand():
    # α = .4, κ = 2: Â = [1, 1, −1, 0], H = [.5, 3, 3, 2]: αH = [.2, 1.2, 1.2, .8], |Â|/κ = [.5, .5, .5, 0]
    #   ψ = [.2, .5, .5, 0] → Â′ = [1.2, 1.5, −.5, 0] (the sign kept, 0 stays 0)
    # r = 1: L = −Â′, ∂L/∂log π = −Â′, and no gradient reaches H (it is detached)
    entropy = torch.tensor([[0.5, 3.0, 3.0, 2.0]], requires_grad=True)
    logp = torch.tensor([[-1.0, -2.0, -0.5, -1.0]], requires_grad=True)
    inputs = PolicyLossInputs(logp=logp, old_logp=logp.detach().clone(), advantages=torch.tensor([[1.0, 1.0, -1.0, 0.0]]),
                              loss_mask=torch.ones(1, 4), entropy=entropy)
    out = get_policy_loss("entropy_advantage")(inputs, clip_low=0.2, clip_high=0.28)
    assert torch.allclose(out.per_token_loss, torch.tensor([[-1.2, -1.5, 0.5, 0.0]]))
    assert torch.allclose(out.metrics["entropy_adv"], torch.tensor([[0.2, 0.5, 0.5, 0.0]]))
    assert out.metrics["entropy_adv_capped"].tolist() == [[0.0, 1.0, 1.0, 1.0]]
    out.per_token_loss.sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1.2, -1.5, 0.5, 0.0]]))
    assert entropy.grad is None
    with pytest.raises(ValueError, match="kappa must be ≥ 1"):
        entropy_shaped_advantages(torch.ones(1, 1), torch.ones(1, 1), kappa=0.5)


def test_entropy_bonus_by_hand():
    # r = 1, Â = [1, −1], H = [2, .5], β = .1: L = −Â − βH = [−1.2, .95]; ∂L/∂H = −β (the bonus is trained),
    #   ∂L/∂log π = −Â
    entropy = torch.tensor([[2.0, 0.5]], requires_grad=True)
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    inputs = PolicyLossInputs(logp=logp, old_logp=logp.detach().clone(), advantages=torch.tensor([[1.0, -1.0]]),
                              loss_mask=torch.ones(1, 2), entropy=entropy)
    out = get_policy_loss("entropy_bonus")(inputs, coef=0.1)
    assert torch.allclose(out.per_token_loss, torch.tensor([[-1.2, 0.95]]))
    assert torch.allclose(out.metrics["entropy_bonus"], torch.tensor([[0.2, 0.05]]))
    out.per_token_loss.sum().backward()
    assert torch.allclose(entropy.grad, torch.tensor([[-0.1, -0.1]]))
    assert torch.allclose(logp.grad, torch.tensor([[-1.0, 1.0]]))
