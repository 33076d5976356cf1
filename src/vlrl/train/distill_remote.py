"""On-policy distillation's teacher on servers (``algo.distill.teacher_urls``): `RemoteTeacher`, the same contract as
the in-process `vlrl.train.distill.Teacher` — (B, R) log π_T of the step's sampled tokens, on the host — computed by
servers that score input tokens (`vlrl serve --model TEACHER`, or SGLang; `vlrl.rollout.teacher_client`).

Each trajectory is one prefill-only request: its prompt (image tokens expanded, as the student encoded it) followed by
its response, its images, ``logprob_start_len`` the prompt's last token — so the answer's
``input_token_logprobs[1:]`` are the response tokens' log-probs (SGLang gives the first token of the slice ``None``).
A server scores at temperature 1 (SGLang's input log-probs use the raw logits): the config refuses a rollout
temperature other than 1 with a server teacher (`vlrl.config.RLStage`), and so does `RemoteTeacher.logprobs`.

The tokenizer is checked at start against what each server reports (``/server_info``): its ``vocab_size`` (vlrl
serve) against the student's embedding rows, and — where the ``tokenizer_path`` / ``model_path`` it names can be
read here (a local directory, a preset, a cached hub id; no weights) — its vocabulary against the student's, and for
a vision-language student its model family. A mismatch is refused naming both; a server whose tokenizer cannot be
read here is checked on its vocabulary size alone (a warning says so).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from vlrl.algos.distill import TeacherScores, distill_advantages, sampled_reverse_kl
from vlrl.config import DistillConfig
from vlrl.models import Policy
from vlrl.models.forward import PassLayout
from vlrl.rollout.http_settings import ClientSettings
from vlrl.rollout.image_url import encode_image
from vlrl.rollout.teacher_client import ScoreRequest, ScoringClient
from vlrl.rollout.types import Trajectory

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RemoteTeacher:
    """``algo.distill`` with ``teacher_urls``: the scoring client and the term's knobs."""

    client: ScoringClient
    name: str  # the teacher_urls, as configured
    coef: float  # β
    reward_weight: float  # w of the outcome advantage
    estimator: str  # sampled (the config refuses another for a server teacher)

    @property
    def needs_old(self) -> bool:
        """The sampled term is log π_old − log π_T: it needs π_old's pass (as `vlrl.train.distill.Teacher`)."""
        return True

    def score(self, policy: Policy, run: Callable, *, temperature: float, layout: PassLayout) -> TeacherScores:
        """As `vlrl.train.distill.Teacher.score`, the sampled tokens' log-probs only: a server answers no argmax (nor
        top-k), so ``distill/agreement`` is not logged."""
        return TeacherScores(self.logprobs(policy, run, temperature=temperature, layout=layout))

    def logprobs(self, policy: Policy, run: Callable, *, temperature: float, layout: PassLayout) -> torch.Tensor:
        """(B, R) log π_T of the step's sampled tokens, on the host: one request per trajectory with a response, all
        of them sent together (``teacher_max_concurrent`` in flight) — the token budget's micro-batches
        (`ScoringPasses.run`) bound the trainer's memory, not a server's, so ``run`` only lays the answers out."""
        if temperature != 1.0:
            raise ValueError(f"algo.distill.teacher_urls: the rollout temperature is {temperature}; a teacher server "
                             "scores at temperature 1 (set rollout.temperature=1, or use an in-process teacher)")
        parts: list[list[Trajectory]] = []
        run(lambda part, _: parts.append(list(part)) or torch.zeros(len(part), 1))  # (the trajectories, as run cuts them)
        scores = self._score(list({id(t): t for part in parts for t in part}.values()))
        return run(lambda part, _: _rows(part, scores))

    def _score(self, trajectories: Sequence[Trajectory]) -> dict[int, torch.Tensor]:
        """id(trajectory) → (R,) log π_T of its response tokens, for every trajectory with a response."""
        encoded: dict[int, str] = {}  # a group's n trajectories share their images: each encoded once
        kept, requests = [], []
        for t in trajectories:
            if len(t.response_ids) == 0:
                continue
            if any(image is None for image in t.images):
                raise ValueError(f"algo.distill.teacher_urls: a trajectory of sample {t.sample.id} has lost its decoded "
                                 "images; a teacher server needs them to read the prompt")
            images = [encoded.setdefault(id(image), encode_image(image)) for image in t.images]
            prompt = [int(x) for x in t.prompt_ids]
            requests.append(ScoreRequest(prompt + [int(x) for x in t.response_ids], images, len(prompt) - 1))
            kept.append(t)
        return {id(t): torch.tensor(values, dtype=torch.float32)
                for t, values in zip(kept, self.client.score(requests), strict=True)}

    def advantages(self, advantages: torch.Tensor, student_logp: torch.Tensor, student_argmax: torch.Tensor | None,
                   teacher: TeacherScores, loss_mask: torch.Tensor, token_sums: dict[str, list[float]]) -> torch.Tensor:
        """As `vlrl.train.distill.Teacher.advantages` for ``sampled``: Â_t ← w · Â_t − β · (log π_old(y_t) −
        log π_T(y_t)); no agreement (no teacher argmax)."""
        term = sampled_reverse_kl(student_logp, teacher.logp, loss_mask)
        token_sums.update(term.token_sums)
        return distill_advantages(advantages, term.reverse_kl, loss_mask, coef=self.coef,
                                  reward_weight=self.reward_weight)

    def close(self) -> None:
        self.client.close()


