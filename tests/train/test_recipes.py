"""Recipe helpers: a stage stopped by its time budget between two log steps still logs its last step."""

from vlrl.recipes.run import log_last_step
from vlrl.report import MetricsLogger


def test_last_step_is_logged_once():
    logger = MetricsLogger(None, quiet=True)
    logger.log("sft_control", 10, {"sft/loss": 0.9})
    stats = {"sft/loss": 0.5, "perf/step_seconds": 0.1, "steps": 13, "seconds": 3.2, "epochs": 0}
    log_last_step(logger, "sft_control", stats)
    log_last_step(logger, "sft_control", stats)  # already logged: no duplicate
    assert [(r["step"], r.get("sft/loss")) for r in logger.records] == [(10, 0.9), (13, 0.5)]
    assert "seconds" not in logger.records[1] and "epochs" not in logger.records[1]  # only grouped metrics
    log_last_step(logger, "rl", {"steps": 0, "seconds": 0.0})  # a stage that ran no step logs nothing
    log_last_step(logger, "sft", {"sft/loss": 2.0, "steps": 7})  # never logged (log_every 10): logged now
    assert [(r["stage"], r["step"]) for r in logger.records[2:]] == [("sft", 7)]
