"""Micro-batches by a token budget (`vlrl.train.microbatch`): the split's pieces on hand-worked numbers, and the
loss and gradients of a long-tail batch — one prompt with four images among short ones — equal to the count-based
split's at any budget, padded and packed, for every aggregation (fp32, 1e-6). The 2-rank cases (DDP, FSDP2) are in
test_distributed.py; the CLI's, by the split's own metrics, in `test_the_budget_through_vlrl_rl_and_vlrl_sft` below."""

import dataclasses
import logging

import pytest
import torch

from vlrl.algos import AGGREGATIONS, get_policy_loss
from vlrl.config import RLStage
from vlrl.data import generate
from vlrl.models import load_policy
from vlrl.rollout import HFEngine, SamplingParams
from vlrl.train.batch import build_algorithm, prepare_batch
from vlrl.train.common import make_optimizer
from vlrl.train.microbatch import (
    CostModel,
    MicroBatch,
    RowSize,
    balance,
    form,
    karmarkar_karp,
    lockstep,
    plan_ranks,
    rank_imbalance,
)
from vlrl.train.runtime import Runtime
from vlrl.train.update import UpdateSettings, accumulate, minibatches, ppo_update

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------------------------- the pieces
def test_karmarkar_karp_splits_into_equal_sums_and_keeps_every_row_once():
    # 8 7 6 5 4, differencing: 8−7 = 1; 6−5 = 1; 4−1 = 3; 3−1 = 2 → sums 16 / 14 ({8, 6} / {7, 5, 4}... as merged);
    # greedy "largest to the lightest part" gives 8+5+4 = 17 / 7+6 = 13 (the optimum, 15 / 15, is not LDM's)
    parts = karmarkar_karp({0: 8, 1: 7, 2: 6, 3: 5, 4: 4}, 2)
    assert sorted(sum({0: 8, 1: 7, 2: 6, 3: 5, 4: 4}[r] for r in p) for p in parts) == [14, 16]
    costs = {r: float((r * 37) % 11 + 1) for r in range(40)}
    parts = karmarkar_karp(costs, 3)
    assert sorted(r for p in parts for r in p) == list(range(40))
    sums = [sum(costs[r] for r in p) for p in parts]
    assert max(sums) - min(sums) <= max(costs.values())  # within one row of equal


def test_cost_model_counts_padding_patches_and_a_shared_prompt_once():
    a, b = RowSize(10, 2, 100, prompt_key="g"), RowSize(10, 6, 100, prompt_key="g")
    packed, padded = CostModel(0.5, padded=False), CostModel(0.5, padded=True)
    assert packed.row(a) == 10 + 2 + 50
    assert packed.micro([a, b]) == (12 + 16) + 0.5 * 200  # Σ tokens + w_v Σ patches
    assert padded.micro([a, b]) == 2 * (10 + 6) + 0.5 * 200  # every row as long as the longest
    shared = CostModel(0.5, padded=False, shared=True)
    assert shared.micro([a, b]) == 10 + 2 + 6 + 0.5 * 100  # the group's prompt (and image) once
    assert CostModel(0.5, padded=True, shared=True).micro([a, b]) == 1 * (10 + 8) + 50  # one row: prompt + responses


def test_form_keeps_the_budget_and_names_an_oversized_row_once(caplog):
    sizes = [RowSize(4, 4, name=f"s{k}") for k in range(6)] + [RowSize(40, 10, name="heavy")]
    cost = CostModel(padded=False)
    with caplog.at_level(logging.WARNING, logger="vlrl.train.microbatch"):
        bins = form(range(7), sizes.__getitem__, 24, cost)
        form(range(7), sizes.__getitem__, 24, cost)
    assert sorted(r for b in bins for r in b) == list(range(7))
    assert [6] in bins and all(cost.micro([sizes[r] for r in b]) <= 24 for b in bins if b != [6])
    assert len(bins) == 1 + 2  # six rows of 8 fill two micro-batches of 24; the heavy one alone
    assert [r.getMessage() for r in caplog.records].count(next(r.getMessage() for r in caplog.records)) == 1
    assert "heavy" in caplog.records[0].getMessage() and len(caplog.records) == 1


def test_lockstep_splits_the_largest_then_adds_no_op_micro_batches():
    sizes = [RowSize(1, 1)] * 3
    cost = CostModel(padded=False)
    out = lockstep([[0, 1, 2]], 2, sizes.__getitem__, cost, spare=0)
    assert len(out) == 2 and sorted(r for m in out for r in m.rows) == [0, 1, 2] and not any(m.noop for m in out)
    out = lockstep([[0], [1]], 4, sizes.__getitem__, cost, spare=1)
    assert [m.noop for m in out] == [False, False, True, True] and out[-1] == MicroBatch((1,), noop=True)


