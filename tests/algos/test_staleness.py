import math

import pytest
import torch

from vlrl.algos.staleness import (
    StalenessError,
    assert_fresh,
    behaviour_weight_stats,
    behaviour_weights,
    fresh_mask,
    logp_drift,
    logp_drift_max,
    staleness,
    staleness_histogram,
)


def test_staleness_and_eta_filter():
    # trainer at version 5; samples from versions 5, 4, 1, 0 → s = 0, 1, 4, 5; η = 4 keeps the first three
    versions = torch.tensor([5, 4, 1, 0])
    assert staleness(versions, 5).tolist() == [0, 1, 4, 5]
    assert fresh_mask(versions, 5, eta=4).tolist() == [True, True, True, False]
    assert fresh_mask(versions, 5, eta=0).tolist() == [True, False, False, False]
    assert_fresh(versions[:3], 5, eta=4)  # no error
    with pytest.raises(StalenessError, match="sample 3 is 5 versions old"):
        assert_fresh(versions, 5, eta=4)


def test_future_version_is_a_tagging_error():
    with pytest.raises(StalenessError, match="mis-tagged"):
        staleness(torch.tensor([2, 7]), 6)


def test_behaviour_weights_by_hand():
    # Δ = log π_prox − log π_behave per token:
    #   row 0: Δ = 0 → w = 1;   Δ = ln 2 → w = 2;   Δ = −ln 4 → w = 0.25
    #   row 1: Δ = ln 10 → exp = 10, capped at 5;   Δ = 100 → capped at 5 (no overflow);   masked → 0
    behaviour = torch.tensor([[-1.0, -2.0, -1.0], [-3.0, -200.0, -1.0]])
    proximal = torch.tensor([[-1.0, -2.0 + math.log(2), -1.0 - math.log(4)], [-3.0 + math.log(10), -100.0, -0.5]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    w = behaviour_weights(proximal, behaviour, mask, cap=5.0)
    expected = torch.tensor([[1.0, 2.0, 0.25], [5.0, 5.0, 0.0]])
    assert torch.allclose(w, expected, atol=1e-5)
    stats = behaviour_weight_stats(w, mask, cap=5.0)
    # masked tokens: 1, 2, .25, 5, 5 → mean 13.25 / 5 = 2.65, max 5, capped 2 of 5
    assert stats["mean"].item() == pytest.approx(2.65, abs=1e-5)
    assert stats["max"].item() == pytest.approx(5.0)
    assert stats["capped_frac"].item() == pytest.approx(0.4)


def test_behaviour_weights_carry_no_gradient():
    proximal = torch.zeros(1, 2, requires_grad=True)
    w = behaviour_weights(proximal, torch.zeros(1, 2), torch.ones(1, 2))
    assert not w.requires_grad


def test_histogram_has_an_overflow_bin():
    # s = 0, 0, 1, 3, 7 with η = 2 → bins [s=0, s=1, s=2, s>2] = [2, 1, 0, 2]
    assert staleness_histogram(torch.tensor([0, 0, 1, 3, 7]), eta=2).tolist() == [2, 1, 0, 2]


def test_drift_only_on_same_version_rows():
    behaviour = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]])
    logp = torch.tensor([[-1.5, -1.0], [-9.0, -9.0]])
    mask = torch.tensor([[1, 1], [1, 1]])
    # only row 0 has s = 0: |−1 + 1.5| = 0.5, |−2 + 1| = 1 → mean 0.75 over 2 tokens; row 1 (stale) ignored
    drift, n = logp_drift(behaviour, logp, mask, torch.tensor([True, False]))
    assert drift.item() == pytest.approx(0.75) and n.item() == 2
    drift, n = logp_drift(behaviour, logp, mask, torch.tensor([False, False]))
    assert drift.item() == 0.0 and n.item() == 0
    # the max over the same tokens: 1 (row 0's second token); row 1's gap of 8 is stale, a masked token never counts
    assert logp_drift_max(behaviour, logp, mask, torch.tensor([True, False])).item() == pytest.approx(1.0)
    assert logp_drift_max(behaviour, logp, torch.tensor([[1, 0], [1, 1]]), torch.tensor([True, True])).item() == 8.0
    assert logp_drift_max(behaviour, logp, torch.tensor([[1, 0], [0, 0]]), torch.tensor([True, True])).item() == 0.5
    assert logp_drift_max(behaviour, logp, mask, torch.tensor([False, False])).item() == 0.0
