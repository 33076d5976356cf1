"""`FormatWatch` (issue 52): one warning when the well-formed fraction falls from its value at the start of RL."""

from tests.train.test_zero_advantage import Recorder

from vlrl.train.format_watch import FormatWatch


def test_warns_once_when_well_formed_answers_fall_by_more_than_the_margin():
    logger = Recorder()
    watch = FormatWatch(logger, "rl", window=3, margin=0.2)
    fracs = [1.0, 1.0, 0.97, 0.9, 0.8, 0.5, 0.2, 0.0, 0.0]
    for step, frac in enumerate(fracs, start=1):
        watch.update(step, {"response/well_formed_frac": frac, "response/truncated_frac": 1.0 - frac})
    # start: mean(1.0, 1.0, 0.97) = 0.99; windows: (0.97, 0.9, 0.8) 0.89, (0.9, 0.8, 0.5) 0.733 → 0.257 below: warn
    # at step 6, never again
    assert len(logger.warnings) == 1
    message = logger.warnings[0]
    assert "fell from 99% of the responses (steps 1–3) to 73% (steps 4–6; 27% truncated)" in message
    assert "algo.strict_reward=true" in message and "response/well_formed_frac" in message


def test_no_warning_while_answers_stay_well_formed_or_start_broken():
    for fracs in ([1.0, 0.95, 0.9, 0.85, 0.82, 0.81], [0.1, 0.0, 0.1, 0.0, 0.0, 0.0]):  # falls 0.18; starts broken
        logger = Recorder()
        watch = FormatWatch(logger, "rl", window=2, margin=0.2)
        for step, frac in enumerate(fracs, start=1):
            watch.update(step, {"response/well_formed_frac": frac})
        watch.update(len(fracs) + 1, {})  # a step without the metric is ignored
        assert logger.warnings == [], fracs
