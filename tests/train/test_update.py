"""The shared minibatch update: gradient accumulation over k micro-batches equals the one-big-batch gradient
for every aggregation mode; the update steps the optimizer once per minibatch and logs its statistics."""

import dataclasses

import pytest
import torch

from vlrl.algos import AGGREGATIONS, get_policy_loss, normaliser_for
from vlrl.config import RLStage
from vlrl.data import generate
from vlrl.models import load_policy
from vlrl.rewards import score_trajectories
from vlrl.rollout import HFEngine, SamplingParams
from vlrl.train.batch import build_algorithm, prepare_batch, teacher_logprobs
from vlrl.train.common import make_optimizer
from vlrl.train.microbatch import by_count
from vlrl.train.update import UpdateSettings, minibatch_cov_selection, minibatch_gradient, ppo_update

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
    assert len(stats.values["policy/loss"]) == 4  # one per minibatch: the sum of its micro-batches (2 rows + 1)
    metrics = stats.metrics()
    for key in ("policy/entropy", "policy/approx_kl_old", "policy/clip_low", "policy/clip_high", "policy/ratio",
                "policy/behaviour_weight_mean", "policy/behaviour_weight_max", "policy/behaviour_weight_capped_frac",
                "policy/logp_drift", "rollout/logprob_diff_mean", "rollout/logprob_diff_max"):
        assert key in metrics, key
    assert metrics["rollout/logprob_diff_mean"] == metrics["policy/logp_drift"]
    assert metrics["rollout/logprob_diff_max"] >= metrics["rollout/logprob_diff_mean"] > 0  # (behaviour ≠ π_old here)
    assert not any(key.startswith("_") or "behaviour_weights" == key for key in stats.values)  # counters kept apart
    assert stats.drift_tokens > 0 and sum(len(w) for w in stats.behaviour_weights) == stats.drift_tokens  # all sampled now
    # per-token statistics are pooled over every trained token: 2 epochs × the batch's tokens
    assert stats.token_sums["policy/entropy"][1] == 2 * float(batch.loss_mask.sum())
    assert metrics["policy/approx_kl_old"] > 1e-8  # the weights moved between minibatches: π_θ ≠ π_old later on
    one = ppo_update(policy, batch, _settings("token_mean", 2), optimizer, scheduler, seed=0, step=0)
    policy.model.load_state_dict(state)
    assert one.metrics()["policy/approx_kl_old"] < 1e-10  # one minibatch: every micro-batch is on-policy (π_θ = π_old)


def test_logged_update_metrics_do_not_depend_on_the_micro_batch_size(rollout):
    """The logged loss is the minibatch's loss (Σ micro-batch losses, each over the minibatch's normaliser), and
    per-token statistics are token means over the batch: one micro-batch of 6 rows or three of 2 log the same
    numbers (before, the loss was a mean of partial losses — 1/k of the minibatch loss for k micro-batches)."""
    policy, trajectories = rollout
    batch = _batch(policy, trajectories)
    state = {k: v.clone() for k, v in policy.model.state_dict().items()}
    logged = []
    for micro in (6, 2):
        optimizer, scheduler = make_optimizer(policy.model, RLStage().optim)
        logged.append(ppo_update(policy, batch, _settings("token_mean", micro), optimizer, scheduler, seed=0,
                                 step=0).metrics())
        policy.model.load_state_dict(state)
    whole, split = logged
    assert abs(whole["policy/loss"]) > 1e-6
    for key in ("policy/loss", "policy/entropy", "policy/approx_kl_old", "policy/clip_low", "policy/ratio"):
        assert split[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-7), key


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
        stats = critic.accumulate(batch, by_count(range(6), 6), loss_agg="token_mean",
                                  normaliser=float(batch.loss_mask.sum()))
        losses.append(stats.values["critic/value_loss"][0])
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
        if name in ("entropy_bonus", "kl_cov"):  # −β·H and β·|Δ| on its selected tokens: not 0 at Â = 0
            with pytest.raises(ValueError, match="train.skip_zero_advantage"):
                build_algorithm(stage, policy, apply_behaviour_weight=False)
        else:  # every other registered loss is 0 at Â = 0 (entropy_advantage: ψ = min(α·H, 0) = 0; the probe
            build_algorithm(stage, policy, apply_behaviour_weight=False)  # hands it an entropy)
            assert "entropy" not in policy_loss_needs(POLICY_LOSSES.get(name)) or name == "entropy_advantage"


