"""`vlrl demo`: SFT warm start → eval → RL → eval, and the SFT control trained with the RL stage's budget."""

from __future__ import annotations

import os
import time
from pathlib import Path

from vlrl.config import DemoConfig
from vlrl.eval import EvalResult
from vlrl.models import load_policy
from vlrl.models.policy import LoadOptions
from vlrl.recipes.rl import rl_stage
from vlrl.recipes.run import (
    check_run,
    evaluate_stage,
    load_data,
    load_run_policy,
    open_run,
    reporting,
    run_engine,
    sample_log,
    save_policy,
    summary_json,
    with_lora,
)
from vlrl.recipes.sft import sft_stage
from vlrl.report import MetricsLogger
from vlrl.report.environment import describe, environment
from vlrl.report.samples import SampleLog
from vlrl.train.budget import FlopMeter, control_budget
from vlrl.train.common import write_json
from vlrl.train.result import StageResult


def run_demo(cfg: DemoConfig) -> dict:
    """SFT warm start → eval → RL → eval, and the SFT control: the same SFT checkpoint trained by more SFT with
    the RL stage's budget (``control_budget``: its FLOPs — training and generation, counted by `FlopMeter` —
    or its wall time), evaluated the same way."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("vlrl demo runs in one process; under torchrun or `vlrl launch` use `vlrl sft` and `vlrl rl`")
    start = time.time()
    run_dir, logger = open_run(cfg)
    with reporting(cfg, run_dir, logger):
        summary: dict = {"seed": cfg.seed, "environment": environment()}
        logger.info(describe(summary["environment"]))
        train, test = load_data(cfg, logger)
        summary.update(check_run(cfg, logger, train, test))
        policy = load_run_policy(cfg, logger)
        samples = sample_log(cfg, run_dir)
        engine = run_engine(cfg.rl.rollout, policy, run_dir, logger, samples)
        summary["base"] = evaluate_stage(engine, test, cfg, logger, "base")
        with FlopMeter(policy.model) as meter:  # counts the stages' passes; evaluations sit between snapshots
            summary["sft_train"] = sft_stage(policy, train, cfg.sft, cfg, logger, seed=cfg.seed)
            sft_flops = meter.snapshot()
            sft_dir = save_policy(policy, run_dir / "checkpoints" / "sft", logger)
            summary["sft"] = evaluate_stage(engine, test, cfg, logger, "sft")
            before_rl = meter.snapshot()
            summary["rl_train"] = rl_stage(policy, engine, train, cfg.rl, cfg, logger)
            rl_flops = meter.snapshot() - before_rl
        save_policy(policy, run_dir / "checkpoints" / "rl", logger)
        summary["rl"] = evaluate_stage(engine, test, cfg, logger, "rl")
        if cfg.control:
            summary.update(control_run(cfg, train, test, sft_dir, run_dir, samples, logger, rl_flops=rl_flops, sft_flops=sft_flops,
                                    sft_stats=summary["sft_train"], rl_stats=summary["rl_train"]))
        summary["wall_seconds"] = round(time.time() - start, 1)
        print_summary(logger, summary)
        summary = summary_json(summary)
        write_json(run_dir / "summary.json", summary)
    return summary


def control_run(cfg: DemoConfig, train, test, sft_dir: Path, run_dir: Path, samples: SampleLog, logger: MetricsLogger, *,
             rl_flops, sft_flops, sft_stats: StageResult, rl_stats: StageResult) -> dict:
    """The SFT checkpoint trained by more SFT on the same labelled samples with the RL stage's budget, evaluated."""
    budget = control_budget(cfg.control_budget, rl_flops=rl_flops, rl_seconds=rl_stats.seconds, sft_flops=sft_flops,
                            sft_steps=sft_stats.steps, sft_seconds=sft_stats.seconds)
    control = with_lora(cfg, load_policy(str(sft_dir), dtype=cfg.model.dtype, device=cfg.model.device,
                                          options=LoadOptions.of(cfg.model)))
    steps = budget["control_steps"] or 10**9  # wall: bounded by time only, not by the SFT stage's step count
    stage = cfg.sft.model_copy(update={"train": cfg.sft.train.model_copy(update={"steps": steps})})
    with FlopMeter(control.model) as meter:
        stats = sft_stage(control, train, stage, cfg, logger, seed=cfg.seed + 1, name="sft_control",
                     max_seconds=budget["max_seconds"])
    budget.update(control_flops=meter.flops.total, control_seconds=round(stats.seconds, 1),
                  control_steps=stats.steps)
    save_policy(control, run_dir / "checkpoints" / "sft_control", logger)
    engine = run_engine(cfg.rl.rollout, control, run_dir, logger, samples)
    return {"sft_control": evaluate_stage(engine, test, cfg, logger, "sft_control"), "sft_control_train": stats,
            "budget": budget}


def print_summary(logger: MetricsLogger, summary: dict) -> None:
    """The demo's table (each evaluation's typed `EvalResult`), its control budget and its verdict."""
    from vlrl.report.verdict import demo_verdict

    rows = [("base", "untrained"), ("sft", "SFT checkpoint"), ("rl", "after RL"), ("sft_control", "SFT control")]
    logger.info("held-out accuracy (sampled pass@1 / greedy; strict: right, well-formed and ended):")
    for key, label in rows:
        if key in summary:
            s: EvalResult = summary[key]
            logger.info(f"  {label:16s} {s.accuracy['mean']:.3f} / {s.greedy['mean']:.3f}   strict "
                        f"{s.strict['mean']:.3f} / {s.strict_greedy['mean']:.3f}   well-formed "
                        f"{s.well_formed['mean']:.2f} / {s.well_formed_greedy['mean']:.2f}   "
                        + "  ".join(f"{t}={v:.2f}/{s.greedy[t]:.2f}" for t, v in s.accuracy.items() if t != "mean"))
    budget = summary.get("budget")
    if budget:
        logger.info(f"control budget ({budget['unit']}): {budget['control_steps']} SFT steps; the RL stage's FLOPs "
                    f"({budget['rl_flops']['total']:.3g}) match {budget['flops_matched_steps']} SFT steps, its "
                    f"{budget['rl_seconds']:.0f} s match {budget['wall_matched_steps']} on this machine now")
    verdict = demo_verdict(summary_json(summary))  # (the verdict reads summary.json's layout)
    if verdict:
        logger.info(verdict["sentence"])
    logger.info(f"wall time {summary['wall_seconds']:.0f}s")
