"""Live progress for long operations (data, preflight, training stages, rollout, eval, checkpoint save).

`LiveProgress` wraps one `rich.progress.Progress`: a bar per operation with elapsed / remaining time and a
compact status field (the latest metrics, or the phase, e.g. ``rollout 16×8``). It is off unless stderr is
a terminal (``mode="auto"``), so CI logs keep only the plain one-line-per-log output of `MetricsLogger`.

    with progress.task("rl", total=150, stage="rl"):    # the bar follows logger.log("rl", step, ...)
        ...
    with progress.task("save checkpoints/rl"):          # no total: a spinner with elapsed time
        policy.save(...)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


@dataclass
class TaskHandle:
    """One running operation; ``update`` moves its bar or sets its status text."""

    progress: LiveProgress
    task_id: TaskID | None
    stage: str | None

    def update(self, *, completed: float | None = None, status: str | None = None) -> None:
        self.progress._update(self.task_id, completed=completed, status=status)


class LiveProgress:
    """Progress bars on ``console``; ``mode`` is ``auto`` (only on a terminal), ``on`` or ``off``."""

    def __init__(self, console: Console, *, mode: str = "auto") -> None:
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"report.progress: expected auto, on or off, got {mode!r}")
        self.console = console
        self.enabled = mode == "on" or (mode == "auto" and console.is_terminal)
        self._progress: Progress | None = None
        self._open: list[TaskHandle] = []

    def _start(self) -> Progress:
        if self._progress is None:
            self._progress = Progress(
                SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(bar_width=28), MofNCompleteColumn(),
                TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[status]}"),
                console=self.console,
            )
            self._progress.start()
        return self._progress

    @contextmanager
    def task(self, description: str, *, total: float | None = None, stage: str | None = None) -> Iterator[TaskHandle]:
        """Show ``description`` while the block runs; with ``stage``, `MetricsLogger.log` moves the bar."""
        task_id = self._start().add_task(description, total=total, status="") if self.enabled else None
        handle = TaskHandle(self, task_id, stage)
        self._open.append(handle)
        try:
            yield handle
        finally:
            self._open.remove(handle)
            if task_id is not None and self._progress is not None:
                task = next((t for t in self._progress.tasks if t.id == task_id), None)
                if task is not None and task.total is None:
                    self._progress.update(task_id, total=1, completed=1)
                self._progress.stop_task(task_id)
            if not self._open:
                self.stop()

    def stage_step(self, stage: str, step: int, *, status: str | None = None) -> None:
        """Move the bars of every open task following ``stage`` to ``step``."""
        for handle in self._open:
            if handle.stage == stage:
                handle.update(completed=step, status=status)

    def status(self, text: str) -> None:
        """Set the status text of the innermost open operation (e.g. ``rollout 16×8``)."""
        if self._open:
            self._open[-1].update(status=text)

    def _update(self, task_id: TaskID | None, *, completed: float | None, status: str | None) -> None:
        if task_id is None or self._progress is None:
            return
        fields = {} if status is None else {"status": status}
        self._progress.update(task_id, completed=completed, **fields)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