def _rows(part: Sequence[Trajectory], scores: dict[int, torch.Tensor]) -> torch.Tensor:
    """(b, R_b) of ``part``'s scores, right-padded with 0 (a trajectory without a response: all 0)."""
    out = torch.zeros(len(part), max(1, max((len(t.response_ids) for t in part), default=1)))
    for i, t in enumerate(part):
        values = scores.get(id(t))
        if values is not None:
            out[i, : len(values)] = values
    return out


def load_remote_teacher(spec: DistillConfig, policy: Policy) -> RemoteTeacher:
    """The teacher servers of ``spec`` (``teacher_urls``), each answering ``/server_info`` and its tokenizer checked
    against ``policy``'s (module docstring)."""
    settings = ClientSettings(api_key=os.environ.get(spec.teacher_api_key_env, ""),
                              request_timeout=spec.teacher_request_timeout)
    client = ScoringClient(spec.teacher_urls, settings, max_concurrent=spec.teacher_max_concurrent)
    try:
        for url, info in client.info.items():
            check_server_tokenizer(policy, url, info)
    except Exception:
        client.close()
        raise
    return RemoteTeacher(client, ",".join(spec.teacher_urls), spec.coef, spec.reward_weight, spec.estimator)


@dataclasses.dataclass(frozen=True)
class StudentVocabulary:
    """What a teacher's tokenizer is compared with: the student's source, vocabulary, embedding rows, family."""

    source: str
    vocab: dict[str, int]
    rows: int | None  # embedding rows (token ids the model takes); None: unknown
    model_type: str
    vision: bool

    @classmethod
    def of(cls, policy: Policy) -> StudentVocabulary:
        return cls(str(policy.source), policy.tokenizer.get_vocab(), policy.model.get_input_embeddings().num_embeddings,
                   policy.model.config.model_type, policy.is_vision)


def check_server_tokenizer(student: Policy, url: str, info: dict[str, Any]) -> None:
    """Refuse a teacher server whose tokenizer differs from the student's, naming both (module docstring)."""
    problem, warning = server_tokenizer_problem(StudentVocabulary.of(student), url, info)
    if problem:
        raise ValueError(f"algo.distill.teacher_urls: {problem}")
    if warning:
        log.warning("algo.distill.teacher_urls: %s", warning)


def server_tokenizer_problem(student: StudentVocabulary, url: str,
                             info: dict[str, Any]) -> tuple[str | None, str | None]:
    """(why the teacher server at ``url`` — its ``/server_info`` is ``info`` — cannot teach ``student``, or None;
    what could not be checked, or None). Its ``vocab_size`` against the student's embedding rows, and the
    vocabulary (and, for a vision-language student, the family) of the ``tokenizer_path`` / ``model_path`` it
    reports, read here without weights where it can be."""
    from vlrl.models.policy import load_processor

    model = (info.get("vllm_config") or {}).get("model_config") if isinstance(info.get("vllm_config"), dict) else None
    if isinstance(model, dict):  # vLLM (/server_info?config_format=json): its tokenizer and model paths
        info = {"tokenizer_path": model.get("tokenizer") or model.get("model")}
    path = str(info.get("tokenizer_path") or info.get("model_path") or "")
    named = f"{url} ({path or 'no tokenizer_path reported'}"
    vocab = info.get("vocab_size")
    if isinstance(vocab, int) and student.rows is not None and vocab != student.rows:
        return (f"the teacher server {named}, vocabulary of {vocab}) differs from the student, {student.source} "
                f"(vocabulary of {student.rows}); the teacher scores the student's token ids, so it must share the "
                "student's tokenizer"), None
    if not path:
        return None, f"{url} reports no tokenizer_path; checked its vocabulary size only"
    try:
        teacher = load_processor(path)
    except Exception as err:  # noqa: BLE001  (a path on the server's machine, a hub id not cached here, ...)
        return None, (f"cannot read the tokenizer of {named}) here ({type(err).__name__}: {str(err)[:200]}); "
                      "checked its vocabulary size only")
    theirs = teacher.tokenizer.get_vocab()
    if theirs != student.vocab:
        return (f"the teacher server's tokenizer, {named}, vocabulary of {len(theirs)}) differs from the student's, "
                f"{student.source} (vocabulary of {len(student.vocab)}); the teacher scores the student's token ids, "
                "so it must share the student's tokenizer"), None
    kind = teacher.model.config.model_type
    if student.vision and kind != student.model_type:
        return (f"the teacher server {named}, {kind}) is of another family than the student, {student.source} "
                f"({student.model_type}); the teacher reads the student's encoded images, so a vision-language "
                "student needs a teacher of its own family"), None
    return None, None
