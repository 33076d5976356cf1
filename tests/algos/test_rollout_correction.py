import math

import pytest
import torch

from vlrl.algos import rollout_correction
from vlrl.algos.rollout_correction import mismatch_mask, rollout_log_ratio, truncated_is_weights

# log ρ_t = log π_old − log π_sampler on 2 responses (the last token of row 1 is padding):
#   row 0: [0, ln 3, −ln 4]  → ρ = [1, 3, .25]      Π ρ = .75       geometric mean .75^{1/3} = .9086
#   row 1: [.5, .5, (pad)]   → ρ = [1.6487, 1.6487]  Π ρ = e = 2.718 geometric mean e^{.5} = 1.6487
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
SAMPLER = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.5, -60.0]])  # the padding's value must not matter
TRAINER = SAMPLER + torch.tensor([[0.0, math.log(3), -math.log(4)], [0.5, 0.5, 0.0]])
E5 = math.exp(0.5)


def test_log_ratio_is_zero_at_padding_and_carries_no_gradient():
    trainer = TRAINER.clone().requires_grad_()
    log_ratio = rollout_log_ratio(trainer, SAMPLER, MASK)
    assert torch.allclose(log_ratio, torch.tensor([[0.0, math.log(3), -math.log(4)], [0.5, 0.5, 0.0]]), atol=1e-6)
    assert not log_ratio.requires_grad
    # a huge gap is clamped: e^20 at most, never inf
    assert rollout_log_ratio(torch.zeros(1, 1), torch.full((1, 1), -100.0), torch.ones(1, 1)).item() == 20.0


def test_token_tis_by_hand():
    # C = 2: w = [[1, min(3, 2) = 2, .25], [1.6487, 1.6487, 0 (pad)]]; 1 of 5 valid tokens truncated
    #   rollout_is_mean = (1 + 2 + .25 + 2 · 1.6487) / 5 = 1.30949
    out = rollout_correction(TRAINER, SAMPLER, MASK, tis_cap=2.0)
    assert torch.allclose(out.weights, torch.tensor([[1.0, 2.0, 0.25], [E5, E5, 0.0]]), atol=1e-6)
    assert torch.equal(out.loss_mask, MASK)  # TIS removes nothing
    assert out.metrics["rollout_is_mean"] == pytest.approx((3.25 + 2 * E5) / 5, rel=1e-6)
    assert out.metrics["rollout_is_clipped_frac"] == pytest.approx(1 / 5)
    assert out.metrics["rollout_is_masked_frac"] == 0.0


def test_sequence_tis_by_hand():
    # C = 2: row 0 min(.75, 2) = .75 on its 3 tokens; row 1 min(e, 2) = 2 on its 2 (both counted as truncated)
    weights = truncated_is_weights(rollout_log_ratio(TRAINER, SAMPLER, MASK), MASK, cap=2.0, level="sequence")
    assert torch.allclose(weights, torch.tensor([[0.75, 0.75, 0.75], [2.0, 2.0, 0.0]]), atol=1e-6)
    out = rollout_correction(TRAINER, SAMPLER, MASK, tis_cap=2.0, tis_level="sequence")
    assert out.metrics["rollout_is_clipped_frac"] == pytest.approx(2 / 5)


@pytest.mark.parametrize(("level", "kept", "masked_frac"), [
    # token: ρ ∈ [.5, 2] keeps (0, 0), (1, 0), (1, 1); 3 and .25 leave → 2 of 5 masked
    ("token", [[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]], 2 / 5),
    # sequence: Π ρ = .75 ∈ [.5, 2] keeps row 0; e > 2 rejects row 1 (2 tokens)
    ("sequence", [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]], 2 / 5),
    # geometric: .9086 and 1.6487 both inside → nothing rejected
    ("geometric", [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], 0.0),
])
def test_mis_by_hand(level, kept, masked_frac):
    mask = mismatch_mask(rollout_log_ratio(TRAINER, SAMPLER, MASK), MASK, cap=2.0, level=level)
    assert mask.float().tolist() == kept
    out = rollout_correction(TRAINER, SAMPLER, MASK, tis_cap=None, mis_cap=2.0, mis_level=level)
    assert out.loss_mask.tolist() == kept  # rejected tokens leave the loss mask, hence the normaliser
    assert out.weights.tolist() == kept  # no TIS: weight 1 on what is kept
    assert out.metrics["rollout_is_masked_frac"] == pytest.approx(masked_frac)
    assert out.metrics["rollout_is_mean"] == (1.0 if sum(map(sum, kept)) else 0.0)


def test_token_mis_with_tis_is_yao_et_al_mis():
    # MIS then TIS at the same C: the kept tokens have ρ ≤ C, so their weight is ρ itself — ρ · 𝟙[1/C ≤ ρ ≤ C]
    #   weights [[1, 0, 0], [1.6487, 1.6487, 0]]; none truncated; mean over the 3 kept = (1 + 2 · 1.6487) / 3 = 1.43248
    out = rollout_correction(TRAINER, SAMPLER, MASK, tis_cap=2.0, mis_cap=2.0)
    assert torch.allclose(out.weights, torch.tensor([[1.0, 0.0, 0.0], [E5, E5, 0.0]]), atol=1e-6)
    assert out.metrics["rollout_is_clipped_frac"] == 0.0
    assert out.metrics["rollout_is_masked_frac"] == pytest.approx(2 / 5)
    assert out.metrics["rollout_is_mean"] == pytest.approx((1 + 2 * E5) / 3, rel=1e-6)


def test_weights_are_constants_for_the_loss():
    trainer = TRAINER.clone().requires_grad_()
    out = rollout_correction(trainer, SAMPLER, MASK, tis_cap=2.0, mis_cap=2.0, mis_level="geometric")
    assert not out.weights.requires_grad and not out.loss_mask.requires_grad


def test_bad_settings_name_themselves():
    with pytest.raises(ValueError, match="TIS cap C must be > 1"):
        rollout_correction(TRAINER, SAMPLER, MASK, tis_cap=0.5)
    with pytest.raises(ValueError, match="unknown MIS level"):
        rollout_correction(TRAINER, SAMPLER, MASK, mis_cap=2.0, mis_level="row")
    with pytest.raises(ValueError, match="unknown TIS level"):
        rollout_correction(TRAINER, SAMPLER, MASK, tis_level="geometric")
