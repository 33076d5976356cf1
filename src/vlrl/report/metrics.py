"""Metric sinks: every recipe logs through `MetricsLogger` (``metrics.jsonl`` always, a console line).

Each jsonl line is ``{"stage": ..., "step": ..., "time": seconds since start, <group/name>: value, ...}``.
Names are grouped: ``reward/…``, ``accuracy/…``, ``policy/…``, ``response/…``, ``perf/…``, ``data/…``.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console


class MetricsLogger:
    """Append metrics to ``metrics.jsonl`` and print a compact status line."""

    def __init__(self, path: str | Path | None, *, console: Console | None = None, quiet: bool = False) -> None:
        self.path = Path(path) if path is not None else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.console = console or Console(file=sys.stderr, highlight=False)
        self.quiet = quiet
        self.start = time.time()
        self.records: list[dict[str, Any]] = []

    def log(self, stage: str, step: int, metrics: dict[str, Any], *, show: tuple[str, ...] = ()) -> None:
        record = {"stage": stage, "step": step, "time": round(time.time() - self.start, 3)}
        record.update({k: _plain(v) for k, v in metrics.items()})
        self.records.append(record)
        if self.path is not None:
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(record) + "\n")
        if not self.quiet:
            keys = show or tuple(k for k in record if k not in ("stage", "step", "time"))[:6]
            parts = " ".join(f"{k}={_fmt(record[k])}" for k in keys if k in record)
            self.console.print(f"[bold]{stage}[/bold] step {step} {parts}")

    def info(self, message: str) -> None:
        if not self.quiet:
            self.console.print(message)


def _plain(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
