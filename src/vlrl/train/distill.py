"""On-policy distillation's teacher (``algo.distill``; the maths in `vlrl.algos.distill`): loaded once, frozen, in
the student's dtype and on its device; scored once per step, without gradient, through the same passes as π_ref
(`vlrl.train.batch.ScoringPasses`: the token budget's micro-batches, ``train.padding_free`` /
``train.shared_prefix`` / ``train.logprob_chunk``), its log-probs on the host.

The teacher scores the student's token ids, prompts encoded by the student's processor: it must share the student's
tokenizer (a teacher of another family is accepted when its vocabulary is the same, for a text model) — another is
refused, naming both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vlrl.algos.distill import distill_advantages, sampled_reverse_kl
from vlrl.config import DistillConfig
from vlrl.models import Policy
from vlrl.models.forward import PassLayout, score


@dataclass
class Teacher:
    """``algo.distill`` bound once: the frozen teacher model and the term's knobs."""

    model: torch.nn.Module
    name: str  # algo.distill.teacher, as configured
    coef: float  # β
    reward_weight: float  # w of the outcome advantage
    estimator: str  # sampled

    def logprobs(self, policy: Policy, run: Callable, *, temperature: float, layout: PassLayout) -> torch.Tensor:
        """(B, R) log π_T of the step's sampled tokens, on the host: one no-grad pass over the step's trajectories
        through ``run`` (`ScoringPasses.run`: whole, or in the token budget's micro-batches)."""
        return run(lambda part, sums: score(self.model, policy, part, temperature, layout=layout, sums=sums))

    def advantages(self, advantages: torch.Tensor, student_logp: torch.Tensor, teacher_logp: torch.Tensor,
                   loss_mask: torch.Tensor, token_sums: dict[str, list[float]]) -> torch.Tensor:
        """Â_t ← w · Â_t − β · (log π_old(y_t) − log π_T(y_t)) on model tokens (`vlrl.algos.distill`); the term's
        token sums (distill/reverse_kl, distill/teacher_logprob) go to ``token_sums``."""
        term = sampled_reverse_kl(student_logp, teacher_logp, loss_mask)
        token_sums.update(term.token_sums)
        return distill_advantages(advantages, term.reverse_kl, loss_mask, coef=self.coef,
                                  reward_weight=self.reward_weight)


def load_teacher(spec: DistillConfig, policy: Policy) -> Teacher:
    """The teacher of ``spec`` for ``policy`` (the student): loaded in the student's dtype, on its device, frozen.
    Refuses a teacher whose tokenizer (or, for a vision-language student, whose model family) differs. With
    ``teacher_urls``: a `vlrl.train.distill_remote.RemoteTeacher` (the same contract, scored on those servers)."""
    from vlrl.models import load_policy

    if spec.teacher_urls is not None:
        from vlrl.train.distill_remote import load_remote_teacher

        return load_remote_teacher(spec, policy)  # type: ignore[return-value]  (Teacher's contract)

    parameter = next(policy.model.parameters())
    dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[parameter.dtype]
    loaded = load_policy(spec.teacher, dtype=dtype, device=str(parameter.device))
    check_same_tokenizer(policy, loaded, spec.teacher)
    teacher = loaded.model.eval().requires_grad_(False)  # frozen (loaded for this run alone: no copy needed)
    return Teacher(teacher, spec.teacher, spec.coef, spec.reward_weight, spec.estimator)


def check_same_tokenizer(student: Policy, teacher: Policy, teacher_name: str) -> None:
    """The teacher scores the student's token ids: their vocabularies must be the same (and, when the student reads
    images, so must the family that encodes them). The error names both."""
    def named(policy: Policy) -> str:
        return f"{policy.source} ({policy.model.config.model_type}, vocabulary of {len(policy.tokenizer.get_vocab())})"

    if student.tokenizer.get_vocab() != teacher.tokenizer.get_vocab():
        raise ValueError(f"algo.distill.teacher={teacher_name}: the teacher's tokenizer, {named(teacher)}, differs "
                         f"from the student's, {named(student)}; the teacher scores the student's token ids, so it "
                         "must share the student's tokenizer")
    if student.is_vision and student.model.config.model_type != teacher.model.config.model_type:
        raise ValueError(f"algo.distill.teacher={teacher_name}: the teacher, {named(teacher)}, is of another family "
                         f"than the student, {named(student)}; the teacher reads the student's encoded images, so a "
                         "vision-language student needs a teacher of its own family")
