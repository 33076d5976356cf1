"""The shared-prefix teacher-forced pass (`vlrl.train.shared_prefix`): one prefill per distinct prompt, its
keys/values expanded to its rows. For one preset of every family in `vlrl.models.presets.PRESETS`, with images:
π_old / π_ref log-probs equal the plain pass's (< 1e-5, fp32) with n ∈ {1, 4}; the update's loss and every
gradient equal the plain pass's (atol 1e-6) where it is used, and the families it refuses (recurrent layers)
fall back, logged once; multi-turn episodes share when their observations are text and fall back (exactly)
when an observation holds an image; `train.shared_prefix` reaches the pass through `vlrl rl` (its signature:
``perf/shared_prefix_frac`` in metrics.jsonl)."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch

# tests/ is on sys.path: the 3-turn episode with an image in turn 3; one preset per family, loaded once per session
from rollout.test_agent_training import ImageOnTurnThree
from rollout.test_decode import FAMILY_PRESETS, _policy, _samples
from vlrl.algos import get_policy_loss, normaliser_for
from vlrl.config import RLStage
from vlrl.models import kv_cache, shared_prefix
from vlrl.models.forward import PassLayout, score
from vlrl.models.shared_prefix import SHARED_METRIC, prompt_groups
from vlrl.models.traits import shared_prefix_refusal
from vlrl.rewards import score_trajectories
from vlrl.rollout import HFEngine, SamplingParams
from vlrl.rollout.agent import AgentSettings, multi_turn
from vlrl.train.batch import build_algorithm, prepare_batch
from vlrl.train.modules import gradient_checkpointing
from vlrl.train.update import UpdateSettings, accumulate

pytestmark = pytest.mark.usefixtures("one_thread")
LOGP_TOL = 1e-5
GRAD_TOL = 1e-6


def _rollout(policy, n: int, *, max_new_tokens: int = 8):
    """2 prompts × n responses of different lengths (2 ... 8 tokens), distinct rewards."""
    engine = HFEngine(policy)
    torch.manual_seed(1)
    trajectories = engine.generate([engine.encode(s) for s in _samples(policy, 2)],
                                   SamplingParams(n=n, temperature=0.9, max_new_tokens=max_new_tokens))
    for k, t in enumerate(trajectories):
        m = min(len(t.response_ids), 2 + (3 * k) % 7)
        t.response_ids, t.loss_mask, t.behaviour_logp = t.response_ids[:m], t.loss_mask[:m], t.behaviour_logp[:m]
        t.reward = 0.1 * k
    return trajectories


@pytest.fixture
def fresh_log(monkeypatch):
    monkeypatch.setattr(shared_prefix, "_LOGGED", set())


def _plain_and_shared(policy, trajectories, temperature=0.9):
    sums: dict[str, list[float]] = {}
    plain = score(policy.model, policy, trajectories, temperature)
    shared = score(policy.model, policy, trajectories, temperature, layout=PassLayout(shared_prefix=True), sums=sums)
    return plain, shared, sums[SHARED_METRIC]


@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("name", FAMILY_PRESETS)
def test_no_grad_pass_equals_the_plain_one(name, n, prefills):
    policy = _policy(name)
    trajectories = _rollout(policy, n)
    assert all(t.vision is not None for t in trajectories) == policy.is_vision
    prefills.clear()
    plain, shared, (shared_rows, rows) = _plain_and_shared(policy, trajectories)
    assert plain.shape == shared.shape == (2 * n, max(len(t.response_ids) for t in trajectories))
    assert float((plain - shared).abs().max()) < LOGP_TOL
    if n == 4:  # 2 distinct prompts prefilled once each for 8 rows
        assert prefills == [2] and (shared_rows, rows) == (8, 8)
    else:  # no two rows share a prompt: the plain pass, nothing prefilled
        assert prefills == [] and (shared_rows, rows) == (0, 2)


def _update_loss_and_gradients(policy, batch, rows, settings):
    policy.model.zero_grad(set_to_none=True)
    policy.model.train()
    normaliser = normaliser_for(settings.loss_agg, batch.loss_mask[rows])
    stats = accumulate(policy, batch, rows, settings, normaliser=normaliser)
    policy.model.eval()
    grads = {k: p.grad.detach().clone() for k, p in policy.model.named_parameters() if p.grad is not None}
    policy.model.zero_grad(set_to_none=True)
    return stats.values["policy/loss"][0], grads, stats.token_sums[SHARED_METRIC]


@pytest.mark.parametrize("name", FAMILY_PRESETS)
def test_update_loss_and_gradients_equal_the_plain_pass(name, caplog, fresh_log):
    """GRPO with a KL loss term (π_ref) and two epochs (π_old): prepare_batch's passes shared, then the update's
    forward + backward over micro-batches of 5 rows (the second holds 2 rows of one prompt and 1 of the other), with
    and without gradient checkpointing (train.gradient_checkpointing: the grouped forward's layers recomputed in the
    backward attend as in the forward)."""
    policy = _policy(name)
    trajectories = _rollout(policy, 4)
    score_trajectories(trajectories)
    for k, t in enumerate(trajectories):
        t.reward = 0.1 * k
    def batch_with(setting):
        stage = RLStage.model_validate({"rollout": {"n": 4, "temperature": 0.9}, "algo": {"kl_coef": 0.1},
                                        "train": {"prompts_per_step": 2, "ppo_epochs": 2, "shared_prefix": setting}})
        algorithm = build_algorithm(stage, policy, apply_behaviour_weight=False)
        assert algorithm.settings.shared_prefix == setting
        return prepare_batch(algorithm, policy, trajectories, step=0, max_new_tokens=8)

    batch, plain_batch = batch_with(True), batch_with(False)
    assert batch.token_sums[SHARED_METRIC] == [16.0, 16.0]  # π_old and π_ref, 8 rows each, shared
    assert plain_batch.token_sums[SHARED_METRIC] == [0.0, 16.0]
    assert float((batch.old_logp - plain_batch.old_logp).abs().max()) < LOGP_TOL
    assert float((batch.ref_logp - plain_batch.ref_logp).abs().max()) < LOGP_TOL
    settings = UpdateSettings(loss_fn=get_policy_loss("ppo_clip"), loss_agg="token_mean", kl_coef=0.1,
                              kl_estimator="k3", temperature=0.9, micro_batch_size=5, minibatches=1, ppo_epochs=1,
                              grad_clip=1.0)
    rows = list(range(8))
    with caplog.at_level(logging.WARNING, logger="vlrl.train.shared_prefix"):
        plain_loss, plain_grads, plain_count = _update_loss_and_gradients(policy, plain_batch, rows, settings)
        shared = dataclasses.replace(settings, shared_prefix=True)
        loss, grads, count = _update_loss_and_gradients(policy, plain_batch, rows, shared)
        _update_loss_and_gradients(policy, plain_batch, rows, shared)  # a second time: no second warning
        with gradient_checkpointing(policy.model, True):  # the shared pass under activation checkpointing
            ckpt_loss, ckpt_grads, ckpt_count = _update_loss_and_gradients(policy, plain_batch, rows, shared)
    assert plain_count == [0.0, 8.0]
    assert abs(plain_loss) > 1e-3 and max(float(g.abs().max()) for g in plain_grads.values()) > 1e-3  # real ones
    for what, (arm_loss, arm_grads) in {"shared": (loss, grads), "shared + checkpointing": (ckpt_loss, ckpt_grads)}.items():
        assert abs(arm_loss - plain_loss) < GRAD_TOL, what
        assert arm_grads.keys() == plain_grads.keys(), what
        for key, g in plain_grads.items():
            assert torch.allclose(arm_grads[key], g, rtol=0, atol=GRAD_TOL), (name, what, key,
                                                                               float((arm_grads[key] - g).abs().max()))
    refusal = shared_prefix_refusal(policy.model)
    warnings = [r.getMessage() for r in caplog.records if "does not share" in r.getMessage()]
    if refusal is None:  # micro-batches rows 0-4 (4 of prompt 0 + 1) and 5-7 (3 of prompt 1) both share
        assert count == ckpt_count == [8.0, 8.0] and warnings == []
    else:  # Qwen3.5's Gated DeltaNet: the plain pass, said once
        assert "linear_attention" in refusal and count == ckpt_count == [0.0, 8.0]
        assert len(warnings) == 1 and refusal in warnings[0]


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-gemma3", "tiny-qwen3.5"])
def test_multi_turn_shares_text_observations_and_falls_back_on_images(name, caplog, fresh_log):
    """Two turns (a text observation between them): the responses hold no vision token, so the group shares
    its prompt; three turns (an image in the turn-3 observation): its features would have to be fed to the
    response part, so the plain pass runs, logged once — exact both ways."""
    policy = _policy(name)
    engine = HFEngine(policy)
    requests = [engine.encode(s) for s in _samples(policy, 2)]
    sampling = SamplingParams(n=4, temperature=0.7, max_new_tokens=5)
    with caplog.at_level(logging.WARNING, logger="vlrl.train.shared_prefix"):
        for turns, shares in ((2, True), (3, False)):
            torch.manual_seed(2)
            episodes = multi_turn(engine, requests, sampling, agent=AgentSettings(env=ImageOnTurnThree, max_turns=turns))
            assert all(t.num_turns == turns for t in episodes)
            plain, shared, (shared_rows, rows) = _plain_and_shared(policy, episodes, 0.7)
            assert float((plain - shared).abs().max()) < LOGP_TOL
            assert shared_rows == (rows if shares else 0), turns
    warnings = [r.getMessage() for r in caplog.records if "holds vision tokens" in r.getMessage()]
    assert len(warnings) == 1


def test_prompt_groups_by_ids_and_vision_content():
    policy = _policy("tiny-qwen2-vl")
    engine = HFEngine(policy)
    a, b = _samples(policy, 2)
    ra, ra_again, rb = engine.encode(a), engine.encode(a), engine.encode(b)
    first, index = prompt_groups([ra.prompt_ids, rb.prompt_ids, ra_again.prompt_ids, torch.tensor(ra.prompt_ids)],
                                 [ra.vision, rb.vision, ra_again.vision, ra.vision])
    assert first == [0, 1] and index == [0, 1, 0, 0]
    other = ra.vision.to("cpu")  # equal tensors, another object: still the same prompt
    other.tensors["pixel_values"] = other.tensors["pixel_values"] + 1  # now a different image
    assert prompt_groups([ra.prompt_ids, ra.prompt_ids], [ra.vision, other]) == ([0, 1], [0, 1])


def test_a_cache_that_cannot_expand_falls_back_to_the_plain_pass(monkeypatch, prefills):
    from transformers.cache_utils import DynamicCache

    def broken(self, index):
        raise NotImplementedError("no reorder here")

    policy = _policy("tiny-qwen2-vl")
    trajectories = _rollout(policy, 3, max_new_tokens=4)
    monkeypatch.setattr(DynamicCache, "reorder_cache", broken)
    monkeypatch.setattr(kv_cache, "_NOT_EXPANDABLE", set())
    prefills.clear()
    plain, shared, (shared_rows, rows) = _plain_and_shared(policy, trajectories)
    assert prefills == [2] and (shared_rows, rows) == (0, 6)  # tried once, then the plain pass
    assert torch.equal(plain, shared)
    _, again, (shared_rows, _) = _plain_and_shared(policy, trajectories)
    assert prefills == [2] and shared_rows == 0 and torch.equal(plain, again)  # known now: not tried again


def test_refusals_name_what_stops_the_gradient_path():
    policy = _policy("tiny-qwen2-vl")
    assert shared_prefix_refusal(policy.model) is None
    dropout = torch.nn.Dropout(0.1)
    policy.model.add_module("extra_dropout", dropout)
    try:
        assert "dropout" in shared_prefix_refusal(policy.model)
    finally:
        del policy.model.extra_dropout
    assert "linear_attention" in shared_prefix_refusal(_policy("tiny-qwen3.5").model)


@pytest.mark.parametrize("setting, fraction", [("true", 1.0), ("false", 0.0)])
def test_vlrl_rl_logs_the_shared_prefix_fraction(tmp_path, tiny_vlm_dir, setting, fraction):
    """Through the door the user uses: `vlrl rl` with a shipped config; by default every teacher-forced row of
    the step (the update's micro-batches of whole groups) is scored against a shared prefill."""
    from typer.testing import CliRunner

    from vlrl.cli import app

    run = tmp_path / "run"
    result = CliRunner().invoke(app, [
        "rl", "--config", "configs/shapes_grpo.yaml", f"model.path={tiny_vlm_dir}", "train.steps=1",
        "train.prompts_per_step=2", "rollout.n=4", "rollout.max_new_tokens=4", "train.micro_batch_size=4",
        "data.n_train=8", "data.n_test=2", "eval.samples=1", "eval.max_new_tokens=4", "report.html=false",
        f"train.shared_prefix={setting}", f"out={run}"])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r["stage"] == "rl"]
    assert rl and rl[0][SHARED_METRIC] == fraction


