"""The shared minibatch update: gradient accumulation over k micro-batches equals the one-big-batch gradient
for every aggregation mode; the update steps the optimizer once per minibatch and logs its statistics."""

import pytest
import torch

from vlrl.algos import AGGREGATIONS, get_policy_loss, normaliser_for
from vlrl.config import RLStage
from vlrl.data import generate
from vlrl.models import load_policy
from vlrl.rewards import score_trajectories
from vlrl.rollout import HFEngine, SamplingParams
from vlrl.train.batch import build_algorithm, prepare_batch
from vlrl.train.common import make_optimizer
from vlrl.train.update import UpdateSettings, minibatch_gradient, ppo_update

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def rollout():
    """A tiny policy and 2 prompts × 3 sampled responses of different lengths, scored (shared by the module)."""
    policy = load_policy("tiny-qwen2-vl")
    torch.manual_seed(0)
    engine = HFEngine(policy)
    samples = generate("shapes", 2, tasks=["count", "color"])
    trajectories = engine.generate([engine.encode(s) for s in samples], SamplingParams(n=3, max_new_tokens=6))
    score_trajectories(trajectories)
    for k, t in enumerate(trajectories):  # distinct rewards (every advantage non-zero) and lengths 2..6
        n = 2 + k % 5
        t.response_ids, t.loss_mask, t.behaviour_logp = t.response_ids[:n], t.loss_mask[:n], t.behaviour_logp[:n]
        t.reward = 0.1 * k
    return policy, trajectories


def _settings(mode, micro, **changes):
    options = dict(loss_fn=get_policy_loss("ppo_clip"), loss_agg=mode, kl_coef=0.0, kl_estimator="k3",
                   temperature=1.0, micro_batch_size=micro, minibatches=1, ppo_epochs=1, grad_clip=1.0)
    options.update(changes)
    return UpdateSettings(**options)


def _batch(policy, trajectories, **train):
    stage = RLStage.model_validate({"rollout": {"n": 3}, "train": {"prompts_per_step": 2, **train}})
    algorithm = build_algorithm(stage, policy, apply_behaviour_weight=False)
    return prepare_batch(algorithm, policy, trajectories, step=0, max_new_tokens=6)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_accumulation_and_rank_shards_equal_one_big_batch(rollout, mode):
    """Σ over micro-batches of ∇ aggregate(micro, N_global) = ∇ aggregate(batch): for micro-batches of 4 + 2
    rows, and for the rows split as two data-parallel ranks would (each with the all-reduced normaliser; their
    sum is the all-reduce). Micro-batches pad to their own longest prompt/response; the gradient must not
    notice (the normaliser, not the padding, decides every token's weight)."""
    policy, trajectories = rollout
    batch = _batch(policy, trajectories)
    assert len(set(batch.loss_mask.sum(-1).tolist())) > 1  # responses of different lengths
    normaliser = normaliser_for(mode, batch.loss_mask, max_length=8)  # the constant L of seq_mean_token_sum_norm
    full = minibatch_gradient(policy, batch, range(6), _settings(mode, 6), normaliser=normaliser)
    assert max(float(g.abs().max()) for g in full.values()) > 1e-4  # a real gradient
    micro = minibatch_gradient(policy, batch, range(6), _settings(mode, 4), normaliser=normaliser)
    rank0 = minibatch_gradient(policy, batch, [0, 2, 4], _settings(mode, 6), normaliser=normaliser)
    rank1 = minibatch_gradient(policy, batch, [1, 3, 5], _settings(mode, 6), normaliser=normaliser)
    for name, g in full.items():
        assert torch.allclose(micro[name], g, rtol=1e-4, atol=1e-7), (mode, "micro-batches", name)
        assert torch.allclose(rank0[name] + rank1[name], g, rtol=1e-4, atol=1e-7), (mode, "ranks", name)


