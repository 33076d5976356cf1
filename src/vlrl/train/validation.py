"""Validation during training (``eval.every``): held-out accuracy every N steps — verl's ``trainer.test_freq``,
EasyR1's ``trainer.val_freq``, TRL's ``eval_steps`` — and a few prompts with their responses and rewards per
evaluation (``eval.samples_table``, verl's ``log_val_generations``).

A stage's validation is logged as the stage ``val/<stage>`` (``val/rl``, ``val/sft``, ``val/<curriculum stage>``)
at its training step, with the metrics of a held-out evaluation (`vlrl.eval.EvalResult.metrics`: greedy, sampled
accuracy, pass@k per task) and the mean reward: ``metrics.jsonl``, the report's curves and every tracker get it. The
curve starts with the run's initial evaluation (RL: step 0) and ends with its final one, which the recipe computes
anyway; the loop evaluates at the steps in between (every N-th, before the last).

Under torchrun every rank evaluates its share of the prompts (`vlrl.eval.evaluate` with the run's context); rank 0
logs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from vlrl.config import EvalConfig
from vlrl.data import Sample
from vlrl.eval import EvalResult, evaluate
from vlrl.report import MetricsLogger
from vlrl.report.watch import WatchedEngine

TABLE_COLUMNS = ("task", "id", "prompt", "response", "answer", "reward")


class Validation:
    """``eval.every`` for one training stage: call it after every step; it evaluates when one is due.

    Args:
        engine: the stage's engine (it generates with the weights being trained).
        test: the held-out samples.
        settings: the run's ``eval`` section.
        stage: the training stage's name (``rl``, ``sft``, ...); records go to ``val/<stage>``.
        total_steps: the stage's ``train.steps`` (the final evaluation covers the last one).
        ctx: the run's `DistContext` (None: one process).
    """

    def __init__(self, engine: Any, test: list[Sample], settings: EvalConfig, logger: MetricsLogger, *, stage: str,
                 total_steps: int, ctx: Any = None) -> None:
        self.engine, self.test, self.settings, self.logger = engine, test, settings, logger
        self.stage, self.total_steps, self.ctx = stage, total_steps, ctx
        self.done: list[int] = []  # the steps evaluated by the loop
        # held around each evaluation the loop runs: an asynchronous feed's `aside` (the step's weights reach the
        # engine, the rollout admits no prompt meanwhile); set by `vlrl.train.loop.train_rl`
        self.hold: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext

    @property
    def enabled(self) -> bool:
        return self.settings.every > 0 and bool(self.test)

    def due(self, step: int) -> bool:
        return self.enabled and step % self.settings.every == 0 and 0 < step < self.total_steps

    def __call__(self, step: int) -> None:
        """After training step ``step``: evaluate when one is due (every rank calls it; rank 0 logs)."""
        if not self.due(step):
            return
        is_main = self.ctx is None or self.ctx.is_main
        watched = self.engine if isinstance(self.engine, WatchedEngine) else None
        with self.hold(), watched.aside() if watched is not None else contextlib.nullcontext():  # not the rollout
            if watched is not None and is_main:
                with watched.capture() as batches:
                    result = evaluate(self.engine, self.test, self.settings, ctx=self.ctx)
                if watched.samples is not None:
                    watched.samples.write(f"val/{self.stage}", step, batches)
            else:
                result = evaluate(self.engine, self.test, self.settings, ctx=self.ctx)
        self.done.append(step)
        if is_main:
            self.log(step, result)

    def log(self, step: int, result: EvalResult) -> None:
        """Log ``result`` as the stage's validation at ``step`` (also the initial and final evaluations the
        recipe ran, so the curve spans the stage)."""
        if not self.enabled:
            return
        metrics = {**result.metrics(), "reward/mean": result.reward.get("mean", 0.0), "eval/prompts": result.n_prompts}
        self.logger.log(f"val/{self.stage}", step, metrics,
                        show=("accuracy/mean", "greedy/mean", f"pass@{result.k}/mean", "reward/mean"))
        if self.settings.samples_table:
            rows = [{c: example.get(c) for c in TABLE_COLUMNS} for example in result.examples[: self.settings.samples_table]]
            self.logger.table(f"val/{self.stage}", step, list(TABLE_COLUMNS), rows)
