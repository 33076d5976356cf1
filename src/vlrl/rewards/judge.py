"""LLM-as-judge: the ``critic`` reward, scored by a judge model (`vlrl.rollout.judge.JudgeReward`).

LLaVA-OV-1.5 lists ``reward/critic.py``; the embodied seed's verifier asks a VLM "Only output: True or
False" and uses the probability of the answer token. This module holds the pure part — the default prompt, the
verdict parser, the `Judge` protocol and the ``critic`` verifier; the judge that runs a model behind the rollout
`Engine` protocol (the in-process HF engine, or a client of an SGLang-compatible server — the same servers as the
policy) is `vlrl.rollout.judge.JudgeReward`, so vlrl.rewards stays free of model and rollout code.

How it is wired (decided here): the registered ``critic`` verifier takes the judge from its metadata
(``critic(response, answer, judge=JudgeReward(...))``), and `RewardExecutor(judge=...)` supplies one for a
whole batch; the executor sends all ``critic`` units of a batch to `Judge.score_batch` — one
``engine.generate`` call, greedy, ``max_new_tokens`` tokens per verdict.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from vlrl.rewards.base import RewardOutput, register_reward

DEFAULT_TEMPLATE = (
    "You are grading a model's response against the reference answer.\n"
    "Question: {question}\n"
    "Reference answer: {answer}\n"
    "Response: {response}\n"
    "Is the response's final answer correct? Only output: True or False."
)



def fill_template(template: str, fields: Mapping[str, Any], *, where: str = "judge template") -> str:
    """``template`` (``str.format`` syntax) with its ``{name}`` fields from ``fields``. Only plain names are
    allowed: ``str.format`` would follow ``{answer.__class__.__init__.__globals__}`` or ``{answer[0]}`` into any
    object the fields reach, and a template comes from a config — so a field with ``.`` or ``[``, a positional
    ``{}`` or a nested field in a format spec is refused (`ValueError` naming ``where`` and the field)."""
    for _, name, spec, _ in string.Formatter().parse(template):
        if name is None:
            continue
        if not name.isidentifier():
            raise ValueError(f"{where}: field {{{name}}} is not a plain name (only {{question}}, {{answer}}, "
                             "{response} and other names; no attribute, index or positional field)")
        if spec and "{" in spec:
            raise ValueError(f"{where}: field {{{name}}} has a nested field in its format spec")
    return template.format_map(fields)


_POSITIVE = {"true", "yes", "correct", "right"}
_NEGATIVE = {"false", "no", "incorrect", "wrong"}
_FRACTION = re.compile(r"(\d{1,3}(?:\.\d{1,6})?)\s*/\s*(\d{1,3})")
_NUMBER = re.compile(r"\d{1,3}(?:\.\d{1,6})?")


def parse_verdict(text: str) -> float | None:
    """A verdict in [0, 1] from the judge's text, or None if there is none.

    ``True``/``yes``/``correct`` → 1, ``False``/``no``/``incorrect`` → 0 (the first such word counts,
    flipped after ``not``);
    else a score ``a/b`` → a/b (``8/10`` → 0.8); else a number in [0, 1] (``0.7``).
    """
    head = text.strip()[:500]
    words = re.findall(r"[a-z]+", head.lower())
    for i, word in enumerate(words):
        if word in _POSITIVE or word in _NEGATIVE:
            positive = (word in _POSITIVE) != (i > 0 and words[i - 1] == "not")  # "not correct" flips
            return 1.0 if positive else 0.0
    fraction = _FRACTION.search(head)
    if fraction and float(fraction.group(2)) > 0:
        value = float(fraction.group(1)) / float(fraction.group(2))
        return value if 0.0 <= value <= 1.0 else None
    number = _NUMBER.search(head)
    if number and 0.0 <= float(number.group()) <= 1.0:
        return float(number.group())
    return None


class Judge(Protocol):
    """What the ``critic`` verifier and `RewardExecutor` need of a judge (`vlrl.rollout.judge.JudgeReward` is one)."""

    def score_batch(self, items: Sequence[tuple[str, Any, Mapping[str, Any]]]) -> list[RewardOutput]:
        """One `RewardOutput` per ``(response, answer, meta)``, in order."""
        ...

    def __call__(self, response: str, answer: Any, **meta: Any) -> RewardOutput:
        """The verdict on one response."""
        ...


@register_reward("critic", mode="judge", deadline=120.0)
def critic(response: str, answer: Any, *, judge: Judge | None = None, **meta: Any) -> RewardOutput:
    """Judge-model reward in [0, 1]: the `JudgeReward` in ``judge`` grades the response (1/0 verdict, or
    the probability of a positive verdict with ``use_logprob``). Parts: ``verdict_parsed``, ``verdict``.
    Batch scoring supplies the judge (`RewardExecutor(judge=...)`) and batches the calls."""
    if judge is None:
        raise ValueError("critic: no judge; pass judge=JudgeReward(engine) in meta or RewardExecutor(judge=...)")
    return judge(response, answer, **meta)
