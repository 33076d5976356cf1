"""Checkpoints in one process: atomic save (a crash mid-save leaves the previous one the latest), pruning, the
RNG and cursor round trips, and the errors that name what is wrong. (2-rank saves/loads: test_distributed.py;
resuming after SIGKILL: test_resume.py.)"""

import random
import shutil

import numpy as np
import pytest
import torch

from vlrl.config import CheckpointConfig, OptimConfig
from vlrl.data import generate
from vlrl.data.cursor import PromptCursor
from vlrl.train import checkpoint as ckpt
from vlrl.train.checkpoint import (
    Checkpointer,
    CheckpointError,
    latest_checkpoint,
    resolve_resume,
    rng_state,
    set_rng_state,
)
from vlrl.train.common import clip_and_step, make_optimizer
from vlrl.train.distributed import DistContext


class TwoHeads(torch.nn.Module):
    """``b`` never gets a gradient (as a vision tower on text-only data)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.a(x)


def _train(model, optimizer, scheduler, steps, seed=0):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(4, 3, generator=generator)).pow(2).sum().backward()
        clip_and_step(model, optimizer, scheduler, 1.0)


def _fresh(seed=0):
    torch.manual_seed(seed)
    model = TwoHeads()
    optimizer, scheduler = make_optimizer(model, OptimConfig(lr=0.1, warmup_steps=3))
    return model, optimizer, scheduler


def _save(checkpointer, step, model, optimizer, scheduler, **extra):
    return checkpointer.save(step, stage="sft", module=model, optimizer=optimizer, scheduler=scheduler,
                             cursor={"epoch": 0, "position": step}, carry_over=extra.get("carry_over"))


def test_load_restores_everything_and_training_continues_identically(tmp_path):
    model, optimizer, scheduler = _fresh()
    _train(model, optimizer, scheduler, 2)
    checkpointer = Checkpointer(tmp_path, CheckpointConfig(every=1), DistContext())
    path = _save(checkpointer, 2, model, optimizer, scheduler, carry_over={"ema": torch.tensor([0.5])})
    _train(model, optimizer, scheduler, 2, seed=1)  # the uninterrupted run goes on

    other, opt2, sched2 = _fresh(seed=7)  # different initial weights: all of it must come from the checkpoint
    state = checkpointer.load(path, stage="sft", module=other, optimizer=opt2, scheduler=sched2)
    assert state["step"] == 2 and state["cursor"] == {"epoch": 0, "position": 2}
    assert torch.equal(state["carry_over"]["ema"], torch.tensor([0.5]))
    assert other.b.weight not in opt2.state  # never had a gradient: no AdamW state, as in the uninterrupted run
    assert sched2.last_epoch == 2  # warm-up position
    _train(other, opt2, sched2, 2, seed=1)
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_crash_during_save_leaves_the_previous_checkpoint_the_latest(tmp_path, monkeypatch):
    model, optimizer, scheduler = _fresh()
    checkpointer = Checkpointer(tmp_path, CheckpointConfig(every=1), DistContext())
    _train(model, optimizer, scheduler, 1)
    _save(checkpointer, 1, model, optimizer, scheduler)

    def crash(*args, **kwargs):
        raise OSError("disk full")  # the shards are written, trainer_state.json is not

    monkeypatch.setattr(ckpt, "_write_durably", crash)
    with pytest.raises(CheckpointError, match=r"step 2: writing .*step_00000002.partial/trainer_state.json failed: "
                                              r"OSError: disk full; the previous checkpoint .*step_00000001 is kept"):
        _save(checkpointer, 2, model, optimizer, scheduler)
    assert not (tmp_path / "step_00000002.partial").exists()  # an exception cleans up
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000001"
    monkeypatch.undo()
    # a kill (no clean-up) leaves a partial directory, and a step directory without a manifest: neither counts
    (tmp_path / "step_00000002.partial" / "dcp").mkdir(parents=True)
    (tmp_path / "step_00000003" / "dcp").mkdir(parents=True)
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000001"
    shutil.rmtree(tmp_path / "step_00000003")
    assert _save(checkpointer, 2, model, optimizer, scheduler) == tmp_path / "step_00000002"  # the leftover is replaced
    assert not (tmp_path / "step_00000002.partial").exists()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000002"


def test_only_the_last_keep_checkpoints_stay(tmp_path):
    model, optimizer, scheduler = _fresh()
    checkpointer = Checkpointer(tmp_path, CheckpointConfig(every=1, keep=2), DistContext())
    for step in range(1, 5):
        _train(model, optimizer, scheduler, 1)
        _save(checkpointer, step, model, optimizer, scheduler)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]
    assert checkpointer.due(4) and not Checkpointer(tmp_path, CheckpointConfig(every=0), DistContext()).due(4)


def test_resolve_resume(tmp_path):
    assert resolve_resume(CheckpointConfig(), tmp_path) is None
    assert resolve_resume(CheckpointConfig(resume="auto"), tmp_path) is None  # nothing yet: a fresh start
    (tmp_path / "checkpoints" / "step_00000007").mkdir(parents=True)  # incomplete: no manifest.json
    with pytest.raises(CheckpointError, match="(?s)no intact checkpoint under .*step_00000007 is incomplete: no manifest"):
        resolve_resume(CheckpointConfig(resume="auto"), tmp_path)  # not a silent fresh start over a run's leftovers
    with pytest.raises(CheckpointError, match="checkpoint.resume: .*nowhere is not a directory"):
        resolve_resume(CheckpointConfig(resume=str(tmp_path / "nowhere")), tmp_path)


def test_wrong_stage_and_wrong_model_are_named(tmp_path):
    model, optimizer, scheduler = _fresh()
    _train(model, optimizer, scheduler, 1)
    checkpointer = Checkpointer(tmp_path, CheckpointConfig(every=1), DistContext())
    path = _save(checkpointer, 1, model, optimizer, scheduler)
    with pytest.raises(ValueError, match="a checkpoint of stage 'sft', cannot resume stage 'rl'"):
        checkpointer.load(path, stage="rl", module=model, optimizer=optimizer, scheduler=scheduler)
    other = torch.nn.Linear(3, 2)
    opt, sched = make_optimizer(other, OptimConfig())
    with pytest.raises(ValueError, match="lacks 2 weight.*different model"):
        checkpointer.load(path, stage="sft", module=other, optimizer=opt, scheduler=sched)


def test_rng_state_round_trip():
    state = rng_state()
    drawn = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.random(), np.random.rand(), torch.rand(3)  # move every generator on
    set_rng_state(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == drawn


def test_cursor_resumes_its_order():
    samples = generate("arith", 5, tasks=["add"])
    cursor = PromptCursor(samples, seed=3)
    cursor.next(7)  # into the second epoch
    state = cursor.state()
    expected = [s.id for s in cursor.next(6)]
    again = PromptCursor(samples, seed=3)
    again.load_state(state)
    assert state == {"epoch": 1, "position": 2}
    assert [s.id for s in again.next(6)] == expected
    with pytest.raises(ValueError, match="written for different data"):
        again.load_state({"epoch": 0, "position": 9})
