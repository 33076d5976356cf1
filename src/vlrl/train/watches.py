"""The warnings a step's metrics can raise, said once each and on one rank: most groups without signal
(`ZeroAdvantageWatch`) and answers no longer well-formed (`FormatWatch`) — one object both RL loops update."""

from __future__ import annotations

from vlrl.report import MetricsLogger
from vlrl.train.format_watch import FormatWatch
from vlrl.train.zero_advantage import ZeroAdvantageWatch


class StepWatches:
    """``update(step, metrics)`` after every step; ``enabled=False`` (ranks other than 0) says nothing;
    ``loss_beside_advantage`` (algo.distill's topk term): a zero-advantage group still trains, so no
    zero-advantage warning."""

    def __init__(self, logger: MetricsLogger, stage: str, *, enabled: bool = True,
                 loss_beside_advantage: bool = False) -> None:
        watches = [FormatWatch(logger, stage)] if loss_beside_advantage else [ZeroAdvantageWatch(logger, stage),
                                                                              FormatWatch(logger, stage)]
        self.watches = watches if enabled else []

    def update(self, step: int, metrics: dict[str, float]) -> None:
        for watch in self.watches:
            watch.update(step, metrics)
