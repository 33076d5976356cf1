"""`vlrl rl`: GRPO-family RL with verifiable rewards — one stage or a curriculum (LLaVA-OV-1.5-RL: answer-only, then
chain-of-thought), evaluated before and after."""

from __future__ import annotations

import os
from pathlib import Path

from vlrl.config import RLConfig, RunConfig
from vlrl.data import Sample
from vlrl.data.curriculum import with_template
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
    share_servers,
    summary_json,
    validation_for,
    with_lora,
)
from vlrl.recipes.select import select_for_training
from vlrl.report import MetricsLogger
from vlrl.report.watch import WatchedEngine
from vlrl.rollout import close_engine
from vlrl.synth.workflow import syn_eval_samples
from vlrl.train.checkpoint import resolve_resume
from vlrl.train.common import write_json
from vlrl.train.distributed import check_scalable, init_distributed
from vlrl.train.loop import train_rl
from vlrl.train.result import StageResult
from vlrl.train.runtime import Runtime, make_runtime
from vlrl.train.validation import Validation


def rl_stage(policy, engine: WatchedEngine, train, stage, cfg: RunConfig, logger: MetricsLogger, name: str = "rl",
        runtime: Runtime | None = None, validate: Validation | None = None) -> StageResult:
    """One RL stage under its progress bar and the report's watch (with ``select.enabled``, on the prompts the
    starting policy's selection kept); its last step logged if the budget cut it."""
    selected = None
    if stage.select.enabled:  # pass@N-vs-pass@1 selection of the prompts, by the starting policy
        if runtime is not None and runtime.ctx.enabled:
            raise ValueError("select.enabled runs in one process; under torchrun run `vlrl data select` first and "
                             "train on its selected.jsonl")
        train, selected = select_for_training(engine, train, stage.select, stage.rollout, logger=logger, stage=name,
                                              run_dir=logger.path.parent if logger.path else None, model=cfg.model.path,
                                              strict=stage.algo.strict_reward)
    with logger.progress.task(name, total=stage.train.steps, stage=name), \
            engine.training(name, total_steps=stage.train.steps, snapshots=cfg.report.rl_snapshots):
        stats = train_rl(policy, engine, train, stage, logger=logger, seed=cfg.seed, stage_name=name,
                         runtime=runtime, validate=validate)
    stats.select = selected
    log_last_step(logger, name, stats)
    return stats


def run_rl(cfg: RLConfig) -> dict:
    """Under torchrun: every rank generates and trains on its share of each step (in-process rollout); rank 0
    evaluates the initial weights and the exported final weights. A resumed run skips the initial evaluation
    (metrics.jsonl already holds it)."""
    check_scalable(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    ctx, resume = init_distributed(cfg.dist, cfg.model.device), resolve_resume(cfg.checkpoint, cfg.out)
    run_dir, logger = open_run(cfg, ctx, resume)
    summary: dict = {}
    with reporting(cfg, run_dir, logger, ctx):
        train, test = load_data(cfg, logger)
        test = syn_eval_samples(cfg.synth, test)  # Syn-GRPO: held-out prompts ask for the training template
        summary.update(check_run(cfg, logger, train, test))
        policy = load_run_policy(cfg, logger, ctx)
        if cfg.stages:  # one process, no resumable checkpoints (check_scalable)
            summary = summary_json({**summary, **rl_stages(policy, train, test, cfg, run_dir, logger)})
            write_json(run_dir / "summary.json", summary)
            return summary
        # in-process, threaded (rollout.mode=async) or rollout.servers.urls over HTTP; single- or multi-turn
        # (rollout.servers.urls under torchrun: rank 0 gives the servers the initial weights, every rank generates on them)
        engine = run_engine(cfg.rollout, policy, run_dir, logger, sample_log(cfg, run_dir), sync_weights=ctx.is_main)
        validation = validation_for(cfg, engine, test, logger, "rl", cfg.train.steps, ctx)
        try:
            if ctx.is_main and resume is None:
                summary["initial"] = evaluate_stage(engine, test, cfg, logger, "initial", validation=validation)
            runtime = make_runtime(cfg, ctx, policy, run_dir, resume)  # (collective: rank 0's servers are ready)
            share_servers(engine, ctx)
            stats = rl_stage(policy, engine, train, cfg, cfg, logger, runtime=runtime, validate=validation)
            final = export_final(policy, runtime, run_dir / "checkpoints" / "final", logger)
            if ctx.is_main:  # the servers hold the final weights; an in-process engine must load the exported ones
                evaluator = engine if not ctx.enabled or cfg.rollout.servers.urls else \
                    run_engine(cfg.rollout, eval_policy(policy, runtime, final, cfg), run_dir, logger, engine.samples)
                summary.update({"rl": evaluate_stage(evaluator, test, cfg, logger, "final", validation=validation,
                                                     step=stats.steps), "train": stats})
        finally:
            close_engine(engine)
        summary = summary_json(summary)
        if ctx.is_main:
            write_json(run_dir / "summary.json", summary)
    return summary


def rl_stages(policy: Policy, train: list[Sample], test: list[Sample], cfg: RLConfig, run_dir: Path,
               logger: MetricsLogger) -> dict:
    """RL curriculum (LLaVA-OV-1.5-RL: answer-only, then chain-of-thought): each stage trains on its own data
    with its own prompt template, is saved to checkpoints/<name> and evaluated (held-out prompts in the same
    template), and the next stage starts from that checkpoint."""
    summary: dict = {"train": {}}
    for k, stage in enumerate(cfg.stages):
        samples = train if stage.data is None else load_split(stage.data, "train", logger)
        held_out = test
        if stage.prompt_template is not None:
            samples, held_out = with_template(samples, stage.prompt_template), with_template(test, stage.prompt_template)
        engine = run_engine(stage.rollout, policy, run_dir, logger, sample_log(cfg, run_dir))
        validation = validation_for(cfg, engine, held_out, logger, stage.name, stage.train.steps)
        try:
            if k == 0:
                summary["initial"] = evaluate_stage(engine, held_out, cfg, logger, "initial", validation=validation)
            summary["train"][stage.name] = rl_stage(policy, engine, samples, stage, cfg, logger, name=stage.name,
                                               validate=validation)
            checkpoint = save_policy(policy, run_dir / "checkpoints" / stage.name, logger)
            summary[stage.name] = evaluate_stage(engine, held_out, cfg, logger, stage.name, validation=validation,
                                        step=summary["train"][stage.name].steps)
        finally:
            close_engine(engine)
        if k + 1 < len(cfg.stages):
            policy = with_lora(cfg, load_policy(str(checkpoint), dtype=cfg.model.dtype, device=cfg.model.device,
                                                 min_pixels=cfg.model.min_pixels, max_pixels=cfg.model.max_pixels,
                                                 options=LoadOptions.of(cfg.model)))
    summary["rl"] = summary[cfg.stages[-1].name]
    link_final(run_dir, cfg.stages[-1].name)
    return summary
