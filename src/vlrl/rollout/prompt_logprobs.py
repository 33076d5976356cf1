"""Prompt scoring (SGLang's ``input_token_logprobs``): the log-prob of each prompt token given the tokens before it,
under the served weights, at temperature 1 — what a teacher on a server returns for on-policy distillation
(``algo.distill.teacher_urls``: the student's prompt + response sent as one prompt, ``max_new_tokens: 0``).

SGLang 0.5.23 computes these from the raw logits (``log_softmax(logits)``, no temperature: its
``layers/logprob_processor.py``), for the tokens ``origin_input_ids[logprob_start_len:]``, the first of them ``None``
(``scheduler_components/logprob_result_processor.py``: ``[None] + input_token_logprobs[:-1]``); `score_prompts`
computes the same numbers through the trainer's own teacher-forced pass (`vlrl.models.forward.teacher_forced`): the
prompt split after ``start``, the rest scored as a response, so a server's teacher and an in-process one run the
same arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vlrl.models.forward import evaluating, teacher_forced
from vlrl.models.policy import Policy
from vlrl.rollout.types import Request

MAX_SCORED_TOKENS = 16384
"""Tokens (prompt and scored part together) of one scoring forward: requests are scored together up to this many,
a longer one alone (it fits the model's context: admission checked that)."""


def score_prompts(policy: Policy, requests: Sequence[Request], starts: Sequence[int], *,
                  max_tokens: int = MAX_SCORED_TOKENS) -> list[torch.Tensor]:
    """(P,) float per request: log π(ids[j] | ids[:j]) for every j > ``starts[i]``, NaN for j ≤ ``starts[i]``
    (SGLang's ``None``: the first token of its ``logprob_start_len`` slice, and everything before it). A start at
    or past the last token scores nothing."""
    out, todo = [], []
    for i, (request, start) in enumerate(zip(requests, starts, strict=True)):
        length = len(request.prompt_ids)
        out.append(torch.full((length,), float("nan")))
        if 0 <= start < length - 1:
            todo.append(i)
    group: list[int] = []
    tokens = 0
    for i in todo:
        length = len(requests[i].prompt_ids)
        if group and tokens + length > max_tokens:
            _score_group(policy, requests, starts, group, out)
            group, tokens = [], 0
        group.append(i)
        tokens += length
    if group:
        _score_group(policy, requests, starts, group, out)
    return out


def _score_group(policy: Policy, requests: Sequence[Request], starts: Sequence[int], group: list[int],
                 out: list[torch.Tensor]) -> None:
    """One no-grad teacher-forced forward over ``group``'s requests, each split after its start."""
    ids = [[int(t) for t in requests[i].prompt_ids] for i in group]
    split = [starts[i] + 1 for i in group]
    with evaluating(policy.model):
        scores = teacher_forced(policy.model, policy.adapter, [x[:s] for x, s in zip(ids, split, strict=True)],
                                [x[s:] for x, s in zip(ids, split, strict=True)],
                                [requests[i].vision for i in group], pad_token_id=policy.pad_token_id,
                                temperature=1.0)
    logp = scores.logp.float().cpu()
    for row, (i, x, s) in enumerate(zip(group, ids, split, strict=True)):
        out[i][s:] = logp[row, : len(x) - s]


def input_token_logprobs(prompt_ids: Sequence[int], prompt_logp: torch.Tensor, start: int,
                         decode: Sequence[str] | None = None) -> list[list]:
    """SGLang's ``meta_info.input_token_logprobs``: ``[logprob, token id, text]`` for each token of
    ``prompt_ids[start:]`` — the first one's logprob ``None`` — its text ``None`` unless ``decode`` gives each
    token's text (``return_text_in_logprobs``)."""
    out = []
    for j in range(start, len(prompt_ids)):
        value = None if j == start else float(prompt_logp[j])
        out.append([value, int(prompt_ids[j]), None if decode is None else decode[j - start]])
    return out
