"""On-policy distillation's teacher (``algo.distill``; the maths in `vlrl.algos.distill`): loaded once, frozen, in
the student's dtype and on its device; scored once per step, without gradient, through the same passes as π_ref
(`vlrl.train.batch.ScoringPasses`: the token budget's micro-batches, ``train.padding_free`` /
``train.shared_prefix`` / ``train.logprob_chunk``), its log-probs on the host — of the sampled tokens, and for
``estimator: topk`` of its k most likely tokens at every position (B × R × k ids and log-probs, 8·k + 4 bytes a
token), which the update's loss term reads.

The teacher scores the student's token ids, prompts encoded by the student's processor: it must share the student's
tokenizer (a teacher of another family is accepted when its vocabulary is the same, for a text model) — another is
refused, naming both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vlrl.algos.distill import TeacherScores, agreement_sums, distill_advantages, sampled_reverse_kl
from vlrl.config import DistillConfig
from vlrl.models import Policy
from vlrl.models.forward import PassLayout, score
from vlrl.models.logprobs import HeadQuery


@dataclass
class Teacher:
    """``algo.distill`` bound once: the frozen teacher model and the term's knobs."""

    model: torch.nn.Module
    name: str  # algo.distill.teacher, as configured
    coef: float  # β
    reward_weight: float  # w of the outcome advantage
    estimator: str  # sampled | topk
    top_k: int = 16  # k of topk

    @property
    def needs_old(self) -> bool:
        """The sampled term is log π_old − log π_T: it needs π_old's pass (topk's is a loss of π_θ itself)."""
        return self.estimator == "sampled"

    def score(self, policy: Policy, run: Callable, *, temperature: float, layout: PassLayout) -> TeacherScores:
        """One no-grad pass over the step's trajectories through ``run`` (`ScoringPasses.run`: whole, or in the token
        budget's micro-batches), every layout: log π_T of the sampled tokens, and the top-k (topk) or the argmax
        (sampled) from the same head (`vlrl.models.logprobs.HeadQuery`)."""
        topk = self.estimator == "topk"

        def one(part: list, sums: dict | None) -> tuple[torch.Tensor, ...]:
            query = HeadQuery(top_k=self.top_k) if topk else HeadQuery(argmax=True)
            logp = score(self.model, policy, part, temperature, layout=layout, sums=sums, query=query)
            got = query.result
            if not topk:
                return logp, got["argmax"].int()
            return logp, torch.cat([got["topk_logp"], got["topk_rest"].unsqueeze(-1)], dim=-1), got["topk_ids"].int()

        out = run(one)
        return TeacherScores(out[0], out[1], out[2]) if topk else TeacherScores(out[0], argmax=out[1])

    def advantages(self, advantages: torch.Tensor, student_logp: torch.Tensor | None,
                   student_argmax: torch.Tensor | None, teacher: TeacherScores, loss_mask: torch.Tensor,
                   token_sums: dict[str, list[float]]) -> torch.Tensor:
        """sampled: Â_t ← w · Â_t − β · (log π_old(y_t) − log π_T(y_t)) on model tokens (`vlrl.algos.distill`), the
        term's token sums (distill/reverse_kl, distill/teacher_logprob, distill/agreement of π_old's argmax) into
        ``token_sums``. topk: Â_t ← w · Â_t (its term is a loss, `vlrl.train.update`, which logs its reverse KL and
        agreement); distill/teacher_logprob."""
        if self.estimator == "topk":
            mask = loss_mask.float()
            token_sums["distill/teacher_logprob"] = [float((teacher.logp[:, : mask.shape[1]] * mask).sum()),
                                                     float(mask.sum())]
            return distill_advantages(advantages, torch.zeros_like(advantages), loss_mask, coef=0.0,
                                      reward_weight=self.reward_weight)
        term = sampled_reverse_kl(student_logp, teacher.logp, loss_mask)
        token_sums.update(term.token_sums)
        token_sums["distill/agreement"] = agreement_sums(student_argmax, teacher.argmax, loss_mask)
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
    return Teacher(teacher, spec.teacher, spec.coef, spec.reward_weight, spec.estimator, spec.top_k)


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
