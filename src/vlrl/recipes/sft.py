"""`vlrl sft`: supervised fine-tuning, one stage or staged (LLaVA-OV-1.5: align → midtrain → instruct), evaluated at
the end."""

from __future__ import annotations

import os
from pathlib import Path

from vlrl.config import DataConfig, RolloutConfig, RunConfig, SFTConfig
from vlrl.data import Sample
from vlrl.data.packing import PackingPlan
from vlrl.data.splits import load_split
from vlrl.models import Policy, load_policy
from vlrl.models.policy import LoadOptions
from vlrl.recipes.run import (
    check_run,
    eval_policy,
    evaluate_stage,
    export_final,
    link_final,
    load_data,
    load_run_policy,
    log_last_step,
    open_run,
    reporting,
    run_engine,
    sample_log,
    save_policy,
    summary_json,
    validation_for,
    with_lora,
)
from vlrl.report import MetricsLogger
from vlrl.train.checkpoint import resolve_resume
from vlrl.train.common import write_json
from vlrl.train.distributed import check_scalable, init_distributed
from vlrl.train.result import StageResult
from vlrl.train.runtime import Runtime, make_runtime
from vlrl.train.sft import train_sft
from vlrl.train.validation import Validation


def sft_stage(policy, train, stage, cfg: RunConfig, logger: MetricsLogger, *, seed: int, name: str = "sft",
         max_seconds: float | None = None, plan: PackingPlan | None = None, runtime: Runtime | None = None,
         validate: Validation | None = None) -> StageResult:
    """One SFT stage (`vlrl.train.sft.train_sft`) under its progress bar; its last step logged if the budget cut it."""
    with logger.progress.task(name, total=None if max_seconds else stage.train.steps, stage=name):
        result = train_sft(policy, train, stage, logger=logger, seed=seed, stage_name=name, max_seconds=max_seconds,
                           plan=plan, runtime=runtime, validate=validate)
    log_last_step(logger, name, result)
    return result


def run_sft(cfg: SFTConfig) -> dict:
    """Under torchrun: every rank trains its share of each batch; rank 0 evaluates the exported weights."""
    check_scalable(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    ctx, resume = init_distributed(cfg.dist, cfg.model.device), resolve_resume(cfg.checkpoint, cfg.out)
    run_dir, logger = open_run(cfg, ctx, resume)
    summary: dict = {}
    with reporting(cfg, run_dir, logger, ctx):
        train, test = load_data(cfg, logger)
        setup = check_run(cfg, logger, train, test)
        policy = load_run_policy(cfg, logger, ctx)
        if cfg.stages:  # one process, no resumable checkpoints (check_scalable)
            policy, stats = sft_stages(policy, train, cfg, run_dir, logger, test)
            final, runtime = run_dir / "checkpoints" / "final", Runtime(ctx, policy.model)
            validation = None
        else:
            runtime = make_runtime(cfg, ctx, policy, run_dir, resume)
            validation = validation_for(cfg, run_engine(RolloutConfig(), policy, run_dir, logger, sample_log(cfg, run_dir)),
                                     test, logger, "sft", cfg.train.steps, ctx) if cfg.eval.every else None
            stats = sft_stage(policy, train, cfg, cfg, logger, seed=cfg.seed, plan=packing_plan(cfg.data, logger), runtime=runtime,
                         validate=validation)
            final = export_final(policy, runtime, run_dir / "checkpoints" / "final", logger)
        if ctx.is_main:
            engine = run_engine(RolloutConfig(), eval_policy(policy, runtime, final, cfg), run_dir, logger,
                             sample_log(cfg, run_dir))
            trained = stats[cfg.stages[-1].name] if cfg.stages else stats
            summary = summary_json({"sft": evaluate_stage(engine, test, cfg, logger, "final", validation=validation,
                                                          step=trained.steps), "train": stats, **setup})
            write_json(run_dir / "summary.json", summary)
    return summary


def packing_plan(data: DataConfig, logger: MetricsLogger) -> PackingPlan | None:
    if data.packing_plan is None:
        return None
    plan = PackingPlan.load(data.packing_plan)
    stats = plan.meta.get("stats", {})
    logger.info(f"packing plan {data.packing_plan}: {plan.num_bins} sequences of {plan.capacity} tokens, fill "
                f"{stats.get('fill_ratio', 0):.1%}, {len(plan.truncated)} truncated, {len(plan.dropped)} dropped samples")
    return plan


def sft_stages(policy: Policy, train: list[Sample], cfg: SFTConfig, run_dir: Path, logger: MetricsLogger,
                test: list[Sample] | None = None):
    """Staged SFT (LLaVA-OV-1.5: align → midtrain → instruct): each stage trains with its own data, optimizer
    and trainable modules, is saved to checkpoints/<name>, and the next stage starts from that checkpoint."""
    stats: dict[str, StageResult] = {}
    for k, stage in enumerate(cfg.stages):
        data = stage.data or cfg.data
        samples = train if stage.data is None else load_split(stage.data, "train", logger)
        validation = validation_for(cfg, run_engine(RolloutConfig(), policy, run_dir, logger, sample_log(cfg, run_dir)), test,
                                 logger, stage.name, stage.train.steps) if cfg.eval.every else None
        stats[stage.name] = sft_stage(policy, samples, stage, cfg, logger, seed=cfg.seed, name=stage.name,
                                 plan=packing_plan(data, logger), validate=validation)
        checkpoint = save_policy(policy, run_dir / "checkpoints" / stage.name, logger)
        if k + 1 < len(cfg.stages):  # the next stage continues from this checkpoint, with a fresh optimizer
            policy = with_lora(cfg, load_policy(str(checkpoint), dtype=cfg.model.dtype, device=cfg.model.device,
                                                 min_pixels=cfg.model.min_pixels, max_pixels=cfg.model.max_pixels,
                                                 options=LoadOptions.of(cfg.model)))
    link_final(run_dir, cfg.stages[-1].name)
    return policy, stats
