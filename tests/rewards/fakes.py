"""Test doubles shared by the reward tests."""

import math
from types import SimpleNamespace


class FakeJudgeEngine:
    """Speaks the Engine protocol: answers True when the prompt's response equals its reference answer."""

    def __init__(self, p=0.9):
        self.calls, self.prompts, self.p = [], [], p

    def encode(self, sample):
        return SimpleNamespace(sample=sample)

    def generate(self, requests, sampling):
        self.calls.append((len(requests), sampling.temperature, sampling.max_new_tokens))
        out = []
        for r in requests:
            prompt = r.sample.messages[0]["content"]
            self.prompts.append(prompt)
            response = prompt.split("Response: ")[1].split("\n")[0]
            answer = prompt.split("Reference answer: ")[1].split("\n")[0]
            verdict = "True" if response.strip() == answer.strip() else "False"
            out.append(SimpleNamespace(response_text=verdict, behaviour_logp=[math.log(self.p)]))
        return out
