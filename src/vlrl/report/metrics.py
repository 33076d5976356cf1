"""`MetricsLogger`: every recipe logs through it — ``metrics.jsonl`` always, other sinks when configured,
a console line, and the live progress bars.

Each record is ``{"stage": ..., "step": ..., "time": seconds since start, <group/name>: value, ...}``.
Names are grouped: ``reward/…``, ``accuracy/…``, ``policy/…``, ``response/…``, ``rollout/…``, ``perf/…``,
``data/…``. The report (`vlrl report`) plots whatever groups appear.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from vlrl.report.progress import LiveProgress
from vlrl.report.sinks import JsonlSink, Sink


class MetricsLogger:
    """Fan records out to the sinks (``metrics.jsonl`` first), print a compact status line, move progress bars.

    Args:
        path: the ``metrics.jsonl`` file, or None for no file (tests).
        sinks: further sinks (TensorBoard, W&B, ...); `add_sink` adds more later.
        quiet: no console lines (records are still kept in ``records`` and written to the sinks).
        progress: ``auto`` (bars only when stderr is a terminal), ``on`` or ``off``.
    """

    def __init__(self, path: str | Path | None, *, console: Console | None = None, quiet: bool = False,
                 sinks: tuple[Sink, ...] | list[Sink] = (), progress: str = "auto") -> None:
        self.path = Path(path) if path is not None else None
        self.sinks: list[Sink] = ([JsonlSink(self.path)] if self.path is not None else []) + list(sinks)
        self.console = console or Console(file=sys.stderr, highlight=False)
        self.quiet = quiet
        self.progress = LiveProgress(self.console, mode="off" if quiet else progress)
        self.start = time.time()
        self.records: list[dict[str, Any]] = []
        self._notes: dict[str, dict[str, Any]] = {}
        self.on_release: list[Any] = []  # called by `release` (the run directory's lock)

    def add_sink(self, sink: Sink) -> None:
        self.sinks.append(sink)

    def note(self, stage: str, metrics: dict[str, Any]) -> None:
        """Hold metrics observed outside a loop (e.g. rollout statistics seen by the engine) until the next
        `log` of ``stage``, which merges them; the loop's own values win on a name clash."""
        self._notes.setdefault(stage, {}).update(metrics)

    def log(self, stage: str, step: int, metrics: dict[str, Any], *, show: tuple[str, ...] = ()) -> None:
        record: dict[str, Any] = {"stage": stage, "step": step, "time": round(time.time() - self.start, 3)}
        record.update({k: _plain(v) for k, v in self._notes.pop(stage, {}).items()})
        record.update({k: _plain(v) for k, v in metrics.items()})
        self.records.append(record)
        for sink in self.sinks:
            sink.write(record)
        keys = show or tuple(k for k in record if k not in ("stage", "step", "time"))[:6]
        parts = " ".join(f"{k}={_fmt(record[k])}" for k in keys if k in record)
        self.progress.stage_step(stage, step, status=parts)
        if not self.quiet:
            self.console.print(f"[bold]{stage}[/bold] step {step} {parts}")

    def table(self, stage: str, step: int, columns: list[str], rows: list[dict[str, Any]]) -> None:
        """A small table (``eval.samples_table``: prompts, responses, rewards) for the sinks that show tables:
        TensorBoard as text, W&B as a ``wandb.Table``; metrics.jsonl keeps metrics only (samples.jsonl has the
        responses)."""
        for sink in self.sinks:
            write = getattr(sink, "write_table", None)
            if write is not None:
                write(stage, step, columns, rows)

    def info(self, message: str) -> None:
        if not self.quiet:
            self.console.print(message)

    def warn(self, message: str) -> None:
        """A problem worth seeing even in quiet mode (printed to the console in yellow)."""
        self.console.print(f"[yellow]warning:[/yellow] {message}")

    def close(self) -> None:
        """Stop the progress display and close every sink (each is closed even if another fails)."""
        self.progress.stop()
        errors = []
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as err:  # a sink failing to flush must not hide the others
                errors.append(f"{type(sink).__name__}: {err}")
        if errors:
            self.warn("closing metric sinks failed: " + "; ".join(errors))

    def release(self) -> None:
        """The run is over (its report written too): run what it held to the end, once (`on_release`)."""
        callbacks, self.on_release = self.on_release, []
        for callback in callbacks:
            callback()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _plain(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; the report reads "nan" back as NaN
    return value


def _fmt(value: Any) -> str:
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:.4g}"
    return str(value)