def test_update_steps_once_per_minibatch_and_logs_its_statistics(rollout):
    policy, trajectories = rollout
    batch = _batch(policy, trajectories, minibatches=2, ppo_epochs=2)  # π_old from one extra pass
    assert batch.old_logp is not None
    state = {k: v.clone() for k, v in policy.model.state_dict().items()}
    optimizer, scheduler = make_optimizer(policy.model, RLStage().optim)
    stats = ppo_update(policy, batch, _settings("token_mean", 2, minibatches=2, ppo_epochs=2), optimizer, scheduler,
                       seed=0, step=0)
    moved = any(not torch.equal(v, state[k]) for k, v in policy.model.state_dict().items())
    policy.model.load_state_dict(state)  # leave the module's policy as it was
    assert moved
    assert len(stats.values["policy/grad_norm"]) == 4  # 2 epochs × 2 minibatches
    assert len(stats.values["policy/loss"]) == 2 * 2 * 2  # each minibatch of 3 rows: micro-batches of 2 and 1
    metrics = stats.metrics()
    for key in ("policy/entropy", "policy/approx_kl_old", "policy/clip_low", "policy/clip_high", "policy/ratio",
                "policy/behaviour_weight_mean", "policy/behaviour_weight_max", "policy/behaviour_weight_capped_frac",
                "policy/logp_drift"):
        assert key in metrics, key
    assert not any(key.startswith("_") or "behaviour_weights" == key for key in stats.values)  # counters kept apart
    assert stats.drift_tokens > 0 and sum(len(w) for w in stats.behaviour_weights) == stats.drift_tokens  # all sampled now
    assert stats.values["policy/approx_kl_old"][0] < 1e-10  # the first micro-batch is on-policy (π_θ = π_old)
    assert stats.values["policy/approx_kl_old"][-1] > 1e-8  # the last one is not: the weights moved 3 times


def test_the_critic_regresses_on_the_returns_and_leaves_the_policy_alone(rollout):
    """gae's critic: zero head → V ≡ 0 at first (Â = returns); a few steps of the clipped value loss move V
    toward the returns; the policy's weights (whose backbone the critic copied) do not change."""
    policy, trajectories = rollout
    stage = RLStage.model_validate({"rollout": {"n": 3}, "train": {"prompts_per_step": 2},
                                    "algo": {"advantage": "gae", "advantage_options": {"whiten": False}},
                                    "critic": {"lr": 1e-3, "value_clip": 10.0}})
    algorithm = build_algorithm(stage, policy, apply_behaviour_weight=False)
    batch = prepare_batch(algorithm, policy, trajectories, step=0, max_new_tokens=6)
    assert batch.old_values.abs().max() == 0  # zero-initialised head
    assert torch.allclose(batch.advantages, batch.returns)  # γ = λ = 1, V = 0: Â_t = R_t = the reward
    policy_before = [p.detach().clone() for p in policy.model.parameters()]
    critic, losses = algorithm.critic, []
    for _ in range(8):
        stats = critic.accumulate(batch, range(6), micro_batch_size=6, loss_agg="token_mean",
                                  normaliser=float(batch.loss_mask.sum()))
        losses.append(stats["critic/value_loss"][0])
        critic.step()
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(torch.equal(p, b) for p, b in zip(policy.model.parameters(), policy_before, strict=True))
    assert critic.values(trajectories).shape == batch.loss_mask.shape


def test_padding_free_update_equals_the_padded_one(rollout):
    """train.padding_free packs each micro-batch into rows (per-sequence positions, no cross-attention): the
    π_old pass and the minibatch gradient equal the padded ones."""
    policy, trajectories = rollout
    padded = _batch(policy, trajectories, minibatches=2)
    packed = _batch(policy, trajectories, minibatches=2, padding_free=True)
    assert torch.allclose(packed.old_logp, padded.old_logp, atol=1e-5)
    normaliser = normaliser_for("token_mean", padded.loss_mask)
    reference = minibatch_gradient(policy, padded, range(6), _settings("token_mean", 4), normaliser=normaliser)
    free = minibatch_gradient(policy, padded, range(6), _settings("token_mean", 4, padding_free=True), normaliser=normaliser)
    assert max(float(g.abs().max()) for g in reference.values()) > 1e-4
    for name, g in reference.items():
        assert torch.allclose(free[name], g, rtol=1e-4, atol=1e-6), name


