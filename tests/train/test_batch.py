"""The step's shared preparation: tensors, reward shaping → estimator → advantage shaping, selected by config."""

import math

import pytest
import torch

from vlrl.algos import ShapingOutput, register_advantage_shaping, register_reward_shaping
from vlrl.config import ConfigError, RLConfig, RLStage, load_config
from vlrl.rollout import Status
from vlrl.train.batch import batch_tensors, build_algorithm, prepare_batch

from .fakes import fake_trajectories


@register_reward_shaping("test_count_steps")
def _count_steps(inputs, *, bonus: float = 1.0):
    """Adds ``bonus`` × (number of previous calls) to every reward: shows the state threading through steps."""
    calls = 0 if inputs.state is None else inputs.state
    return ShapingOutput(values=inputs.rewards + bonus * calls, metrics={"calls": calls + 1}, state=calls + 1)


@register_advantage_shaping("test_double_first_token")
def _double_first_token(inputs):
    advantages = inputs.advantages.clone()
    advantages[:, 0] *= 2
    return ShapingOutput(values=advantages * inputs.loss_mask)


def _algorithm(**algo):
    return build_algorithm(RLStage.model_validate({"algo": algo}), None, apply_behaviour_weight=False)


def test_tensors_put_the_reward_on_the_last_model_token_and_mask_failed_responses():
    trajectories = fake_trajectories([1.0, 0.0, 0.5], [0, 0, 1], [3, 2, 4], masks=[[1, 1, 1], [1, 1], [1, 1, 0, 0]],
                                     statuses=[Status.COMPLETED, Status.FAILED, Status.TRUNCATED])
    tensors = batch_tensors(trajectories)
    assert tensors["loss_mask"].tolist() == [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 0, 0]]  # FAILED: no loss
    assert tensors["last_index"].tolist() == [2, 1, 1]  # row 2: tokens 2-3 are an observation (mask 0)
    assert tensors["truncated"].tolist() == [False, False, True]
    assert tensors["response_length"].tolist() == [3, 2, 2]  # model tokens only
    batch = prepare_batch(_algorithm(), None, trajectories, step=0, max_new_tokens=4)
    assert batch.token_rewards.tolist() == [[0, 0, 1, 0], [0, 0, 0, 0], [0, 0.5, 0, 0]]


def test_reward_shapers_run_in_config_order_with_their_state():
    # reward_scale: r' = (r − 0.5) × 10; then test_count_steps adds 2 × (previous calls): 0 at step 0, 2 at step 1
    algorithm = _algorithm(reward_shaping=[{"name": "reward_scale", "options": {"scale": 10, "bias": -0.5}},
                                           {"name": "test_count_steps", "options": {"bonus": 2.0}}])
    trajectories = fake_trajectories([1.0, 0.0, 0.0, 0.0], [0, 0, 1, 1], [2, 2, 2, 2])
    first = prepare_batch(algorithm, None, trajectories, step=0, max_new_tokens=4)
    assert first.rewards.tolist() == [5.0, -5.0, -5.0, -5.0]
    assert first.metrics == {"shaping/test_count_steps/calls": 1.0}
    second = prepare_batch(algorithm, None, trajectories, step=1, max_new_tokens=4)
    assert second.rewards.tolist() == [7.0, -3.0, -3.0, -3.0]
    # grpo on the shaped rewards: group 0 → ±1/std = ±0.7071 (unbiased std of ±5 is 7.071); group 1 → 0
    assert torch.allclose(second.advantages[:, 0], torch.tensor([0.7071, -0.7071, 0.0, 0.0]), atol=1e-4)


def test_advantage_shapers_rewrite_token_advantages():
    algorithm = _algorithm(advantage="grpo", advantage_options={"norm_by_std": False},
                           advantage_shaping=[{"name": "test_double_first_token"}])
    batch = prepare_batch(algorithm, None, fake_trajectories([1.0, 0.0], [0, 0], [2, 3]), step=0, max_new_tokens=4)
    # Â = r − mean = ±0.5 on every model token, then the first token doubled
    assert batch.advantages.tolist() == [[1.0, 0.5, 0.0], [-1.0, -0.5, -0.5]]


def test_a_shaper_of_the_wrong_shape_and_unknown_names_are_refused():
    @register_reward_shaping("test_bad_shape")
    def bad(inputs):
        return ShapingOutput(values=inputs.rewards[:1])

    algorithm = _algorithm(reward_shaping=[{"name": "test_bad_shape"}])
    with pytest.raises(ValueError, match="shaper 'test_bad_shape' returned shape"):
        prepare_batch(algorithm, None, fake_trajectories([1.0, 0.0], [0, 0], [2, 2]), step=0, max_new_tokens=4)
    with pytest.raises(KeyError, match="unknown reward shaping 'nope'"):
        _algorithm(reward_shaping=[{"name": "nope"}])
    with pytest.raises(ConfigError, match="algo.reward_shaping.0.name"):
        load_config(RLConfig, None, ["algo.reward_shaping=[{options: {}}]"])


