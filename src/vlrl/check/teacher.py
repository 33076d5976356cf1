"""On-policy distillation's teacher in the preflight (``algo.distill``; `vlrl check`, and at the start of every run):
an in-process ``teacher`` must name a model whose config and tokenizer read (no weights: a preset is built on the
``meta`` device) and whose vocabulary is the student's (and, for a vision-language student, whose family); each of
``teacher_urls`` must answer ``/server_info`` (with the key of ``teacher_api_key_env``) and report a tokenizer the
student shares (`vlrl.train.distill_remote.server_tokenizer_problem`)."""

from __future__ import annotations

import os
from typing import Any

from vlrl.check.report import CheckReport

SERVER_TIMEOUT = 10.0  # seconds a teacher server has to answer /server_info


def check_teachers(report: CheckReport, student: Any, rl: list[tuple[str, Any]]) -> None:
    """Every RL stage's ``algo.distill`` teacher against ``student`` (the `vlrl.check.samples` bundle of
    ``model.path``; None where it could not be read: then only whether the teacher reads or answers)."""
    from vlrl.train.distill_remote import StudentVocabulary

    vocabulary = None
    if student is not None:
        text = student.config.get_text_config() if hasattr(student.config, "get_text_config") else student.config
        rows = getattr(text, "vocab_size", None)
        vocabulary = StudentVocabulary(student.source, student.tokenizer.get_vocab(), int(rows) if rows else None,
                                       student.config.model_type, hasattr(student.config, "vision_config"))
    for p, stage in rl:
        distill = stage.algo.distill
        if distill is None:
            continue
        if distill.teacher is not None:
            _check_in_process(report, f"{p}algo.distill.teacher", distill.teacher, vocabulary)
        else:
            key = os.environ.get(distill.teacher_api_key_env, "")
            for url in distill.teacher_urls:
                _check_server(report, f"{p}algo.distill.teacher_urls", url.rstrip("/"), key, vocabulary)


def _check_in_process(report: CheckReport, where: str, path: str, student: Any) -> None:
    from vlrl.check.samples import model_path_problem
    from vlrl.models.policy import load_processor

    problem = model_path_problem(path)
    if problem:
        report.problem(where, problem)
        return
    try:
        teacher = load_processor(path)
    except Exception as err:  # noqa: BLE001  (OSError: missing files or no hub; ValueError: a family, remote code)
        report.problem(where, f"cannot load the config/tokenizer of {path!r}: {type(err).__name__}: "
                              f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}")
        return
    vocab = teacher.tokenizer.get_vocab()
    kind = teacher.model.config.model_type
    if student is not None and vocab != student.vocab:
        report.problem(where, f"the teacher's tokenizer, {path} ({kind}, vocabulary of {len(vocab)}), differs from "
                              f"the student's, {student.source} ({student.model_type}, vocabulary of "
                              f"{len(student.vocab)}); the teacher scores the student's token ids")
    elif student is not None and student.vision and kind != student.model_type:
        report.problem(where, f"the teacher, {path} ({kind}), is of another family than the student, {student.source} "
                              f"({student.model_type}); it reads the student's encoded images")
    else:
        report.facts.append(f"{where}: {path} ({kind}, vocabulary of {len(vocab)}) reads, no weights loaded"
                            + (", the student's tokenizer" if student is not None else ""))


def _check_server(report: CheckReport, where: str, url: str, key: str, student: Any) -> None:
    import httpx

    from vlrl.train.distill_remote import server_tokenizer_problem

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        answer = httpx.get(f"{url}/server_info?config_format=json", headers=headers, timeout=SERVER_TIMEOUT)
        if answer.status_code == 404:
            answer = httpx.get(f"{url}/get_model_info", headers=headers, timeout=SERVER_TIMEOUT)
    except httpx.HTTPError as err:
        report.problem(where, f"the teacher server {url} does not answer /server_info: {type(err).__name__}: {err}")
        return
    if answer.status_code == 401:
        report.problem(where, f"the teacher server {url} answered 401: set the key it takes in the environment "
                              "variable algo.distill.teacher_api_key_env names")
        return
    if answer.status_code >= 400:
        report.problem(where, f"the teacher server {url} answered /server_info with {answer.status_code}")
        return
    info = answer.json()
    problem, warning = server_tokenizer_problem(student, url, info) if student is not None else (None, None)
    if problem:
        report.problem(where, problem)
        return
    if warning:
        report.warn(where, warning)
    config = info.get("vllm_config") if isinstance(info.get("vllm_config"), dict) else {}
    path = info.get("tokenizer_path") or info.get("model_path") or (config.get("model_config") or {}).get("model")
    report.facts.append(f"{where}: {url} answers ({path}" + (", the student's tokenizer)" if not warning and
                                                             student is not None else ")"))