def test_skipping_zero_advantage_rows_leaves_the_update_unchanged(rollout):
    """train.skip_zero_advantage: rows whose advantages are all 0 are left out of the forward/backward, the
    normaliser still counts them, so the weights after two optimizer steps are those of the full update."""
    policy, trajectories = rollout
    batch = _batch(policy, trajectories, minibatches=2)
    batch.advantages[[1, 4]] = 0.0  # two rows with nothing to learn (one in each minibatch or both in one)
    state = {k: v.clone() for k, v in policy.model.state_dict().items()}
    after, skipped = [], []
    for skip in (False, True):
        policy.model.load_state_dict(state)
        optimizer, scheduler = make_optimizer(policy.model, RLStage().optim)
        stats = ppo_update(policy, batch, _settings("token_mean", 2, minibatches=2, skip_zero_advantage=skip),
                           optimizer, scheduler, seed=0, step=0)
        after.append({k: v.clone() for k, v in policy.model.state_dict().items()})
        skipped.append(sum(stats.values["policy/skipped_rows_frac"]))
    policy.model.load_state_dict(state)
    assert skipped[0] == 0 and skipped[1] == pytest.approx(2 / 3)  # 2 of 6 rows over 2 minibatches of 3
    assert any(not torch.equal(after[0][k], state[k]) for k in state)
    for name, value in after[0].items():
        assert torch.allclose(after[1][name], value, rtol=1e-4, atol=1e-6), name


def test_skip_zero_advantage_refuses_a_loss_that_is_not_zero_there(rollout, monkeypatch):
    from vlrl.algos.losses import POLICY_LOSSES, LossOutput

    def with_bonus(inputs, *, clip_low=0.2, clip_high=0.2):  # an entropy-style term: not 0 at Â = 0
        return LossOutput(per_token_loss=-inputs.advantages * inputs.logp + 0.01 * inputs.logp, metrics={})

    policy, _ = rollout
    monkeypatch.setitem(POLICY_LOSSES._entries, "test_bonus", with_bonus)  # registered for this test only
    stage = RLStage.model_validate({"algo": {"policy_loss": "test_bonus"}, "train": {"skip_zero_advantage": True}})
    with pytest.raises(ValueError, match="train.skip_zero_advantage.*test_bonus"):
        build_algorithm(stage, policy, apply_behaviour_weight=False)
    stage.train.skip_zero_advantage = False
    build_algorithm(stage, policy, apply_behaviour_weight=False)  # fine without the option
    from vlrl.algos import policy_loss_needs

    for name in [n for n in POLICY_LOSSES.names() if n != "test_bonus"]:
        stage = RLStage.model_validate({"algo": {"policy_loss": name}, "train": {"skip_zero_advantage": True}})
        if "entropy" in policy_loss_needs(POLICY_LOSSES.get(name)):  # the probe has no entropy yet (issue 25, phase 2)
            with pytest.raises(ValueError, match="needs entropy"):
                build_algorithm(stage, policy, apply_behaviour_weight=False)
        elif name == "kl_cov":  # β·|Δ| on its selected tokens: not 0 at Â = 0 (tests/algos/test_losses.py)
            with pytest.raises(ValueError, match="train.skip_zero_advantage"):
                build_algorithm(stage, policy, apply_behaviour_weight=False)
        else:  # every other registered loss is 0 at Â = 0
            build_algorithm(stage, policy, apply_behaviour_weight=False)
