from vlrl.report import MetricsLogger
from vlrl.train.zero_advantage import ZeroAdvantageWatch


class Recorder(MetricsLogger):
    def __init__(self):
        super().__init__(None, quiet=True, progress="off")
        self.warnings = []

    def warn(self, message):
        self.warnings.append(message)


def test_warns_once_when_most_groups_of_a_window_carry_no_signal():
    logger = Recorder()
    watch = ZeroAdvantageWatch(logger, "rl", window=3, threshold=0.5)
    for step, frac in enumerate([0.9, 0.9], start=1):  # a window not yet full: no verdict
        watch.update(step, {"policy/zero_adv_groups_frac": frac})
    assert logger.warnings == []
    watch.update(3, {"policy/zero_adv_groups_frac": 0.6})  # mean (0.9 + 0.9 + 0.6) / 3 = 0.8 > 0.5
    for step in range(4, 10):
        watch.update(step, {"policy/zero_adv_groups_frac": 1.0})
    assert len(logger.warnings) == 1
    assert "80% of the groups in steps 1–3" in logger.warnings[0]
    assert "algo.dynamic_sampling.enabled=true" in logger.warnings[0] and "select.enabled=true" in logger.warnings[0]


def test_no_warning_when_half_or_fewer_carry_no_signal():
    logger = Recorder()
    watch = ZeroAdvantageWatch(logger, "rl", window=2)
    for step, frac in enumerate([0.5, 0.5, 0.2, 0.7], start=1):  # window means 0.5, 0.35, 0.45: never above 0.5
        watch.update(step, {"policy/zero_adv_groups_frac": frac})
    watch.update(5, {})  # a step without the metric is ignored
    assert logger.warnings == []


def test_no_zero_advantage_warning_beside_a_distillation_loss_term():
    """algo.distill's topk term trains every row whatever its advantage: OPD alone has Â = 0 everywhere and no
    zero-advantage warning (`StepWatches(loss_beside_advantage=True)`); without the term the same steps warn."""
    from vlrl.train.watches import StepWatches

    for beside, expected in ((True, 0), (False, 1)):
        logger = Recorder()
        watches = StepWatches(logger, "rl", loss_beside_advantage=beside)
        for step in range(1, 12):
            watches.update(step, {"policy/zero_adv_groups_frac": 1.0})
        assert len(logger.warnings) == expected, (beside, logger.warnings)
