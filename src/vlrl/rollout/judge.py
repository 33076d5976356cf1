"""The judge model behind the ``critic`` reward (`vlrl.rewards.judge`): a `JudgeReward` holds an engine (the
in-process HF engine, or a client of an SGLang-compatible server — the same servers as the policy) and a prompt
template, and scores a batch of responses in one greedy ``engine.generate`` call. It lives with the rollout (it
builds samples and requests for an engine); the verdict parser and the verifier stay in the pure rewards room.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vlrl.data.sample import Sample
from vlrl.rewards.base import RewardOutput
from vlrl.rewards.judge import DEFAULT_TEMPLATE, fill_template, parse_verdict
from vlrl.rollout.types import SamplingParams


class _Blank(dict):
    def __missing__(self, key: str) -> str:
        return ""


@dataclass
class JudgeReward:
    """A judge model behind the `Engine` protocol, with its prompt template.

    Attributes:
        engine: an object with ``encode(sample) -> Request`` and ``generate(requests, sampling)``.
        template: ``str.format`` template; fields ``{question}``, ``{answer}``, ``{response}`` and any
            metadata key (a missing field is left empty); plain names only (`vlrl.rewards.judge.fill_template`).
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

    def __post_init__(self) -> None:
        fill_template(self.template, _Blank())  # a field that is not a plain name is refused here, not per prompt

    def prompt(self, response: str, answer: Any, meta: Mapping[str, Any]) -> str:
        fields = _Blank({k: v for k, v in meta.items() if isinstance(v, (str, int, float))})
        fields.update(response=response[: self.max_response_chars], answer=answer, question=meta.get("question", ""))
        return fill_template(self.template, fields)

    def score_batch(self, items: Sequence[tuple[str, Any, Mapping[str, Any]]]) -> list[RewardOutput]:
        """Judge every ``(response, answer, meta)`` in one ``engine.generate`` call (greedy)."""
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
