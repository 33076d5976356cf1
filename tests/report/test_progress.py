"""Live progress: bars on a terminal, nothing at all when stderr is not one (CI logs stay plain)."""

import io

import pytest
from rich.console import Console

from vlrl.report import MetricsLogger
from vlrl.report.progress import LiveProgress


def test_quiet_when_not_a_terminal():
    out = io.StringIO()
    console = Console(file=out)  # a StringIO is not a terminal
    progress = LiveProgress(console)
    assert not progress.enabled
    with progress.task("rl", total=3, stage="rl") as task:
        task.update(completed=2, status="reward 0.5")
        progress.status("rollout 16×8")
    assert out.getvalue() == ""


def test_bars_follow_the_logged_steps_on_a_terminal():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    logger = MetricsLogger(None, console=console, quiet=False, progress="auto")
    assert logger.progress.enabled
    with logger.progress.task("rl", total=3, stage="rl"):
        for step in (1, 2, 3):
            logger.log("rl", step, {"reward/mean": 0.5}, show=("reward/mean",))
    with logger.progress.task("save checkpoints/rl"):
        pass
    text = out.getvalue()
    assert "3/3" in text and "reward/mean=0.5" in text and "save checkpoints/rl" in text
    assert logger.progress._progress is None  # stopped once no operation is open


def test_mode_is_validated():
    with pytest.raises(ValueError, match="report.progress"):
        LiveProgress(Console(), mode="sometimes")
    assert not LiveProgress(Console(force_terminal=True), mode="off").enabled
    assert LiveProgress(Console(file=io.StringIO()), mode="on").enabled
