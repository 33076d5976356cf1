"""Syn-GRPO diversity reward (Eq. 4-6) and description selection (Eq. 8), on hand-worked numbers."""

import math

import pytest
import torch

from vlrl.algos.diversity import DiversityState, diversity_reward, group_diversity, select_descriptions

NAN = float("nan")


def test_group_diversity_is_four_times_the_population_variance():
    # group 0: 1, 0, 1, 0 → mean .5, var ¼ → V = 1
    # group 1: 1, 1, 1, 0 → mean .75, var (3 · .0625 + .5625) / 4 = .1875 → V = .75
    # group 2: 1, 1 → var 0 → V = 0
    accuracy = torch.tensor([1.0, 0, 1, 0, 1, 1, 1, 0, 1, 1])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2])
    assert group_diversity(accuracy, groups).tolist() == pytest.approx([1] * 4 + [0.75] * 4 + [0, 0])


def test_first_step_global_average_equals_batch_average_so_nothing_is_rescaled():
    accuracy = torch.tensor([1.0, 0, 1, 0, 1, 1, 1, 0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    predicted = torch.tensor([0.9, 0.5, 1.0, NAN, 0.75, 0.0, 1.0, 0.8])
    out = diversity_reward(accuracy, predicted, groups, DiversityState())
    # batch_avg = (1 + .75) / 2 = .875 = global_avg (V_1^global = V_1^batch) → Ṽ = V
    assert out.batch_avg == pytest.approx(0.875) and out.global_avg == pytest.approx(0.875)
    assert out.smoothed.tolist() == pytest.approx([1] * 4 + [0.75] * 4)
    # R = 1 − |v − Ṽ|: .9 → .9, .5 → .5, 1 → 1, NaN → 0 (unreadable); .75 → 1, 0 → .25, 1 → .75, .8 → .95
    assert out.reward.tolist() == pytest.approx([0.9, 0.5, 1.0, 0.0, 1.0, 0.25, 0.75, 0.95])
    assert out.state.global_avg == pytest.approx(0.875) and out.state.steps == 1
    assert out.state.last_reward == pytest.approx((0.9, 0.5, 1.0, 0.0, 1.0, 0.25, 0.75, 0.95))


def test_smoothing_rescales_by_the_ratio_of_the_ema_to_the_batch_average_and_clips():
    state = DiversityState(global_avg=0.875, steps=1)
    # group C: 1, 0, 0, 0 → var .1875 → V = .75;  group D: 0, 0, 0, 0 → V = 0
    accuracy = torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 0])
    groups = torch.tensor([5, 5, 5, 5, 9, 9, 9, 9])
    predicted = torch.tensor([0.2, 1.0, 0.6, 0.9, 0.0, 0.3, 1.0, 0.1])
    out = diversity_reward(accuracy, predicted, groups, state, gamma=0.7)
    # batch_avg = (.75 + 0) / 2 = .375; global = .7 · .875 + .3 · .375 = .6125 + .1125 = .725
    assert out.batch_avg == pytest.approx(0.375)
    assert out.global_avg == pytest.approx(0.725)
    # Ṽ_C = clip(.75 · .725 / .375 = 1.45, 0, 1) = 1;  Ṽ_D = 0
    assert out.smoothed.tolist() == pytest.approx([1.0] * 4 + [0.0] * 4)
    assert out.reward.tolist() == pytest.approx([0.2, 1.0, 0.6, 0.9, 1.0, 0.7, 0.0, 0.9])
    assert out.state.global_avg == pytest.approx(0.725) and out.state.steps == 2


def test_smoothing_below_one_scales_down():
    # global .2 (γ = .5 and previous .0): batch V: group 0 → 1 (1, 0), group 1 → 0 (1, 1): batch_avg .5
    # global = .5 · 0 + .5 · .5 = .25 → ratio .5 → Ṽ_0 = .5
    out = diversity_reward(torch.tensor([1.0, 0, 1, 1]), torch.tensor([0.5, 1.0, 0.0, 0.0]), torch.tensor([0, 0, 1, 1]),
                           DiversityState(global_avg=0.0, steps=3), gamma=0.5)
    assert out.global_avg == pytest.approx(0.25)
    assert out.smoothed.tolist() == pytest.approx([0.5, 0.5, 0.0, 0.0])
    assert out.reward.tolist() == pytest.approx([1.0, 0.5, 1.0, 1.0])


