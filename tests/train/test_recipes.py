"""Recipe helpers: a stage stopped by its time budget between two log steps still logs its last step."""

from vlrl.recipes.run import log_last_step
from vlrl.report import MetricsLogger
from vlrl.train.result import StageResult


def test_last_step_is_logged_once():
    logger = MetricsLogger(None, quiet=True)
    logger.log("sft_control", 10, {"sft/loss": 0.9})
    stats = StageResult(13, 3.2, {"sft/loss": 0.5, "perf/step_seconds": 0.1}, epochs=0)
    log_last_step(logger, "sft_control", stats)
    log_last_step(logger, "sft_control", stats)  # already logged: no duplicate
    assert [(r["step"], r.get("sft/loss")) for r in logger.records] == [(10, 0.9), (13, 0.5)]
    assert "seconds" not in logger.records[1] and "epochs" not in logger.records[1]  # only grouped metrics
    log_last_step(logger, "rl", StageResult(0, 0.0))  # a stage that ran no step logs nothing
    log_last_step(logger, "rl", StageResult(5, 0.1))  # resumed from its last checkpoint: no new step, nothing logged
    log_last_step(logger, "sft", StageResult(7, 1.0, {"sft/loss": 2.0}))  # never logged (log_every 10): logged now
    assert [(r["stage"], r["step"]) for r in logger.records[2:]] == [("sft", 7)]
    assert StageResult(7, 1.0, {"sft/loss": 2.0}, epochs=1).to_dict() == {"sft/loss": 2.0, "steps": 7, "seconds": 1.0,
                                                                         "epochs": 1}
