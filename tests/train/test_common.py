"""The learning-rate schedules of `vlrl.train.common.make_optimizer`."""

import pytest
import torch

from vlrl.config import OptimConfig
from vlrl.train.common import make_optimizer


def _lrs(steps: int, total: int | None, **optim) -> list[float]:
    model = torch.nn.Linear(2, 1)
    optimizer, scheduler = make_optimizer(model, OptimConfig(lr=1.0, **optim), total_steps=total)
    seen = []
    for _ in range(steps):
        seen.append(optimizer.param_groups[0]["lr"])  # the lr optimizer step k uses
        optimizer.step()
        scheduler.step()
    return seen


def test_linear_and_cosine_schedules_decay_from_the_peak_to_the_floor_at_the_last_step():
    # linear, 5 steps, no warm-up: span 4 → 1, 3/4, 1/2, 1/4, 0
    assert _lrs(5, 5, schedule="linear") == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    # with a floor of 0.2: 0.2 + 0.8 × (1, 3/4, 1/2, 1/4, 0)
    assert _lrs(5, 5, schedule="linear", min_lr_ratio=0.2) == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2])
    # cosine, 2 warm-up steps of 6: 1/2, 1, then ½(1 + cos(π·k/3)) for k = 1..3 after the peak: 0.75, 0.25, 0
    assert _lrs(6, 6, schedule="cosine", warmup_steps=2) == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.25, 0.0])
    # constant (the default) keeps the warm-up's end, with or without a step count
    assert _lrs(4, None, warmup_steps=2) == pytest.approx([0.5, 1.0, 1.0, 1.0])


def test_a_decaying_schedule_without_a_step_count_is_refused_by_name():
    with pytest.raises(ValueError, match="optim.schedule=cosine"):
        _lrs(1, None, schedule="cosine")