def test_plan_ranks_balances_a_long_tail_and_runs_in_lockstep():
    """Rank 0 drew the heavy rows: 4 of cost 100 and 4 of 10; rank 1 eight of 10. Count-based: 440 vs 80 (imbalance
    1.69); rebalanced: 260 / 260 (1.0); both ranks run the same number of micro-batches within the budget."""
    sizes = [RowSize(90, 10)] * 4 + [RowSize(5, 5)] * 12
    cost = CostModel(padded=False)
    held = [list(range(8)), list(range(8, 16))]
    assert rank_imbalance(held, lambda r: cost.row(sizes[r])) == pytest.approx(440 / 260)
    plan = plan_ranks(held, sizes.__getitem__, cost, budget=120)
    assert rank_imbalance(plan.rows, lambda r: cost.row(sizes[r])) == pytest.approx(1.0)
    assert len(plan.micro_batches[0]) == len(plan.micro_batches[1])
    assert sorted(r for rows in plan.rows for r in rows) == list(range(16))
    for micro in plan.micro_batches:
        assert all(cost.micro([sizes[r] for r in m.rows]) <= 120 for m in micro)
    assert balance(held, sizes.__getitem__, cost)[0][0] == 0  # the part with row 0 stays where row 0 is


# ----------------------------------------------------------------------------------------------- a long tail
@pytest.fixture(scope="module")
def long_tail():
    """tiny-qwen2-vl, 4 prompts × 2 responses: prompt 0 holds four images (a row ~2.2× the others' cost), responses
    cut to lengths 2..6, distinct rewards (every advantage ≠ 0)."""
    policy = load_policy("tiny-qwen2-vl")
    samples = generate("shapes", 4, tasks=["count", "color"])
    heavy = samples[0]
    heavy.images = [s.images[0] for s in generate("shapes", 4, tasks=["count"], split="test")]
    heavy.messages = [{"role": "user", "content": [{"type": "image"}] * 4 + heavy.messages[0]["content"][1:]}]
    engine = HFEngine(policy)
    torch.manual_seed(0)
    trajectories = engine.generate([engine.encode(s) for s in samples], SamplingParams(n=2, max_new_tokens=6))
    for k, t in enumerate(trajectories):
        n = 2 + k % 5
        t.response_ids, t.loss_mask, t.behaviour_logp = t.response_ids[:n], t.loss_mask[:n], t.behaviour_logp[:n]
        t.reward = 0.1 * k * (-1) ** k
    return policy, trajectories


def _settings(mode, **changes):
    options = dict(loss_fn=get_policy_loss("ppo_clip"), loss_agg=mode, kl_coef=0.0, kl_estimator="k3",
                   temperature=1.0, micro_batch_size=8, minibatches=1, ppo_epochs=1, grad_clip=1.0,
                   loss_agg_max_length=8)
    options.update(changes)
    return UpdateSettings(**options)


def _batch(policy, trajectories, **train):
    stage = RLStage.model_validate({"rollout": {"n": 2}, "train": {"prompts_per_step": 4, **train}})
    return prepare_batch(build_algorithm(stage, policy, apply_behaviour_weight=False), policy, trajectories, step=0,
                         max_new_tokens=6)


def _gradient(policy, batch, settings):
    """The first minibatch's gradient as `ppo_update` forms it (`minibatches`), and its micro-batches."""
    model = policy.model
    model.zero_grad(set_to_none=True)
    model.train()
    mb = next(minibatches(policy, batch, settings, Runtime.single(model), seed=0, step=0))
    stats = accumulate(policy, mb.batch, [], settings, normaliser=mb.normaliser, micro_batches=mb.micro_batches)
    model.eval()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads, mb, stats.metrics()["policy/loss"]


@pytest.mark.parametrize("padding_free", [False, True])
@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_budget_gives_the_count_based_loss_and_gradient(long_tail, mode, padding_free):
    """Budgets from "every row alone" to "all in one", padded and packed: the same loss and gradient as the
    count-based split (one micro-batch of 8), to 1e-6 in fp32; the micro-batches differ (their number and size)."""
    policy, trajectories = long_tail
    batch = _batch(policy, trajectories)
    reference, mb, loss = _gradient(policy, batch, _settings(mode, padding_free=padding_free))
    assert len(mb.micro_batches) == 1 and max(float(g.abs().max()) for g in reference.values()) > 1e-4
    counts = set()
    for budget in (1, 150, 300, 10_000):
        settings = _settings(mode, padding_free=padding_free, max_tokens_per_micro_batch=budget)
        grads, mb, budget_loss = _gradient(policy, batch, settings)
        counts.add(len(mb.micro_batches))
        assert mb.largest <= budget or all(len(m.rows) == 1 for m in mb.micro_batches), budget
        assert budget_loss == pytest.approx(loss, rel=1e-6, abs=1e-7), budget
        assert grads.keys() == reference.keys()
        for name, g in reference.items():
            torch.testing.assert_close(grads[name], g, rtol=0, atol=1e-6, msg=f"{budget} {name}")
    assert counts >= {8, 1} and len(counts) >= 3  # every row alone, …, all in one


