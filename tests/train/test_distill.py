"""On-policy distillation (``algo.distill``; `vlrl.algos.distill`, `vlrl.train.distill`): the sampled reverse KL in
closed form, the exactness of a teacher equal to the student (KL 0, GRPO's update), the refusal of a teacher with
another tokenizer, and OPD alone training where GRPO's advantages are all 0; the top-k estimator (a loss term) in
closed form, exact for a teacher equal to the student, the same in every pass layout, and through ``vlrl rl``."""

import math

import pytest
import torch

from vlrl.algos.distill import distill_advantages, sampled_reverse_kl, topk_reverse_kl
from vlrl.config import RLStage
from vlrl.data import generate
from vlrl.models import load_policy
from vlrl.models.logprobs import NO_MASS, rest_logprob
from vlrl.report import MetricsLogger
from vlrl.rollout import HFEngine, SamplingParams
from vlrl.train.batch import build_algorithm, prepare_batch
from vlrl.train.common import make_optimizer
from vlrl.train.loop import train_rl
from vlrl.train.update import minibatch_gradient, ppo_update

pytestmark = pytest.mark.usefixtures("one_thread")


def test_sampled_reverse_kl_and_the_advantage_in_closed_form():
    # student p = 0.5, teacher p = 0.25 on token 0: k = log 2; token 1 equal: k = 0; token 2 off the mask
    student = torch.log(torch.tensor([[0.5, 0.3, 0.9]]))
    teacher = torch.log(torch.tensor([[0.25, 0.3, 0.1]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    term = sampled_reverse_kl(student, teacher, mask)
    assert torch.allclose(term.reverse_kl, torch.tensor([[0.6931, 0.0, 0.0]]), atol=1e-4)
    assert term.token_sums["distill/reverse_kl"][1] == 2.0  # a token mean over the 2 model tokens
    assert term.token_sums["distill/teacher_logprob"][0] == pytest.approx(float(torch.log(torch.tensor(0.075))))
    advantages = torch.tensor([[1.0, 1.0, 1.0]])
    # w = 1, β = 0.5: 1 − 0.5 · 0.693 = 0.653 on token 0, unchanged on token 1; off the mask untouched
    both = distill_advantages(advantages, term.reverse_kl, mask, coef=0.5, reward_weight=1.0)
    assert torch.allclose(both, torch.tensor([[0.6534, 1.0, 1.0]]), atol=1e-4)
    alone = distill_advantages(advantages, term.reverse_kl, mask, coef=0.5, reward_weight=0.0)  # OPD alone
    assert torch.allclose(alone, torch.tensor([[-0.3466, 0.0, 0.0]]), atol=1e-4)


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    """tiny-qwen2-vl saved to a directory, and 2 prompts × 3 of its sampled responses with distinct rewards."""
    path = tmp_path_factory.mktemp("student")
    policy = load_policy("tiny-qwen2-vl")
    policy.save(path)
    torch.manual_seed(0)
    engine = HFEngine(policy)
    trajectories = engine.generate([engine.encode(s) for s in generate("shapes", 2, tasks=["count"])],
                                   SamplingParams(n=3, max_new_tokens=6))
    for k, t in enumerate(trajectories):
        t.reward = 0.1 * k
    return path, trajectories


def _update(path, trajectories, algo, *, shared_prefix=True, train=None, stats=None):
    """One `prepare_batch` + `ppo_update` of a fresh copy of the saved student under ``algo``; (policy, batch)
    (and the update's `UpdateStats` appended to ``stats``)."""
    policy = load_policy(str(path))
    stage = RLStage.model_validate({"algo": algo, "rollout": {"n": 3, "max_new_tokens": 6},
                                    "train": {"steps": 1, "prompts_per_step": 2, "micro_batch_size": 6,
                                              "shared_prefix": shared_prefix, **(train or {})}})
    algorithm = build_algorithm(stage, policy, apply_behaviour_weight=False)
    batch = prepare_batch(algorithm, policy, trajectories, step=0, max_new_tokens=6)
    optimizer, scheduler = make_optimizer(policy.model, stage.optim, policy.adapter.module_groups, total_steps=1)
    out = ppo_update(policy, batch, algorithm.settings, optimizer, scheduler, seed=0, step=0)
    if stats is not None:
        stats.append(out)
    return policy, batch


@pytest.mark.parametrize("shared_prefix", [False, True])
def test_a_teacher_equal_to_the_student_gives_zero_kl_and_grpo_s_update(rollout, shared_prefix):
    """fp32: log π_old − log π_T is 0 on every token, so the advantages are GRPO's and the weights after the step
    equal GRPO's to 1e-6 (π_old comes from a pass of its own under distillation, logp.detach() without). The plain
    pass gives exactly 0; the shared-prefix cached pass differs by float rounding (≤ 5e-7 a token, measured) between
    a model whose parameters require grad (the student) and a frozen one (the teacher, as π_ref), and the update's
    ratio is then π_θ / π_old of two passes (grouped vs cached, ~1e-6 apart) where GRPO's is exactly 1: AdamW's
    first step, g / (|g| + ε), magnifies that on near-zero gradients (1.4e-5 measured), so the weights are compared
    on the plain pass."""
    path, trajectories = rollout
    grpo, grpo_batch = _update(path, trajectories, {}, shared_prefix=shared_prefix)
    opd, opd_batch = _update(path, trajectories, {"distill": {"teacher": str(path), "coef": 1.0}},
                             shared_prefix=shared_prefix)
    kl_sum, tokens = opd_batch.token_sums["distill/reverse_kl"]
    assert tokens == float(opd_batch.loss_mask.sum()) > 0
    assert opd_batch.token_sums["distill/teacher_logprob"][0] < 0
    assert opd_batch.token_sums["distill/agreement"] == [tokens, tokens]  # π_old's argmax is the teacher's
    if shared_prefix:
        assert abs(kl_sum) / tokens <= 1e-6
        assert torch.allclose(opd_batch.advantages, grpo_batch.advantages, rtol=0, atol=1e-6)
        return
    assert kl_sum == 0.0
    assert torch.equal(opd_batch.advantages, grpo_batch.advantages)
    before = load_policy(str(path)).model.state_dict()
    after_grpo, after_opd = grpo.model.state_dict(), opd.model.state_dict()
    assert any(not torch.equal(after_grpo[k], before[k]) for k in before)  # the step moved the weights
    worst = max(float((after_opd[k] - after_grpo[k]).abs().max()) for k in before)
    assert worst <= 1e-6, worst


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(rollout, tmp_path):
    path, _ = rollout
    other = load_policy(str(path))
    other.tokenizer.add_tokens(["<teacher_only>"])  # one token more: another vocabulary
    other.save(tmp_path)
    with pytest.raises(ValueError, match="tokenizer") as err:
        _update(path, rollout[1], {"distill": {"teacher": str(tmp_path)}})
    assert str(tmp_path) in str(err.value) and str(path) in str(err.value)


def test_opd_alone_trains_without_a_verifier(rollout):
    """Reward-free data (``reward: none``, every response 0): every GRPO advantage is 0 (no update). OPD alone
    (reward_weight 0) from another teacher (the preset at another init seed) has a non-zero reverse KL and moves
    the weights."""
    path, _ = rollout
    teacher = load_policy("tiny-qwen2-vl", seed=1)
    teacher_dir = path.parent / "teacher_seed1"
    teacher.save(teacher_dir)
    student = load_policy(str(path))
    before = {k: v.clone() for k, v in student.model.state_dict().items()}
    samples = generate("shapes", 2, tasks=["count"])
    for s in samples:
        s.reward = "none"
        s.validate()  # a sample may name the verifier none
    stage = RLStage.model_validate({"algo": {"distill": {"teacher": str(teacher_dir), "reward_weight": 0.0}},
                                    "rollout": {"n": 2, "max_new_tokens": 4}, "optim": {"lr": 1e-3},
                                    "train": {"steps": 1, "prompts_per_step": 2, "micro_batch_size": 4}})
    result = train_rl(student, HFEngine(student), samples, stage, logger=MetricsLogger(None, quiet=True), seed=0)
    assert result.metrics["distill/reverse_kl"] != 0.0 and result.metrics["distill/teacher_logprob"] < 0
    assert any(not torch.equal(v, before[k]) for k, v in student.model.state_dict().items())


# ----------------------------------------------------------------------------------------------- topk
def _topk_term(student_logits, teacher_logits, k):
    """D (b, R) of `topk_reverse_kl` over the teacher's top-k of two (b, R, V) logit tensors, as the update has it."""
    s, t = torch.log_softmax(student_logits, -1), torch.log_softmax(teacher_logits, -1)
    ids = t.topk(k, dim=-1).indices
    return topk_reverse_kl(s.gather(-1, ids), rest_logprob(s, ids), t.gather(-1, ids), rest_logprob(t, ids))


def test_topk_reverse_kl_in_closed_form():
    """k = 1 of a 2-way split (the docstring's 0.1308); k = V: the exact reverse KL and its exact gradient; k < V:
    the (k+1)-way KL by hand, below the exact one, its gradient autograd's of Σ p (log p − log q) (no stop-grad);
    a teacher equal to the student: 0 and a gradient of exactly 0."""
    half = torch.log(torch.tensor([[[0.5]]]))
    two_way = topk_reverse_kl(torch.log(torch.tensor([[[0.25]]])), torch.log(torch.tensor([[0.75]])), half, half[..., 0])
    assert float(two_way) == pytest.approx(0.25 * math.log(0.5) + 0.75 * math.log(1.5), abs=1e-6)
    g = torch.Generator().manual_seed(0)
    student_logits = torch.randn(2, 3, 7, generator=g, requires_grad=True)
    teacher_logits = torch.randn(2, 3, 7, generator=g)
    s, t = torch.log_softmax(student_logits, -1), torch.log_softmax(teacher_logits, -1)
    exact = (s.exp() * (s - t)).sum(-1)  # KL(π_S ‖ π_T) over the whole vocabulary, (2, 3)
    exact_grad = torch.autograd.grad(exact.sum(), student_logits, retain_graph=True)[0]
    whole = _topk_term(student_logits, teacher_logits, 7)
    torch.testing.assert_close(whole, exact, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.autograd.grad(whole.sum(), student_logits)[0], exact_grad, rtol=1e-5, atol=1e-6)
    ids = t.topk(3, dim=-1).indices  # k = 3: buckets = 3 tokens + the other 4
    p_s = torch.cat([s.exp().gather(-1, ids), 1 - s.exp().gather(-1, ids).sum(-1, keepdim=True)], -1)
    p_t = torch.cat([t.exp().gather(-1, ids), 1 - t.exp().gather(-1, ids).sum(-1, keepdim=True)], -1)
    by_hand = (p_s * (p_s.log() - p_t.log())).sum(-1)
    three = _topk_term(student_logits, teacher_logits, 3)
    torch.testing.assert_close(three, by_hand, rtol=1e-5, atol=1e-6)
    assert bool((three <= exact + 1e-6).all()) and bool((three > 0).all())  # a coarser partition: a lower bound
    torch.testing.assert_close(torch.autograd.grad(three.sum(), student_logits)[0],
                               torch.autograd.grad(by_hand.sum(), student_logits)[0], rtol=1e-4, atol=1e-6)
    same = _topk_term(student_logits, student_logits.detach(), 3)
    assert bool((same.abs() <= 1e-7).all())
    assert torch.equal(torch.autograd.grad(same.sum(), student_logits)[0], torch.zeros(2, 3, 7))
    assert NO_MASS == torch.finfo(torch.float32).min


def test_topk_teacher_equal_to_the_student_gives_zero_and_grpo_s_update(rollout):
    """fp32, the plain pass: the top-k term is 0 on every token (its gradient exactly 0: log π_θ − log π_T is 0
    there), the student's argmax is the teacher's everywhere, and the weights after the step equal GRPO's to 1e-6."""
    path, trajectories = rollout
    grpo, _ = _update(path, trajectories, {}, shared_prefix=False)
    stats = []
    opd, batch = _update(path, trajectories, {"distill": {"teacher": str(path), "estimator": "topk", "top_k": 4}},
                         shared_prefix=False, stats=stats)
    assert batch.old_logp is None  # no π_old pass: the term is a loss of π_θ itself
    assert batch.teacher_topk_ids.shape == (*batch.loss_mask.shape, 4)
    assert batch.teacher_topk_ids.dtype == torch.int32 and batch.teacher_topk_logp.shape[-1] == 5
    kl_sum, tokens = stats[0].token_sums["distill/reverse_kl"]
    assert tokens == float(batch.loss_mask.sum()) > 0 and abs(kl_sum) / tokens <= 1e-7
    assert stats[0].token_sums["distill/agreement"] == [tokens, tokens]
    assert batch.token_sums["distill/teacher_logprob"][0] < 0
    before = load_policy(str(path)).model.state_dict()
    after_grpo, after_opd = grpo.model.state_dict(), opd.model.state_dict()
    assert any(not torch.equal(after_grpo[k], before[k]) for k in before)
    worst = max(float((after_opd[k] - after_grpo[k]).abs().max()) for k in before)
    assert worst <= 1e-6, worst


@pytest.fixture(scope="module")
def other_teacher(rollout):
    """The preset at another init seed, saved: a teacher that disagrees with the student."""
    path = rollout[0].parent / "teacher_seed1"
    if not path.exists():
        load_policy("tiny-qwen2-vl", seed=1).save(path)
    return path


def _topk_gradient(path, trajectories, teacher, train):
    """The update's gradient and batch under ``train`` (the pass layout; unset: the plain padded pass), OPD topk
    alone."""
    policy = load_policy(str(path))
    stage = RLStage.model_validate({
        "algo": {"distill": {"teacher": str(teacher), "estimator": "topk", "top_k": 3, "reward_weight": 0.0}},
        "rollout": {"n": 3, "max_new_tokens": 6},
        "train": {"steps": 1, "prompts_per_step": 2, "shared_prefix": False, **train}})
    algorithm = build_algorithm(stage, policy, apply_behaviour_weight=False)
    batch = prepare_batch(algorithm, policy, trajectories, step=0, max_new_tokens=6)
    assert bool((batch.advantages == 0).all())  # OPD alone: the term is all there is
    rows = list(range(len(trajectories)))
    grads = minibatch_gradient(policy, batch, rows, algorithm.settings, normaliser=float(batch.loss_mask.sum()))
    return grads, batch


@pytest.mark.parametrize("train", [{"padding_free": True}, {"shared_prefix": True, "micro_batch_size": 6},
                                   {"logprob_chunk": 2}, {"max_tokens_per_micro_batch": 60}],
                         ids=["padding_free", "shared_prefix", "logprob_chunk", "token_budget"])
def test_topk_is_the_same_in_every_pass_layout(rollout, other_teacher, train):
    """OPD topk alone from another teacher: the teacher's top-k and the update's gradient (the loss term only) under
    each layout equal the plain padded pass's (fp32; gradients to 1e-6, the layouts' float summation order apart);
    shared_prefix: the teacher's cached pass and the update's grouped one (perf/shared_prefix_frac 1)."""
    path, trajectories = rollout
    plain, plain_batch = _topk_gradient(path, trajectories, other_teacher, {})
    grads, batch = _topk_gradient(path, trajectories, other_teacher, train)
    if train.get("shared_prefix"):
        assert batch.token_sums["perf/shared_prefix_frac"][0] > 0  # the teacher's pass shared its prompts
    assert torch.equal(batch.teacher_topk_ids, plain_batch.teacher_topk_ids)
    torch.testing.assert_close(batch.teacher_topk_logp, plain_batch.teacher_topk_logp, rtol=1e-5, atol=1e-6)
    assert max(float(g.abs().max()) for g in plain.values()) > 1e-3  # the term pulls the student
    assert grads.keys() == plain.keys()
    for key, g in plain.items():
        torch.testing.assert_close(grads[key], g, rtol=1e-4, atol=1e-6, msg=key)


def test_topk_through_the_cli_logs_its_kl_and_agreement(rollout, other_teacher, tmp_path):
    """``vlrl rl --config configs/shapes_opd.yaml algo.distill.estimator=topk`` (OPD alone from another teacher):
    every step logs distill/reverse_kl > 0, distill/agreement in [0, 1] and the teacher's log-probs, and the report
    draws them."""
    from test_shipped_configs import CONFIGS, RL_TINY, Run, cli

    path, _ = rollout
    cli("rl", "--config", str(CONFIGS / "shapes_opd.yaml"), f"model.path={path}", *RL_TINY,
        f"algo.distill.teacher={other_teacher}", "algo.distill.estimator=topk", "algo.distill.top_k=4",
        "algo.distill.reward_weight=0", f"out={tmp_path}")
    records = Run.read(tmp_path).stage("rl")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["distill/reverse_kl"] > 0 and 0 <= r["distill/agreement"] <= 1 and r["distill/teacher_logprob"] < 0, r
        assert r["policy/grad_norm"] > 0  # the term alone trains (every advantage is 0)
    from vlrl.report.html import build_report

    page = build_report([tmp_path])  # `vlrl report`: the distill group's charts
    assert all(name in page for name in ("distill/reverse_kl", "distill/agreement", "distill/teacher_logprob"))
