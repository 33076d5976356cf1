"""Pieces every recipe uses: seeding, the optimizer, the run directory, frozen copies and no-grad evaluation of a
model. (A run's data and the prompt cursor: `vlrl.data.splits`, `vlrl.data.cursor`.)"""

from __future__ import annotations

import copy
import fcntl
import json
import math
import os
import random
import socket
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vlrl.config import OptimConfig, Section, dump_config
from vlrl.report import MetricsLogger


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def make_optimizer(
    model: torch.nn.Module, cfg: OptimConfig, module_groups: dict[str, tuple[str, ...]] | None = None, *,
    total_steps: int | None = None,
) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW over trainable parameters, with linear warm-up, then ``cfg.schedule`` over ``total_steps``.

    ``cfg.module_lr`` gives modules their own learning rate; its names are the family's ``module_groups``
    (the policy adapter's) or parameter-name prefixes (`vlrl.train.modules`).
    """
    from vlrl.train.modules import param_groups

    params = param_groups(model, cfg.lr, cfg.module_lr, module_groups or {})
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, cfg=cfg, total_steps=total_steps))
    return optimizer, scheduler


def lr_factor(step: int, *, cfg: OptimConfig, total_steps: int | None) -> float:
    """The learning rate of optimizer step ``step`` (0-based) as a fraction of the peak: ``(step + 1) / warmup``
    during the warm-up, then 1 (constant) or a decay that reaches ``min_lr_ratio`` at the last of ``total_steps``."""
    warmup = cfg.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    if cfg.schedule == "constant":
        return 1.0
    if total_steps is None:
        raise ValueError(f"optim.schedule={cfg.schedule} decays over the stage's train.steps, which this stage has not set")
    span = max(1, total_steps - warmup - 1)
    progress = min(1.0, (step - warmup) / span)
    shape = 1.0 - progress if cfg.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


class NonFiniteError(FloatingPointError):
    """A NaN or infinite loss or gradient norm, found before the optimizer applied it (the gradients are
    cleared, the weights and optimizer state untouched). ``which`` is "loss" or "grad norm"."""

    def __init__(self, which: str, value: float, where: str = "") -> None:
        self.which, self.value = which, value
        super().__init__(f"{where + ': ' if where else ''}the {which} is {value} — the run stopped before the optimizer "
                         "applied it (train.on_nonfinite=skip drops such updates instead; a learning rate too high "
                         "or a loss on empty masks are the usual causes)")


def clip_and_step(model: torch.nn.Module, optimizer, scheduler, grad_clip: float, *, loss: float | None = None,
                  ctx: Any = None) -> float:
    """Clip the global gradient norm (if > 0), step, zero the gradients; return the pre-clip norm.

    The one place an optimizer step happens (SFT, the RL update of both recipes, the critic). A non-finite
    ``loss`` (the step's, when given) or gradient norm raises `NonFiniteError` instead, with the gradients
    cleared and nothing applied; ranks agree on it (``ctx``, a `DistContext`), so all raise at the same step."""
    params = [p for p in model.parameters() if p.grad is not None]
    if grad_clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params]) if params else torch.tensor(0.0)
    value = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP2: a DTensor over all ranks
    flags = [0.0 if loss is None or math.isfinite(loss) else 1.0, 0.0 if math.isfinite(value) else 1.0]
    if ctx is not None:
        flags = ctx.all_reduce_sum(flags)
    if flags[0] or flags[1]:
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteError("loss", loss if loss is not None else math.nan) if flags[0] \
            else NonFiniteError("grad norm", value)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return value


def step_or_skip(model: torch.nn.Module, optimizer, scheduler, grad_clip: float, *, on_nonfinite: str, where: str,
                 loss: float | None = None, ctx: Any = None) -> float | None:
    """`clip_and_step` under ``train.on_nonfinite``: the gradient norm; or, for a non-finite loss or gradient,
    ``stop`` raises `NonFiniteError` naming ``where`` (e.g. "sft step 12") and the value, ``skip`` returns
    None — the update is dropped, the scheduler still advances (the learning rate stays a function of the step)."""
    try:
        return clip_and_step(model, optimizer, scheduler, grad_clip, loss=loss, ctx=ctx)
    except NonFiniteError as err:
        if on_nonfinite != "skip":
            raise NonFiniteError(err.which, err.value, where) from None
        scheduler.step()
        return None


class RunDirBusy(RuntimeError):
    """Another run holds the run directory's lock (the message names its PID)."""


def lock_run_dir(run_dir: Path) -> int:
    """Hold ``run_dir/run.lock`` (``flock``, exclusive) for this run, its PID written in it; the descriptor, to close
    when the run ends (the kernel releases it if the process dies). `RunDirBusy` names the PID of the run that
    holds it: two runs never write one directory (interleaved ``metrics.jsonl``, the other's ``config.yaml``)."""
    fd = os.open(run_dir / RUN_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "unknown"
        os.close(fd)
        raise RunDirBusy(f"out={run_dir}: another run is writing this directory (PID {holder}, {RUN_LOCK}); wait "
                         "for it to end or choose another out=") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    return fd


RUN_LOCK = "run.lock"


def prepare_run_dir(out: str | Path, config: Section, *, keep_metrics_bytes: int | None = None) -> tuple[Path, MetricsLogger]:
    """Create the run directory and hold its lock for the run (`lock_run_dir`; released by ``logger.release()``),
    write the resolved ``config.yaml``, open ``metrics.jsonl`` — a fresh one, or (resuming) the existing one, whose
    first ``keep_metrics_bytes`` are what the checkpoint saw: the clock goes on from their last record. The file is
    cut back to them only once the checkpoint has loaded (`vlrl.train.checkpoint.Checkpointer.load`), so a resume
    that fails leaves it whole."""
    run_dir = Path(out)
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = lock_run_dir(run_dir)
    try:
        (run_dir / "config.yaml").write_text(dump_config(config))
        logger = _open_metrics(run_dir, keep_metrics_bytes)
    except BaseException:
        os.close(lock)
        raise
    logger.on_release.append(lambda: os.close(lock))
    return run_dir, logger


def _open_metrics(run_dir: Path, keep_metrics_bytes: int | None) -> MetricsLogger:
    """A logger writing ``run_dir/metrics.jsonl``: fresh, or (resuming) continued after ``keep_metrics_bytes``."""
    metrics = run_dir / "metrics.jsonl"
    elapsed = 0.0
    if keep_metrics_bytes is not None and metrics.exists():
        with open(metrics, "rb") as handle:
            lines = handle.read(keep_metrics_bytes).decode("utf-8", errors="replace").splitlines()
        elapsed = float(json.loads(lines[-1]).get("time", 0.0)) if lines else 0.0
    elif metrics.exists():
        metrics.unlink()
    logger = MetricsLogger(metrics)
    logger.start -= elapsed  # a resumed run's "time" goes on from the checkpoint's last record
    return logger


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy of ``model`` in eval mode (a reference policy, a teacher)."""
    reference = copy.deepcopy(model).eval()
    for p in reference.parameters():
        p.requires_grad_(False)
    return reference