# --------------------------------------------------------------------------------- the issue-25 losses, wired
LOSSES = {  # loss → options making its own mechanism act on this 6-row batch (2+3+4+5+6+2 = 22 model tokens)
    "gspo": {}, "gspo_token": {}, "cispo": {}, "gmpo": {},
    "entropy_bonus": {"coef": 0.1}, "entropy_advantage": {"alpha": 0.4},
    # selection: k = ⌊0.2 · 22⌋ = 4 tokens (Clip-Cov: at most 4, among those with 0 < Cov_t < 5, at random)
    "clip_cov": {"fraction": 0.2, "cov_low": 0.0}, "kl_cov": {"fraction": 0.2},
}


def _loss_batch(policy, trajectories, name, **algo):
    stage = RLStage.model_validate({"rollout": {"n": 3}, "train": {"prompts_per_step": 2},
                                    "algo": {"policy_loss": name, "policy_loss_options": LOSSES[name], **algo}})
    algorithm = build_algorithm(stage, policy, apply_behaviour_weight=False)
    return algorithm.settings, prepare_batch(algorithm, policy, trajectories, step=0, max_new_tokens=6)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_new_losses_accumulate_and_shard_to_the_one_big_batch_gradient(rollout, name):
    """Each loss reached through config (build_algorithm) gives the one-big-batch gradient over micro-batches of
    4 + 2 rows and over two 'ranks' of 3 rows: entropy from the update's own forward pass (with its gradient),
    Clip-Cov / KL-Cov tokens selected once over the minibatch (`minibatch_cov_selection`) and sliced per
    micro-batch — their in-loss selection per micro-batch would not be the same tokens."""
    policy, trajectories = rollout
    settings, batch = _loss_batch(policy, trajectories, name, loss_agg="seq_mean_token_mean")
    # π_old ≠ π_θ (as at a later minibatch): ratios ≠ 1, so clips, KL-Cov's |Δ| and the weights all act
    old = teacher_logprobs(policy.model, policy, trajectories, 1.0)  # (6, R)
    batch.old_logp = old + 0.3 * torch.sin(torch.arange(old.numel(), dtype=old.dtype)).view_as(old)
    selection = minibatch_cov_selection(batch, list(range(6)), settings, generator=torch.Generator().manual_seed(0))
    if name in ("clip_cov", "kl_cov"):
        assert batch.old_logp is not None  # the selection reads π_old: prepare_batch made the extra pass
        assert int(batch.loss_mask.sum()) == 22
        k = int(selection.sum())  # over the whole minibatch: k = ⌊0.2 · 22⌋ = 4 (Clip-Cov: fewer if fewer qualify)
        assert k == 4 if name == "kl_cov" else 1 <= k <= 4, k
        assert not (selection & ~batch.loss_mask.bool()).any()
    else:
        assert selection is None
    normaliser = normaliser_for("seq_mean_token_mean", batch.loss_mask)
    at = lambda micro: dataclasses.replace(settings, micro_batch_size=micro)  # noqa: E731
    full = minibatch_gradient(policy, batch, range(6), at(6), normaliser=normaliser, cov_selection=selection)
    assert max(float(g.abs().max()) for g in full.values()) > 1e-4
    micro = minibatch_gradient(policy, batch, range(6), at(4), normaliser=normaliser, cov_selection=selection)
    rank0 = minibatch_gradient(policy, batch, [0, 2, 4], at(6), normaliser=normaliser, cov_selection=selection)
    rank1 = minibatch_gradient(policy, batch, [1, 3, 5], at(6), normaliser=normaliser, cov_selection=selection)
    for param, g in full.items():
        assert torch.allclose(micro[param], g, rtol=1e-4, atol=1e-7), (name, "micro-batches", param)
        assert torch.allclose(rank0[param] + rank1[param], g, rtol=1e-4, atol=1e-7), (name, "ranks", param)
    if name in ("entropy_bonus", "entropy_advantage", "clip_cov", "kl_cov"):  # the mechanism changes the gradient
        plain = _ppo_clip_gradient(policy, batch, settings, normaliser)
        assert any(not torch.allclose(plain[p], g, rtol=1e-3, atol=1e-6) for p, g in full.items()), name


def _ppo_clip_gradient(policy, batch, settings, normaliser):
    import functools

    plain = dataclasses.replace(settings, micro_batch_size=6, cov_selection=None,
                                loss_fn=functools.partial(get_policy_loss("ppo_clip"), clip_low=0.2, clip_high=0.28))
    return minibatch_gradient(policy, batch, range(6), plain, normaliser=normaliser)


