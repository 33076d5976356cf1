"""On-policy distillation (``algo.distill``; `vlrl.algos.distill`, `vlrl.train.distill`): the sampled reverse KL in
closed form, the exactness of a teacher equal to the student (KL 0, GRPO's update), the refusal of a teacher with
another tokenizer, and OPD alone training where GRPO's advantages are all 0."""

import pytest
import torch

from vlrl.algos.distill import distill_advantages, sampled_reverse_kl
from vlrl.config import RLStage
from vlrl.data import generate
from vlrl.models import load_policy
from vlrl.report import MetricsLogger
from vlrl.rollout import HFEngine, SamplingParams
from vlrl.train.batch import build_algorithm, prepare_batch
from vlrl.train.common import make_optimizer
from vlrl.train.loop import train_rl
from vlrl.train.update import ppo_update

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


def _update(path, trajectories, algo, *, shared_prefix=True):
    """One `prepare_batch` + `ppo_update` of a fresh copy of the saved student under ``algo``; (policy, batch)."""
    policy = load_policy(str(path))
    stage = RLStage.model_validate({"algo": algo, "rollout": {"n": 3, "max_new_tokens": 6},
                                    "train": {"steps": 1, "prompts_per_step": 2, "micro_batch_size": 6,
                                              "shared_prefix": shared_prefix}})
    algorithm = build_algorithm(stage, policy, apply_behaviour_weight=False)
    batch = prepare_batch(algorithm, policy, trajectories, step=0, max_new_tokens=6)
    optimizer, scheduler = make_optimizer(policy.model, stage.optim, policy.adapter.module_groups, total_steps=1)
    ppo_update(policy, batch, algorithm.settings, optimizer, scheduler, seed=0, step=0)
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
