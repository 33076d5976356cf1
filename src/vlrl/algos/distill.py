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