def test_the_update_logs_each_losses_own_metric(rollout):
    """ppo_update with each loss logs policy/<its metric> — what the shipped presets' test looks for."""
    policy, trajectories = rollout
    own = {"gspo": "ratio", "cispo": "clip_high", "gmpo": "ratio", "entropy_bonus": "entropy_bonus",
           "entropy_advantage": "entropy_adv", "clip_cov": "clip_cov", "kl_cov": "kl_cov"}
    state = {k: v.clone() for k, v in policy.model.state_dict().items()}
    for name, metric in own.items():
        settings, batch = _loss_batch(policy, trajectories, name)
        optimizer, scheduler = make_optimizer(policy.model, RLStage().optim)
        metrics = ppo_update(policy, batch, settings, optimizer, scheduler, seed=0, step=0).metrics()
        policy.model.load_state_dict(state)
        assert f"policy/{metric}" in metrics, (name, sorted(metrics))
        if name in ("entropy_bonus", "entropy_advantage", "clip_cov", "kl_cov"):
            assert metrics[f"policy/{metric}"] > 0, (name, metrics[f"policy/{metric}"])


def test_tis_weights_multiply_the_loss_and_mis_leaves_the_normaliser(rollout):
    """algo.rollout_correction: with the sampler's log-probs off by δ_t = log π_old − log π_sampler ∈ {−1, 0, 0.5,
    1.5} (cycled over the tokens), TIS (C = 2) weights token t by min(e^δ_t, 2) = e^−1, 1, e^0.5, 2 — the
    gradient equals that of ppo_clip whose per-token loss is multiplied by exactly those weights; MIS (C = 2)
    removes the tokens with |δ_t| > log 2 = 0.693 (δ = −1, 1.5) from loss and normaliser."""
    import functools
    import math

    policy, trajectories = rollout
    old = teacher_logprobs(policy.model, policy, trajectories, 1.0)  # (6, R) π_old, the trainer's recomputation
    deltas = torch.tensor([-1.0, 0.0, 0.5, 1.5])
    shifted = []
    for i, t in enumerate(trajectories):
        n = len(t.response_ids)
        delta = deltas[(torch.arange(n) + i) % 4]
        shifted.append(dataclasses.replace(t, behaviour_logp=old[i, :n] - delta))
    stage = RLStage.model_validate({"rollout": {"n": 3}, "train": {"prompts_per_step": 2},
                                    "algo": {"rollout_correction": {"tis_cap": 2.0}}})
    algorithm = build_algorithm(stage, policy, apply_behaviour_weight=False)
    batch = prepare_batch(algorithm, policy, shifted, step=0, max_new_tokens=6)
    mask = batch.loss_mask.bool()
    expected = torch.zeros_like(batch.loss_mask)
    for i, t in enumerate(shifted):
        n = len(t.response_ids)
        expected[i, :n] = torch.tensor([math.exp(-1), 1.0, math.exp(0.5), 2.0])[(torch.arange(n) + i) % 4]
    assert torch.allclose(batch.rollout_weights, expected * batch.loss_mask, atol=1e-5)
    clipped = float(((expected == 2.0) & mask).sum() / mask.sum())
    assert batch.metrics["policy/rollout_is_clipped_frac"] == pytest.approx(clipped)
    assert batch.metrics["policy/rollout_is_mean"] == pytest.approx(float(expected[mask].mean()), abs=1e-5)
    assert batch.metrics["policy/rollout_is_masked_frac"] == 0.0
    # the update uses those weights: its gradient is ppo_clip's with the per-token loss × expected weights
    normaliser = normaliser_for("token_mean", batch.loss_mask)
    corrected = minibatch_gradient(policy, batch, range(6), dataclasses.replace(algorithm.settings, micro_batch_size=4),
                                   normaliser=normaliser)
    ppo = functools.partial(get_policy_loss("ppo_clip"), clip_low=0.2, clip_high=0.28)

    weighted = []
    def reweighted(inputs):  # ppo_clip × the weights of the rows of this call (micro-batches of 6: all rows)
        out = ppo(inputs)
        out.per_token_loss = out.per_token_loss * expected[:, : inputs.logp.shape[1]]
        weighted.append(True)
        return out

    unweighted = dataclasses.replace(batch, rollout_weights=None)
    manual = minibatch_gradient(policy, unweighted, range(6), dataclasses.replace(algorithm.settings, loss_fn=reweighted,
                                micro_batch_size=6), normaliser=normaliser)
    plain = minibatch_gradient(policy, unweighted, range(6), dataclasses.replace(algorithm.settings, micro_batch_size=6),
                               normaliser=normaliser)
    assert weighted
    for param, g in manual.items():
        assert torch.allclose(corrected[param], g, rtol=1e-4, atol=1e-7), param
    assert any(not torch.allclose(plain[p], g, rtol=1e-3, atol=1e-6) for p, g in manual.items())
    # MIS: |δ| > log 2 leaves the loss mask, so the normaliser counts only the kept tokens
    stage = RLStage.model_validate({"rollout": {"n": 3}, "train": {"prompts_per_step": 2},
                                    "algo": {"rollout_correction": {"mis_cap": 2.0}}})
    algorithm = build_algorithm(stage, policy, apply_behaviour_weight=False)
    masked = prepare_batch(algorithm, policy, shifted, step=0, max_new_tokens=6)
    kept = mask & ((expected == 1.0) | ((expected - math.exp(0.5)).abs() < 1e-6))
    assert torch.equal(masked.loss_mask.bool(), kept) and masked.rollout_weights is None
    assert masked.metrics["policy/rollout_is_masked_frac"] == pytest.approx(1 - float(kept.sum() / mask.sum()))