def test_without_smoothing_eq5_uses_the_raw_diversity_but_tracks_the_ema():
    out = diversity_reward(torch.tensor([1.0, 0, 0, 0]), torch.tensor([0.0, 0.0, 0.0, 0.0]), torch.tensor([0, 0, 1, 1]),
                           DiversityState(global_avg=0.1, steps=1), smoothing=False)
    assert out.smoothed.tolist() == pytest.approx([1.0, 1.0, 0.0, 0.0])  # V, not rescaled
    assert out.reward.tolist() == pytest.approx([0.0, 0.0, 1.0, 1.0])
    assert out.global_avg == pytest.approx(0.7 * 0.1 + 0.3 * 0.5)


def test_a_batch_without_any_diversity_gives_zero_targets_not_nan():
    out = diversity_reward(torch.ones(4), torch.tensor([0.0, 0.25, 1.0, NAN]), torch.tensor([0, 0, 1, 1]),
                           DiversityState(global_avg=0.6, steps=4))
    assert out.batch_avg == 0.0 and out.global_avg == pytest.approx(0.42)
    assert out.smoothed.tolist() == [0.0] * 4
    assert out.reward.tolist() == pytest.approx([1.0, 0.75, 0.0, 0.0])
    assert all(math.isfinite(v) for v in out.reward.tolist())


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="gamma"):
        diversity_reward(torch.ones(2), torch.ones(2), torch.zeros(2), DiversityState(), gamma=1.5)
    with pytest.raises(ValueError, match="same"):
        diversity_reward(torch.ones(2), torch.ones(3), torch.zeros(2), DiversityState())


def test_description_selection_is_the_argmax_of_the_diversity_reward_per_group():
    reward = torch.tensor([0.2, 0.9, 0.9, 0.1, 0.5, 0.99, 0.3])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    valid = torch.tensor([True, True, True, True, True, False, True])
    # group 0: .9 twice → the first (index 1); group 1: .99 has no description → .5 at index 4
    assert select_descriptions(reward, groups, valid) == {0: 1, 1: 4}
    assert select_descriptions(reward, groups, torch.zeros(7, dtype=torch.bool)) == {}


def test_the_syn_diversity_shaper_adds_r_diversity_to_the_rewards_and_keeps_its_state():
    from types import SimpleNamespace

    from vlrl.algos import RewardShapingInputs, get_reward_shaping

    # two groups of two: accuracies 1, 0 (V = 1) and 1, 1 (V = 0)
    texts = ["<diversity>0.8</diversity>", "<diversity>1</diversity>", "<diversity>0.25</diversity>", "garbage"]
    trajectories = [SimpleNamespace(response_text=text, reward_parts={"accuracy": acc})
                    for text, acc in zip(texts, [1.0, 0.0, 1.0, 1.0], strict=True)]
    shaper = get_reward_shaping("syn_diversity")
    inputs = RewardShapingInputs(rewards=torch.tensor([1.5, 0.0, 2.0, 2.0]), group_index=torch.tensor([0, 0, 1, 1]),
                                 response_length=torch.full((4,), 3), truncated=torch.zeros(4, dtype=torch.bool),
                                 max_new_tokens=8, trajectories=trajectories)
    out = shaper(inputs, weight=2.0)
    # R_div = 1 − |v − Ṽ|: .8, 1 | .75, 0 (unreadable) → r′ = r + 2 · R_div
    assert out.values.tolist() == pytest.approx([3.1, 2.0, 3.5, 2.0])
    assert out.metrics["v_batch"] == pytest.approx(0.5) and out.metrics["parsed_frac"] == pytest.approx(0.75)
    assert out.state.global_avg == pytest.approx(0.5) and out.state.last_reward == pytest.approx((0.8, 1.0, 0.75, 0.0))
    # the next step receives that state: the same batch again, γ = .5 → global = .5 · .5 + .5 · .5 = .5
    second = shaper(RewardShapingInputs(**{**inputs.__dict__, "state": out.state}), gamma=0.5, accuracy_part="nope")
    # with a missing accuracy part every R_acc is 0: V = 0 everywhere → Ṽ = 0, global = .5 · .5 + .5 · 0
    assert second.state.global_avg == pytest.approx(0.25) and second.state.steps == 2
    assert second.values.tolist() == pytest.approx([1.5 + 0.2, 0.0 + 0.0, 2.0 + 0.75, 2.0])
    with pytest.raises(ValueError, match="trajectories"):
        shaper(RewardShapingInputs(**{**inputs.__dict__, "trajectories": ()}))
