"""``judge``: feedback on each answer from an LLM judge reached through the `Engine` protocol.

Each model turn is shown to the judge (question, reference answer, the model's answer) with ``template``;
the judge's text is the feedback. The episode ends when the judge's text matches ``accept_pattern`` (or
at ``rollout.agent.max_turns``). The judge is any `Engine` — the in-process engine on a preset or a local model
(``judge: tiny-qwen2``, loaded once per process), or an engine object passed in code (e.g. an HTTP engine
on a real model). The sample's own verifier still gives the reward (on the final answer); the judge only
talks. A judge that raises or hangs is retried by the agent loop like any environment.
"""

from __future__ import annotations

import collections
import functools
import re
from typing import Any

from vlrl.data.sample import Sample
from vlrl.rewards.judge import fill_template
from vlrl.rollout.env import BaseEnv, Observation, StepResult
from vlrl.rollout.envs import register_env
from vlrl.rollout.types import Engine, SamplingParams

TEMPLATE = ("Question: {question}\nReference answer: {answer}\nStudent answer: {response}\n"
            "Give the student one sentence of feedback, then VERDICT: correct or VERDICT: incorrect.")


@register_env("judge")
class JudgeEnv(BaseEnv):
    """LLM-as-judge feedback (text only)."""

    def __init__(self, *, judge: str | Engine = "tiny-qwen2", template: str = TEMPLATE, max_new_tokens: int = 32,
                 temperature: float = 0.0, accept_pattern: str = r"VERDICT:\s*correct", prefix: str = "Feedback: ",
                 judge_seed: int = 0) -> None:
        """
        Args:
            judge: the judge engine, or a model for an in-process one (preset name, local directory, hub id).
            template: the judge's prompt; fields {question}, {answer}, {response} (plain names only:
                `vlrl.rewards.judge.fill_template`).
            max_new_tokens: judge response budget.
            temperature: judge sampling temperature (0 = greedy).
            accept_pattern: regular expression; a judge text matching it ends the episode.
            prefix: put before the judge's text in the observation.
            judge_seed: initialisation seed when ``judge`` is a tiny preset.
        """
        self.engine = judge_engine(judge, judge_seed) if isinstance(judge, str) else judge
        fill_template(template, collections.defaultdict(str), where="rollout.agent.env_kwargs.template")  # refused now
        self.template, self.prefix = template, prefix
        self.sampling = SamplingParams(n=1, temperature=temperature, max_new_tokens=max_new_tokens)
        self.accept = re.compile(accept_pattern)

    def reset(self, sample: Sample) -> Any:
        self.sample = sample
        return None

    def step(self, response_text: str) -> StepResult:
        sample = self.sample
        prompt = fill_template(self.template, {"question": sample.prompt_text().replace("<image>", "").strip(),
                                               "answer": sample.answer, "response": response_text},
                               where="rollout.agent.env_kwargs.template")
        request = Sample(id=f"judge/{sample.id}", task="judge", messages=[{"role": "user", "content": prompt}],
                         reward="answer_format")
        verdict = self.engine.generate([self.engine.encode(request)], self.sampling)[0].response_text
        accepted = bool(self.accept.search(verdict))
        info = {"judge_text": verdict, "reward": float(accepted)}
        if accepted:
            return None, True, info
        return Observation(text=f"{self.prefix}{verdict}"), False, info


@functools.lru_cache(maxsize=4)
def judge_engine(model: str, seed: int = 0) -> Engine:
    """An in-process engine on ``model``, loaded once per process and shared by all judge environments."""
    from vlrl.models import load_policy
    from vlrl.rollout.hf_engine import HFEngine

    return HFEngine(load_policy(model, seed=seed))