def test_tis_together_with_the_behaviour_weight_is_refused(rollout):
    policy, _ = rollout
    stage = RLStage.model_validate({"algo": {"rollout_correction": {"tis_cap": 2.0}}})
    with pytest.raises(ValueError, match="count it twice"):
        build_algorithm(stage, policy, apply_behaviour_weight=True)  # the async recipe's weight
    build_algorithm(stage, policy, apply_behaviour_weight=False)
    stage.algo.rollout_correction.tis_cap, stage.algo.rollout_correction.mis_cap = None, 2.0
    build_algorithm(stage, policy, apply_behaviour_weight=True)  # MIS is a filter: fine with the weight


def test_behaviour_weight_mode_drop_zeroes_the_capped_tokens(rollout):
    """staleness.behaviour_weight_mode=drop: a token whose π_prox / π_behave exceeds the cap gets weight 0 (clamp:
    the cap); capped_frac counts it either way."""
    policy, trajectories = rollout
    settings, batch = _loss_batch(policy, trajectories, "clip_cov")  # a batch with π_old
    batch.behaviour_logp = batch.old_logp.clone()
    batch.behaviour_logp[0, 0] -= 10.0  # w = e^10 > 5 on one token
    out = {}
    for mode in ("clamp", "drop"):
        ppo = get_policy_loss("ppo_clip")
        s = dataclasses.replace(settings, loss_fn=ppo, apply_behaviour_weight=True, behaviour_weight_mode=mode,
                                micro_batch_size=6, cov_selection=None)
        optimizer, scheduler = make_optimizer(policy.model, RLStage().optim)
        state = {k: v.clone() for k, v in policy.model.state_dict().items()}
        out[mode] = ppo_update(policy, batch, s, optimizer, scheduler, seed=0, step=0).metrics()
        policy.model.load_state_dict(state)
    n = int(batch.loss_mask.sum())
    assert out["clamp"]["policy/behaviour_weight_max"] == pytest.approx(5.0)
    assert out["drop"]["policy/behaviour_weight_max"] == pytest.approx(1.0, abs=1e-4)  # the others are π_prox/π_prox
    for mode in out:
        assert out[mode]["policy/behaviour_weight_capped_frac"] == pytest.approx(1 / n)
    assert out["drop"]["policy/behaviour_weight_mean"] == pytest.approx((n - 1) / n, abs=1e-4)


def test_seq_mean_token_sum_norm_through_config_divides_by_the_generation_budget(rollout):
    """algo.loss_agg=seq_mean_token_sum_norm: L defaults to rollout.max_new_tokens (× max_turns) = 16, so the first
    (on-policy, same weights) loss is exactly seq_mean_token_sum's / 16; algo.loss_agg_max_length overrides L."""
    policy, trajectories = rollout
    losses = {}
    for agg, extra in (("seq_mean_token_sum", {}), ("seq_mean_token_sum_norm", {}),
                       ("seq_mean_token_sum_norm", {"loss_agg_max_length": 4})):
        stage = RLStage.model_validate({"rollout": {"n": 3, "max_new_tokens": 16}, "train": {"prompts_per_step": 2},
                                        "algo": {"loss_agg": agg, **extra}})
        algorithm = build_algorithm(stage, policy, apply_behaviour_weight=False)
        batch = prepare_batch(algorithm, policy, trajectories, step=0, max_new_tokens=6)
        state = {k: v.clone() for k, v in policy.model.state_dict().items()}
        optimizer, scheduler = make_optimizer(policy.model, RLStage().optim)
        stats = ppo_update(policy, batch, algorithm.settings, optimizer, scheduler, seed=0, step=0)
        policy.model.load_state_dict(state)
        losses[(agg, extra.get("loss_agg_max_length"))] = stats.values["policy/loss"][0]
    plain = losses[("seq_mean_token_sum", None)]
    assert abs(plain) > 1e-6
    assert losses[("seq_mean_token_sum_norm", None)] == pytest.approx(plain / 16, rel=1e-5)
    assert losses[("seq_mean_token_sum_norm", 4)] == pytest.approx(plain / 4, rel=1e-5)