def test_scoring_passes_by_budget_give_the_same_old_and_reference_log_probs(long_tail):
    """π_old (several minibatches) and π_ref (a KL term) in micro-batches of the budget: the whole-batch values."""
    policy, trajectories = long_tail
    train = {"minibatches": 2}
    whole = _batch(policy, trajectories, **train)
    stage = RLStage.model_validate({"rollout": {"n": 2}, "train": {"prompts_per_step": 4, **train,
                                                                   "max_tokens_per_micro_batch": 150},
                                    "algo": {"kl_coef": 0.1}})
    algorithm = build_algorithm(stage, policy, apply_behaviour_weight=False)
    budgeted = prepare_batch(algorithm, policy, trajectories, step=0, max_new_tokens=6)
    assert budgeted.old_logp is not None and budgeted.ref_logp is not None and whole.old_logp is not None
    torch.testing.assert_close(budgeted.old_logp, whole.old_logp, rtol=0, atol=1e-6)
    torch.testing.assert_close(budgeted.ref_logp, whole.old_logp, rtol=0, atol=1e-6)  # π_ref = π_θ before any step


def test_an_update_by_budget_steps_like_the_count_based_one_and_logs_its_split(long_tail):
    """`ppo_update` with 2 minibatches × 2 epochs: the weights after it and the logged loss equal the count-based
    update's; the log shows the split — more micro-batches, none over the budget."""
    policy, trajectories = long_tail
    batch = _batch(policy, trajectories, minibatches=2, ppo_epochs=2)
    state = {k: v.clone() for k, v in policy.model.state_dict().items()}
    out = {}
    for budget in (None, 250):
        settings = _settings("token_mean", minibatches=2, ppo_epochs=2, micro_batch_size=4,
                             max_tokens_per_micro_batch=budget)
        optimizer, scheduler = make_optimizer(policy.model, RLStage().optim)
        metrics = ppo_update(policy, batch, settings, optimizer, scheduler, seed=0, step=0).metrics()
        out[budget] = (metrics, {k: v.clone() for k, v in policy.model.state_dict().items()})
        policy.model.load_state_dict(state)
    (count, count_weights), (budget, budget_weights) = out[None], out[250]
    assert count["perf/micro_batches"] == 1 and budget["perf/micro_batches"] > 1
    assert budget["perf/micro_batch_cost_max"] <= 250 < count["perf/micro_batch_cost_max"]
    assert "perf/rank_imbalance" not in budget  # one process
    for key in ("policy/loss", "policy/entropy", "policy/grad_norm", "policy/clip_low"):
        assert budget[key] == pytest.approx(count[key], rel=1e-5, abs=1e-7), key
    for name, weight in count_weights.items():
        torch.testing.assert_close(budget_weights[name], weight, rtol=1e-3, atol=1e-5, msg=name)


def test_shared_prefix_keeps_a_groups_rows_in_one_micro_batch(long_tail):
    policy, trajectories = long_tail
    batch = _batch(policy, trajectories)
    settings = _settings("token_mean", shared_prefix=True, max_tokens_per_micro_batch=250)
    _, mb, _ = _gradient(policy, dataclasses.replace(batch), settings)
    groups = [{trajectories[r].group_index for r in m.rows} for m in mb.micro_batches]
    for g in range(4):  # every group's two rows sit in one micro-batch
        assert sum(g in groups_of for groups_of in groups) == 1


def test_the_budget_through_vlrl_rl_and_vlrl_sft(tmp_path, tiny_vlm_dir):
    """`vlrl rl` / `vlrl sft` with train.max_tokens_per_micro_batch: metrics.jsonl shows the split — several
    micro-batches, none costlier than the budget — where the same runs without it show one micro-batch over it."""
    import json

    from typer.testing import CliRunner

    from vlrl.cli import app

    common = [f"model.path={tiny_vlm_dir}", "data.n_train=8", "data.n_test=2", "train.steps=1", "eval.samples=1",
              "eval.max_new_tokens=2", "report.html=false", "check.enabled=false"]
    recipes = {"rl": ["train.prompts_per_step=2", "rollout.n=4", "rollout.max_new_tokens=4"],
               "sft": ["train.batch_size=8", "train.micro_batch_size=8"]}
    for recipe, options in recipes.items():
        logged = {}
        for budget in (None, 150):
            run = tmp_path / f"{recipe}_{budget}"
            extra = [f"train.max_tokens_per_micro_batch={budget}"] if budget else []
            result = CliRunner().invoke(app, [recipe, f"out={run}", *common, *options, *extra])
            assert result.exit_code == 0, result.output
            records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            logged[budget] = next(r for r in records if r.get("stage") == recipe and "perf/micro_batches" in r)
        assert logged[None]["perf/micro_batches"] == 1 and logged[None]["perf/micro_batch_cost_max"] > 150, recipe
        assert logged[150]["perf/micro_batches"] > 1 and logged[150]["perf/micro_batch_cost_max"] <= 150, recipe
