"""What a training loop hands back to its recipe: `StageResult` — a typed record, not a dict whose metric keys are told
apart from its counters by a ``"/"`` in their name."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class StageResult:
    """One training stage's outcome (`vlrl.train.sft.train_sft`, `vlrl.train.loop.train_rl`).

    Attributes:
        steps: the step the stage reached (counted from 1; a resumed stage counts its earlier steps).
        seconds: the wall time of this run of the loop.
        metrics: the last step's metrics, as logged (empty when this run trained no step: nothing to train, or
            resumed from the stage's last checkpoint).
        epochs: SFT: the data cursor's epoch at the end; None for RL.
        select: RL with ``select.enabled``: the prompt selection's summary (`vlrl.recipes.select`), else None.
    """

    steps: int
    seconds: float
    metrics: dict[str, float] = field(default_factory=dict)
    epochs: int | None = None
    select: dict[str, Any] | None = None

    @property
    def trained(self) -> bool:
        """This run of the loop trained at least one step (its last step's metrics are in ``metrics``)."""
        return bool(self.metrics)

    def to_dict(self) -> dict[str, Any]:
        """The ``summary.json`` layout: the last step's metrics, ``steps``, ``seconds`` (and ``epochs``, ``select``)."""
        out: dict[str, Any] = {**self.metrics, "steps": self.steps, "seconds": self.seconds}
        if self.epochs is not None:
            out["epochs"] = self.epochs
        if self.select is not None:
            out["select"] = self.select
        return out
