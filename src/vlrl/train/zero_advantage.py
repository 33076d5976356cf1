"""Warn when most of an RL run's groups carry no learning signal.

A group whose n responses all score alike has zero advantage under every group-normalised estimator: it costs
a rollout and teaches nothing. When that is most groups, the prompts are too easy or too hard for the policy
(an SFT checkpoint that already answers every prompt the same way, or one that never answers right), and RL
stalls however long it runs. The fraction is logged every step as ``policy/zero_adv_groups_frac``;
`ZeroAdvantageWatch` says it once, with what to do.
"""

from __future__ import annotations

from collections import deque

from vlrl.report import MetricsLogger

ADVICE = ("keep informative prompts with algo.dynamic_sampling.enabled=true (drop all-equal groups, back-fill) or "
          "select.enabled=true (pass@N-vs-pass@1 selection of the prompts before training), or sample more "
          "diverse groups (rollout.n, rollout.temperature); an SFT checkpoint whose pass@k is no higher than its "
          "pass@1 leaves RL nothing to learn")


class ZeroAdvantageWatch:
    """Warn once when the mean ``policy/zero_adv_groups_frac`` over the last ``window`` steps exceeds
    ``threshold`` (default: most groups)."""

    def __init__(self, logger: MetricsLogger, stage: str, *, window: int = 10, threshold: float = 0.5) -> None:
        self.logger, self.stage, self.threshold = logger, stage, threshold
        self.recent: deque[float] = deque(maxlen=window)
        self.warned = False

    def update(self, step: int, metrics: dict[str, float]) -> None:
        frac = metrics.get("policy/zero_adv_groups_frac")
        if frac is None or self.warned:
            return
        self.recent.append(float(frac))
        mean = sum(self.recent) / len(self.recent)
        if len(self.recent) == self.recent.maxlen and mean > self.threshold:
            self.warned = True
            self.logger.warn(f"{self.stage}: {mean:.0%} of the groups in steps {step - len(self.recent) + 1}–{step} had "
                             f"all-equal rewards (zero advantage, no gradient; policy/zero_adv_groups_frac). To fix: {ADVICE}.")