def test_a_shuffled_minibatch_keeps_a_groups_rows_together():
    """ppo_update shuffles rows into minibatches; with the shared prefix their micro-batches are cut after the
    rows are ordered by prompt (stable: a prompt's rows keep their order)."""
    policy = _policy("tiny-qwen2-vl")
    trajectories = _rollout(policy, 3, max_new_tokens=2)  # rows 0-2: prompt 0, rows 3-5: prompt 1
    assert shared_prefix.rows_by_prompt(trajectories, [4, 0, 5, 2, 3, 1]) == [4, 5, 3, 0, 2, 1]


def test_ppo_update_with_shuffled_minibatches_equals_the_plain_one():
    """Two shuffled minibatches of 4 rows, micro-batches of 2, learning rate 1e-30 (the weights stay, so every
    minibatch is compared on the same weights): each minibatch's loss and gradient norm equal the plain pass's,
    and some micro-batches did share (a minibatch of 4 rows holds ≥ 2 rows of one of the 2 prompts)."""
    from vlrl.config import OptimConfig
    from vlrl.train.common import make_optimizer
    from vlrl.train.update import ppo_update

    policy = _policy("tiny-qwen2-vl")
    trajectories = _rollout(policy, 4)
    stage = RLStage.model_validate({"rollout": {"n": 4}, "train": {"prompts_per_step": 2}})
    batch = prepare_batch(build_algorithm(stage, policy, apply_behaviour_weight=False), policy, trajectories, step=0,
                          max_new_tokens=8)
    settings = UpdateSettings(loss_fn=get_policy_loss("ppo_clip"), loss_agg="token_mean", kl_coef=0.0,
                              kl_estimator="k3", temperature=1.0, micro_batch_size=2, minibatches=2, ppo_epochs=1,
                              grad_clip=1e9)
    runs = {}
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    for shared in (False, True):
        optimizer, scheduler = make_optimizer(policy.model, OptimConfig(lr=1e-30))  # moves a weight by ≤ ~1e-30
        runs[shared] = ppo_update(policy, batch, dataclasses.replace(settings, shared_prefix=shared), optimizer,
                                  scheduler, seed=0, step=0)
    assert all(float((v - before[k]).abs().max()) < 1e-20 for k, v in policy.model.state_dict().items())
    plain, shared = runs[False], runs[True]
    assert len(plain.values["policy/loss"]) == 2
    for key in ("policy/loss", "policy/grad_norm"):
        assert torch.allclose(torch.tensor(shared.values[key]), torch.tensor(plain.values[key]), rtol=1e-5, atol=GRAD_TOL)
    assert plain.token_sums[SHARED_METRIC] == [0.0, 8.0] and shared.token_sums[SHARED_METRIC][0] >= 4