def test_overlong_filtering_masks_truncated_responses_but_keeps_their_rewards_in_the_group():
    # group rewards 1, 0, .5 (the third truncated): dr_grpo mean .5 → Â = .5, −.5, 0 — and the truncated row's
    # tokens get no loss; without the filter its advantage would be 0 anyway, so use rewards where it is not:
    # 1, 0, 0 (third truncated): mean 1/3 → Â = 2/3, −1/3, −1/3 → masked: 2/3, −1/3, 0
    trajectories = fake_trajectories([1.0, 0.0, 0.0], [0, 0, 0], [2, 2, 2],
                                     statuses=[Status.COMPLETED, Status.COMPLETED, Status.TRUNCATED])
    plain = prepare_batch(_algorithm(advantage="dr_grpo"), None, trajectories, step=0, max_new_tokens=2)
    assert torch.allclose(plain.advantages[:, 0], torch.tensor([2 / 3, -1 / 3, -1 / 3]))
    filtered = prepare_batch(_algorithm(advantage="dr_grpo", mask_truncated=True), None, trajectories, step=0,
                             max_new_tokens=2)
    assert torch.allclose(filtered.advantages[:, 0], torch.tensor([2 / 3, -1 / 3, 0.0]))
    assert filtered.loss_mask.tolist() == [[1, 1], [1, 1], [0, 0]]


def test_an_estimator_needing_a_greedy_baseline_refuses_a_batch_without_one():
    with pytest.raises(ValueError, match="needs baseline_rewards"):
        prepare_batch(_algorithm(advantage="remax"), None, fake_trajectories([1.0, 0.0], [0, 0], [1, 1]), step=0,
                      max_new_tokens=2)
    batch = prepare_batch(_algorithm(advantage="remax"), None, fake_trajectories([1.0, 0.0], [0, 0], [1, 1]), step=0,
                          max_new_tokens=2, baseline_rewards=torch.tensor([1.0, 1.0]))
    assert batch.advantages[:, 0].tolist() == [0.0, -1.0]


def test_step_metrics_diversity_and_generation_probability():
    from vlrl.feed.groups import Draw, Group
    from vlrl.train.metrics import step_metrics
    from vlrl.train.update import UpdateStats

    # accuracies: group 0 → 1, 0 (V = .25), group 1 → 1, 1 (V = 0): batch mean V(q) = .125
    # behaviour log-probs are −1 per token → generation probability e^−1
    trajectories = fake_trajectories([1.0, 0.0, 1.0, 1.0], [0, 0, 1, 1], [2, 3, 1, 1], accuracy=[1, 0, 1, 1])
    batch = prepare_batch(_algorithm(), None, trajectories, step=0, max_new_tokens=3)
    groups = [Group(trajectories[:2], Draw(0, trajectories[0].sample, 3), [("s0", "number: timeout")]),
              Group(trajectories[2:], Draw(1, trajectories[2].sample, 4))]
    metrics = step_metrics(batch, UpdateStats(values={"policy/loss": [1.0, 3.0]}), groups)
    assert metrics["rollout/diversity"] == pytest.approx(0.125)
    assert metrics["rollout/gen_prob"] == pytest.approx(math.exp(-1))
    assert metrics["policy/zero_adv_groups_frac"] == 0.5 and metrics["policy/loss"] == 2.0
    assert metrics["response/length_mean"] == pytest.approx(7 / 4) and metrics["response/length_max"] == 3
    # accuracy from the verifiers' typed accuracy: 3 of 4 right; one reward failure; the latest draw's epoch
    assert metrics["accuracy/fake/task"] == 0.75 and metrics["reward/failures"] == 1 and metrics["data/epoch"] == 4
    assert not any(k.startswith("agent/") for k in metrics)  # single-turn: no agent metrics


def test_kl_coef_zero_builds_no_reference_and_runs_no_extra_pass():
    """kl_coef = 0 and one update per batch: no reference model, no π_old/π_ref pass — prepare_batch runs
    without a policy at all (any forward pass would fail on ``None``)."""
    algorithm = _algorithm(kl_coef=0.0)
    assert algorithm.reference is None and algorithm.critic is None
    batch = prepare_batch(algorithm, None, fake_trajectories([1.0, 0.0], [0, 0], [2, 2]), step=0, max_new_tokens=2)
    assert batch.old_logp is None and batch.ref_logp is None
    with pytest.raises(AttributeError):  # a KL term needs the reference: built from the policy
        _algorithm(kl_coef=0.1)
