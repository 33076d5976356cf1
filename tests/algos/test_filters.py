import torch

from vlrl.algos import informative_groups, mask_truncated


def test_informative_groups_by_hand():
    # group 0: all 1 (all right) → dropped; group 1: all 0 (all wrong) → dropped; group 2: 1 and .5 → kept
    scores = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.5])
    keep = informative_groups(scores, torch.tensor([0, 0, 1, 1, 2, 2]))
    assert keep.tolist() == [False, False, False, False, True, True]
    # unordered group ids, a singleton (never informative), and a tolerance
    keep = informative_groups(torch.tensor([0.3, 0.5, 0.3, 0.30001]), torch.tensor([7, 2, 7, 7]), atol=1e-3)
    assert keep.tolist() == [False, False, False, False]


def test_mask_truncated_by_hand():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 1.0]])
    out = mask_truncated(mask, torch.tensor([False, True, False]))
    assert out.tolist() == [[1, 1, 0], [0, 0, 0], [1, 0, 1]]
