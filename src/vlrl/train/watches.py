"""The warnings a step's metrics can raise, said once each and on one rank: most groups without signal
(`ZeroAdvantageWatch`) and answers no longer well-formed (`FormatWatch`) — one object both RL loops update."""

from __future__ import annotations

from vlrl.report import MetricsLogger
from vlrl.train.format_watch import FormatWatch
from vlrl.train.zero_advantage import ZeroAdvantageWatch


class StepWatches:
    """``update(step, metrics)`` after every step; ``enabled=False`` (ranks other than 0) says nothing."""

    def __init__(self, logger: MetricsLogger, stage: str, *, enabled: bool = True) -> None:
        self.watches = [ZeroAdvantageWatch(logger, stage), FormatWatch(logger, stage)] if enabled else []

    def update(self, step: int, metrics: dict[str, float]) -> None:
        for watch in self.watches:
            watch.update(step, metrics)
