"""Warn when an RL run's answers stop being well-formed.

A policy can win reward while its answers break: with a lenient verifier that reads the first ``<answer>`` block,
``<answer>1</answer>1</answer>1…`` (truncated at the token budget) scores as right, and the demo at seed 0 went
there (issue 52) — held-out answers 100 % well-formed after SFT, 0 % after RL, and nothing said so. The fraction of
the step's responses that ended and have their sample's answer form is logged every step as
``response/well_formed_frac``; `FormatWatch` compares it with its value at the start of RL and says so once when it
falls, with both figures and what to do.
"""

from __future__ import annotations

from collections import deque

from vlrl.report import MetricsLogger

ADVICE = ("keep algo.strict_reward=true (the default: a truncated or ill-formed response earns no accuracy "
          "reward), add a format verifier to the reward (e.g. data.reward={number: 0.9, answer_format: 0.1}), "
          "punish or mask truncated responses (algo.reward_shaping overlong_penalty, algo.mask_truncated), or lower "
          "optim.lr; check the answers themselves in the run's samples")


class FormatWatch:
    """Warn once when the mean ``response/well_formed_frac`` over the last ``window`` steps is more than ``margin``
    below its mean over the first ``window`` steps of the stage."""

    def __init__(self, logger: MetricsLogger, stage: str, *, window: int = 10, margin: float = 0.2) -> None:
        self.logger, self.stage, self.margin = logger, stage, margin
        self.start: list[float] = []
        self.recent: deque[tuple[float, float]] = deque(maxlen=window)  # (well-formed, truncated) fractions
        self.window = window
        self.warned = False

    def update(self, step: int, metrics: dict[str, float]) -> None:
        frac = metrics.get("response/well_formed_frac")
        if frac is None or self.warned:
            return
        if len(self.start) < self.window:
            self.start.append(float(frac))
        self.recent.append((float(frac), float(metrics.get("response/truncated_frac", 0.0))))
        if len(self.start) < self.window or len(self.recent) < self.window:
            return
        before = sum(self.start) / len(self.start)
        now = sum(f for f, _ in self.recent) / len(self.recent)
        if before - now > self.margin:
            self.warned = True
            truncated = sum(t for _, t in self.recent) / len(self.recent)
            self.logger.warn(
                f"{self.stage}: well-formed answers fell from {before:.0%} of the responses (steps 1–{self.window}) to "
                f"{now:.0%} (steps {step - self.window + 1}–{step}; {truncated:.0%} truncated) — "
                f"response/well_formed_frac. The policy is learning answers a parser refuses. To fix: {ADVICE}.")
