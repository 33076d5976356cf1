"""Pieces every recipe uses: seeding, the optimizer, data loading, the prompt cursor, the run directory, frozen
copies and no-grad evaluation of a model."""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vlrl.config import DataConfig, OptimConfig, Section, dump_config
from vlrl.data import Sample, generate, read_samples
from vlrl.report import MetricsLogger


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def make_optimizer(
    model: torch.nn.Module, cfg: OptimConfig, module_groups: dict[str, tuple[str, ...]] | None = None
) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW over trainable parameters, with linear warm-up to a constant learning rate.

    ``cfg.module_lr`` gives modules their own learning rate; its names are the family's ``module_groups``
    (the policy adapter's) or parameter-name prefixes (`vlrl.train.modules`).
    """
    from vlrl.train.modules import param_groups

    params = param_groups(model, cfg.lr, cfg.module_lr, module_groups or {})
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    warmup = cfg.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0)
    return optimizer, scheduler


def clip_and_step(model: torch.nn.Module, optimizer, scheduler, grad_clip: float) -> float:
    """Clip the global gradient norm (if > 0), step, zero the gradients; return the pre-clip norm."""
    params = [p for p in model.parameters() if p.grad is not None]
    if grad_clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params]) if params else torch.tensor(0.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP2: a DTensor over all ranks


def reward_names_check(sample: Sample) -> None:
    """Reject a sample whose reward names are not registered (the reader adds file and line)."""
    from vlrl.rewards import get_reward

    for name in sample.reward_names():
        get_reward(name)


def load_split(cfg: DataConfig, split: str, logger: MetricsLogger | None = None) -> list[Sample]:
    """The ``train`` or ``test`` samples: read from the configured file, or generated procedurally."""
    path = cfg.train if split == "train" else cfg.test
    if path is None:
        n = cfg.n_train if split == "train" else cfg.n_test
        return generate(cfg.suite, n, split=split, seed=cfg.seed, tasks=cfg.tasks, **cfg.suite_options)
    report = read_samples(path, on_error=cfg.on_error, check=reward_names_check)
    if logger is not None:
        logger.info(f"data {split}: {path}: {report.summary()}")
        if report.skipped:
            logger.log("data", 0, {f"data/{split}_skipped": len(report.skipped), f"data/{split}_read": len(report.samples)})
    if not report.samples:
        raise ValueError(f"{path}: no usable samples ({len(report.skipped)} skipped)")
    return report.samples


class PromptCursor:
    """Endless shuffled passes over a dataset; each epoch's order is fixed by (seed, epoch)."""

    def __init__(self, samples: list[Sample], seed: int) -> None:
        if not samples:
            raise ValueError("no samples to draw prompts from")
        self.samples, self.seed = samples, seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(len(self.samples), generator=generator).tolist()

    def next(self, count: int) -> list[Sample]:
        out = []
        while len(out) < count:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation()
            out.append(self.samples[self._order[self.position]])
            self.position += 1
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state(self, state: dict[str, int]) -> None:
        """Continue from a `state()` (checkpoints): the same epoch order, the same position in it."""
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation()
        if not 0 <= self.position <= len(self._order):
            raise ValueError(f"data cursor position {self.position} is outside the dataset of {len(self._order)} "
                             "samples: the checkpoint was written for different data")


def prepare_run_dir(out: str | Path, config: Section, *, keep_metrics_bytes: int | None = None) -> tuple[Path, MetricsLogger]:
    """Create the run directory, write the resolved ``config.yaml``, open ``metrics.jsonl`` — a fresh one, or
    (resuming) the existing one cut back to ``keep_metrics_bytes``, where the checkpoint left it."""
    run_dir = Path(out)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(config))
    metrics = run_dir / "metrics.jsonl"
    elapsed = 0.0
    if keep_metrics_bytes is not None and metrics.exists():
        with open(metrics, "r+b") as handle:
            handle.truncate(keep_metrics_bytes)
        lines = metrics.read_text().splitlines()
        elapsed = float(json.loads(lines[-1]).get("time", 0.0)) if lines else 0.0
    elif metrics.exists():
        metrics.unlink()
    logger = MetricsLogger(metrics)
    logger.start -= elapsed  # a resumed run's "time" goes on from the checkpoint's last record
    return run_dir, logger


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy of ``model`` in eval mode (a reference policy, a teacher)."""
    reference = copy.deepcopy(model).eval()
    for p in reference.parameters():
        p.requires_grad_(False)
    return reference


@contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[None]:
    """No gradient and eval mode (no dropout) for a teacher-forced pass; the model's mode is restored after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)
