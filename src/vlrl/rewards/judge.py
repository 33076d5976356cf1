"""LLM-as-judge: the ``critic`` reward, scored by a model behind the rollout `Engine` protocol.

LLaVA-OV-1.5 lists ``reward/critic.py``; the embodied seed's verifier asks a VLM "Only output: True or
False" and uses the probability of the answer token. Here a `JudgeReward` holds an engine (the in-process
HF engine, or a client of an SGLang-compatible server — the same servers as the policy) and a prompt
template. vlrl.rewards stays free of model code: the engine is anything with ``encode`` and ``generate``,
and vlrl.rollout is imported only when a judge actually runs.

How it is wired (decided here): the registered ``critic`` verifier takes the judge from its metadata
(``critic(response, answer, judge=JudgeReward(...))``), and `RewardExecutor(judge=...)` supplies one for a
whole batch; the executor sends all ``critic`` units of a batch to `JudgeReward.score_batch` — one
``engine.generate`` call, greedy, ``max_new_tokens`` tokens per verdict.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vlrl.rewards.base import RewardOutput, register_reward

DEFAULT_TEMPLATE = (
    "You are grading a model's response against the reference answer.\n"
    "Question: {question}\n"
    "Reference answer: {answer}\n"
    "Response: {response}\n"
    "Is the response's final answer correct? Only output: True or False."
)

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


class _Blank(dict):
    def __missing__(self, key: str) -> str:
        return ""


@dataclass
class JudgeReward:
    """A judge model behind the `Engine` protocol, with its prompt template.

    Attributes:
        engine: an object with ``encode(sample) -> Request`` and ``generate(requests, sampling)``.
        template: ``str.format`` template; fields ``{question}``, ``{answer}``, ``{response}`` and any
            metadata key (a missing field is left empty).
        max_new_tokens: verdict length.
        use_logprob: score = P(positive verdict) from the first generated token's log-prob
            (p if the verdict is positive, 1 − p if negative) instead of 1/0 — the seed's probability.
        max_response_chars: the response is cut to this many characters in the prompt.
    """

    engine: Any
    template: str = DEFAULT_TEMPLATE
    max_new_tokens: int = 8
    use_logprob: bool = False
    max_response_chars: int = 8000

    def prompt(self, response: str, answer: Any, meta: Mapping[str, Any]) -> str:
        fields = _Blank({k: v for k, v in meta.items() if isinstance(v, (str, int, float))})
        fields.update(response=response[: self.max_response_chars], answer=answer, question=meta.get("question", ""))
        return string.Formatter().vformat(self.template, (), fields)

    def score_batch(self, items: Sequence[tuple[str, Any, Mapping[str, Any]]]) -> list[RewardOutput]:
        """Judge every ``(response, answer, meta)`` in one ``engine.generate`` call (greedy)."""
        from vlrl.data.sample import Sample
        from vlrl.rollout.types import SamplingParams

        samples = [Sample(id=f"judge-{i}", task="judge", reward="critic",
                          messages=[{"role": "user", "content": self.prompt(r, a, m)}]) for i, (r, a, m) in enumerate(items)]
        requests = [self.engine.encode(s) for s in samples]
        trajectories = self.engine.generate(requests, SamplingParams(n=1, temperature=0.0,
                                                                     max_new_tokens=self.max_new_tokens))
        if len(trajectories) != len(items):
            raise RuntimeError(f"judge engine returned {len(trajectories)} verdicts for {len(items)} prompts")
        return [self._score(t) for t in trajectories]

    def _score(self, trajectory: Any) -> RewardOutput:
        verdict = parse_verdict(trajectory.response_text)
        if verdict is None:
            return RewardOutput(overall=0.0, parts={"verdict_parsed": 0.0})
        score = verdict
        if self.use_logprob and len(trajectory.behaviour_logp) > 0:
            p = math.exp(float(trajectory.behaviour_logp[0]))
            score = p if verdict >= 0.5 else 1.0 - p
        return RewardOutput(overall=score, parts={"verdict_parsed": 1.0, "verdict": verdict})

    def __call__(self, response: str, answer: Any, **meta: Any) -> RewardOutput:
        return self.score_batch([(response, answer, meta)])[0]


@register_reward("critic", mode="judge", deadline=120.0)
def critic(response: str, answer: Any, *, judge: JudgeReward | None = None, **meta: Any) -> RewardOutput:
    """Judge-model reward in [0, 1]: the `JudgeReward` in ``judge`` grades the response (1/0 verdict, or
    the probability of a positive verdict with ``use_logprob``). Parts: ``verdict_parsed``, ``verdict``.
    Batch scoring supplies the judge (`RewardExecutor(judge=...)`) and batches the calls."""
    if judge is None:
        raise ValueError("critic: no judge; pass judge=JudgeReward(engine) in meta or RewardExecutor(judge=...)")
    return judge(response, answer, **meta)
