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
