"""On-policy distillation (OPD): the student π_θ samples, a frozen teacher π_T scores every sampled token, and the
student minimises the per-token reverse KL on its own samples (Agarwal et al. 2024, "On-Policy Distillation of
Language Models: Learning from Self-Generated Mistakes" (GKD); Thinking Machines, "On-Policy Distillation", 2025).

    KL(π_θ ‖ π_T)(s_t) = E_{y ~ π_θ(·|s_t)} [log π_θ(y|s_t) − log π_T(y|s_t)]

The ``sampled`` estimator is that expectation's one-sample estimate at the token the student sampled, y_t:
k_t = log π_old(y_t) − log π_T(y_t), with π_old the student's weights at the start of the step (the trainer's own
recomputation, so a teacher equal to the student gives k_t = 0 exactly). It enters the advantage (slime
``--use-opd``; Thinking Machines' "per-token advantage = −reverse KL"):

    Â_t ← w · Â_t − β · k_t          on model tokens (loss mask 1)

so any policy loss trains on it: its gradient in expectation is −β ∇ KL(π_θ ‖ π_T) (REINFORCE on the per-token
reward −k_t, without the future tokens' terms — the discount-0 form both sources use).

The ``topk`` estimator is the reverse KL itself, summed over the teacher's k most likely tokens S_t at each
position plus one bucket for the rest of the vocabulary (TRL's GKD / ``GKDTrainer`` with β = 1, AReaL's KDRL; the
rest bucket makes the k+1-way distributions proper, so the term is ≥ 0 and 0 only where they agree):

    D_t = Σ_{i ∈ S_t ∪ {rest}} π_θ(i) · (log π_θ(i) − log π_T(i)),    π(rest) = 1 − Σ_{i ∈ S_t} π(i)

a loss term added to the policy loss, β · aggregate(D, loss_agg), differentiated through π_θ at S_t and its rest
mass. It equals KL(π_θ ‖ π_T) when k is the vocabulary, and bounds it from below otherwise (a coarser partition).
`topk_reverse_kl` computes it as Σ_i π_θ(i) · sg(log π_θ(i) − log π_T(i)): the same value, and the same gradient —
the exact one, Σ_i π_θ(i) (log π_θ(i) − log π_T(i)) ∇log π_θ(i), since Σ_i π_θ(i) ∇log π_θ(i) = ∇ Σ_i π_θ(i) = 0
— which is exactly 0 where the student's log-probs equal the teacher's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DistillTerm:
    """The sampled reverse KL of a batch: k (B, R), 0 off the loss mask, and its token means for the log."""

    reverse_kl: torch.Tensor  # (B, R) log π_old(y_t) − log π_T(y_t) on model tokens, 0 elsewhere
    token_sums: dict[str, list[float]]  # distill/reverse_kl, distill/teacher_logprob: [Σ value·mask, Σ mask]


def sampled_reverse_kl(student_logp: torch.Tensor, teacher_logp: torch.Tensor, loss_mask: torch.Tensor) -> DistillTerm:
    """k_t = log π_student(y_t) − log π_teacher(y_t) on the sampled tokens, (B, R) each, masked by ``loss_mask``.

    E.g. a token the student gave probability 0.5 and the teacher 0.25: k = log 0.5 − log 0.25 = log 2 ≈ 0.693
    (the student is too sure of it: its advantage falls by β · 0.693)."""
    width = loss_mask.shape[1]
    mask = loss_mask.float()
    student, teacher = student_logp[:, :width].float(), teacher_logp[:, :width].float()  # (B, R)
    k = (student - teacher) * mask
    tokens = float(mask.sum())
    sums = {"distill/reverse_kl": [float(k.sum()), tokens],
            "distill/teacher_logprob": [float((teacher * mask).sum()), tokens]}
    return DistillTerm(k, sums)


def distill_advantages(advantages: torch.Tensor, reverse_kl: torch.Tensor, loss_mask: torch.Tensor, *, coef: float,
                       reward_weight: float) -> torch.Tensor:
    """Â_t ← w · Â_t − β · k_t on model tokens (module docstring); (B, R) in, (B, R) out. w = 1, β · k = 0 returns
    ``advantages`` unchanged (bit for bit: the exactness check of a teacher equal to the student)."""
    mask = loss_mask.to(advantages.dtype)
    outcome = advantages if reward_weight == 1.0 else reward_weight * advantages
    return outcome - coef * reverse_kl.to(advantages.dtype) * mask


def topk_reverse_kl(student_logp: torch.Tensor, student_rest: torch.Tensor, teacher_logp: torch.Tensor,
                    teacher_rest: torch.Tensor) -> torch.Tensor:
    """D_t (b, R) of the ``topk`` estimator (module docstring): log-probs (b, R, k) of the student and the teacher
    at the teacher's top-k ids, and the log of each one's mass outside them (b, R) (`vlrl.models.logprobs.NO_MASS`
    for none). Differentiable through the student's; the teacher's are constants.

    E.g. k = 1: the teacher gives its top token 0.5, the student 0.25 — D = 0.25·log(0.25/0.5) + 0.75·log(0.75/0.5)
    = 0.1308 (the k+1 = 2-way reverse KL)."""
    student = torch.cat([student_logp, student_rest.unsqueeze(-1)], dim=-1).float()  # (b, R, k + 1)
    teacher = torch.cat([teacher_logp, teacher_rest.unsqueeze(-1)], dim=-1).float().to(student.device)
    return (student.exp() * (student - teacher).detach()).sum(-1)


def agreement_sums(student_argmax: torch.Tensor, teacher_argmax: torch.Tensor, loss_mask: torch.Tensor
                   ) -> list[float]:
    """``distill/agreement``'s [Σ (argmax π_student = argmax π_teacher) · mask, Σ mask] over model tokens (b, R)."""
    width = loss_mask.shape[1]
    mask = loss_mask.float()
    same = (student_argmax[:, :width] == teacher_argmax[:, :width].to(student_argmax.device)).float() * mask
    return [float(same.sum()), float(mask.sum())]


@dataclass
class TeacherScores:
    """The teacher's pass over a step's (B, R) response tokens, on the host: log π_T of the sampled tokens; for
    ``topk`` its k most likely tokens' ids (B, R, k) int32 and log-probs with the rest mass last (B, R, k + 1); for
    ``sampled`` its argmax (B, R) (``distill/agreement``)."""

    logp: torch.Tensor
    topk_logp: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    argmax: torch.Tensor | None = None

    def batch_fields(self) -> dict[str, torch.Tensor | None]:
        """What the update needs of it (`vlrl.train.update.UpdateBatch`): the top-k, for the loss term."""
        return {"teacher_topk_logp": self.topk_logp, "teacher_topk_ids": self.topk_ids}
