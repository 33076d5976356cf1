"""What every recipe does around its training: the run directory and its metric sinks, the data, the preflight check,
the policy (with LoRA), the engine, evaluations, saving and exporting, ``report.html`` at the end.

    open_run → reporting( load_data → check_run → load_run_policy → train / evaluate_stage → save / export )
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from vlrl.check import CheckReport, PreflightError, preflight, sandbox_isolation
from vlrl.config import RolloutConfig, RunConfig
from vlrl.data import Sample
from vlrl.data.splits import load_splits
from vlrl.eval import EvalResult, evaluate
from vlrl.models import Policy, load_policy
from vlrl.models.policy import DTYPES, LoadOptions, load_processor
from vlrl.report import MetricsLogger, make_sink
from vlrl.report.progress import LiveProgress
from vlrl.report.samples import SampleLog
from vlrl.report.watch import WatchedEngine, watch
from vlrl.rollout import build_engine
from vlrl.rollout.types import WeightPublisher, capability
from vlrl.train.checkpoint import export_hf, metrics_offset
from vlrl.train.common import prepare_run_dir, seed_everything
from vlrl.train.distributed import DistContext, shutdown_distributed
from vlrl.train.result import StageResult
from vlrl.train.runtime import Runtime
from vlrl.train.validation import Validation


def open_run(cfg: RunConfig, ctx: DistContext | None = None, resume: Path | None = None) -> tuple[Path, MetricsLogger]:
    """The run directory (resolved config.yaml, metrics.jsonl) and a logger with the configured sinks. Only
    rank 0 writes files and prints; resuming continues metrics.jsonl from where the checkpoint left it."""
    if ctx is not None and not ctx.is_main:
        return Path(cfg.out), MetricsLogger(None, quiet=True)
    run_dir, logger = prepare_run_dir(cfg.out, cfg, keep_metrics_bytes=metrics_offset(resume))
    if resume is not None:
        logger.info(f"resuming from {resume}")
    logger.progress = LiveProgress(logger.console, mode=cfg.report.progress)
    options = {"wandb": cfg.report.wandb.model_dump(), "mlflow": cfg.report.mlflow.model_dump()}
    for name in cfg.report.sinks:
        logger.add_sink(make_sink(name, run_dir, run_name=run_dir.resolve().name, config=cfg.model_dump(mode="json"),
                                  options=options.get(name, cfg.report.sink_options.get(name, {}))))
    return run_dir, logger


@contextmanager
def reporting(cfg: RunConfig, run_dir: Path, logger: MetricsLogger, ctx: DistContext | None = None) -> Iterator[None]:
    """Close the sinks and write report.html (rank 0) when the block ends, also when it fails; leave the
    process group of a distributed run. Inside the block the ``sandbox`` section is the process's
    ``VLRL_SANDBOX_*`` variables (`vlrl.rewards.sandbox.sandbox_env`), which the reward workers follow."""
    from vlrl.rewards.sandbox import sandbox_env

    settings = sandbox_env(cfg.sandbox.isolation, tree_bound=cfg.sandbox.tree_bound,
                           max_memory_mb=cfg.sandbox.max_memory_mb, max_processes=cfg.sandbox.max_processes)
    previous = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        logger.close()
        try:
            if cfg.report.html and (ctx is None or ctx.is_main) and (run_dir / "metrics.jsonl").exists():
                write_report_html(run_dir, logger)
        finally:
            logger.release()  # the run directory's lock, once everything of the run is written
        if ctx is not None:
            shutdown_distributed(ctx)


def write_report_html(run_dir: Path, logger: MetricsLogger) -> None:
    from vlrl.report.html import write_report

    try:
        with logger.progress.task("report.html"):
            path = write_report([run_dir])
        logger.progress.stop()
        logger.info(f"report: {path}")
    except Exception as err:  # the run's results are saved; a report bug must not hide them, nor pass unseen
        logger.warn(f"report.html not written ({type(err).__name__}: {err}); retry with `vlrl report {run_dir}`")


def load_data(cfg: RunConfig, logger: MetricsLogger) -> tuple[list[Sample], list[Sample]]:
    with logger.progress.task("data"):
        return load_splits(cfg.data, logger)  # a training file without a test file: a seeded share held out


def check_run(cfg: RunConfig, logger: MetricsLogger, train: list[Sample], test: list[Sample]) -> dict:
    """The preflight check on the loaded data; raises `PreflightError` listing every problem. Returns what
    summary.json records of the set-up: ``{"sandbox": {...}}`` (the isolation the ``code`` reward's programs
    get, logged once; `vlrl.check.sandbox_isolation`) when the data runs programs, else ``{}``."""
    from vlrl.rewards.sandbox import SandboxUnavailable

    if cfg.check.enabled:
        with logger.progress.task("preflight check"):
            report = preflight(cfg, splits={"train": train, "test": test})
        if not report.ok:
            raise PreflightError(report)
        for warning in report.warnings:
            logger.warn(str(warning))
    try:
        record = sandbox_isolation(cfg, {"train": train, "test": test})
    except SandboxUnavailable as err:  # check.enabled=false: still refused, in the preflight's words
        refused = CheckReport()
        refused.problem("sandbox.isolation", str(err))
        raise PreflightError(refused) from None
    if record is None:
        return {}
    message = (f"code sandbox: isolation {record['isolation']} (sandbox.isolation {record['setting']}): "
               f"{record['description']}; process tree: {record['tree_bound']}")
    (logger.warn if record["isolation"] == "none" or "no cgroup" in record["tree_bound"] else logger.info)(message)
    return {"sandbox": record}


def load_run_policy(cfg: RunConfig, logger: MetricsLogger, ctx: DistContext | None = None) -> Policy:
    """The policy (``model.lora``: with its adapters). Under FSDP2 with ``dist.rank0_load`` the ranks other than 0
    build it on the meta device — tokenizer, processor and module tree, no weights — and `make_runtime` gives
    them their shards of rank 0's weights (`vlrl.train.distributed.shard`)."""
    seed_everything(cfg.seed)
    device = str(ctx.device if ctx is not None else cfg.model.device)
    on_meta = (ctx is not None and ctx.enabled and not ctx.is_main and cfg.dist.strategy == "fsdp"
               and cfg.dist.rank0_load and not whole_copy_per_rank(cfg))
    with logger.progress.task("load policy"):
        if on_meta:
            policy = load_processor(cfg.model.path, seed=cfg.model.init_seed, min_pixels=cfg.model.min_pixels,
                                    max_pixels=cfg.model.max_pixels, options=LoadOptions.of(cfg.model))
            policy.model.to(dtype=DTYPES[cfg.model.dtype])
        else:
            policy = load_policy(cfg.model.path, dtype=cfg.model.dtype, device=device, seed=cfg.model.init_seed,
                                 min_pixels=cfg.model.min_pixels, max_pixels=cfg.model.max_pixels,
                                 options=LoadOptions.of(cfg.model))
    attention = getattr(policy.model.config, "_attn_implementation", None)
    logger.info(f"policy {policy.source}: {policy.num_parameters() / 1e6:.2f}M parameters, family {policy.adapter.family}, "
                f"attention {attention}")
    return with_lora(cfg, policy, logger)


def whole_copy_per_rank(cfg: RunConfig) -> bool:
    """An asynchronous run without rollout servers generates on every rank with a private whole copy of the policy
    (`vlrl.rollout.threaded_engine.ThreadedEngine`, built before the model is sharded): every rank loads the whole
    model, ``dist.rank0_load`` or not (a rank built on the meta device had nothing to copy)."""
    rollout = getattr(cfg, "rollout", None)
    return rollout is not None and rollout.mode == "async" and not rollout.servers.urls


def with_lora(cfg: RunConfig, policy: Policy, logger: MetricsLogger | None = None) -> Policy:
    """``model.lora``: inject the adapters (`vlrl.models.lora`); a policy reloaded between stages gets fresh
    adapters on the previous stage's merged weights."""
    if cfg.model.lora is None:
        return policy
    from vlrl.models.lora import apply_lora

    apply_lora(policy, cfg.model.lora)
    trainable = sum(p.numel() for p in policy.model.parameters() if p.requires_grad)
    if logger is not None:
        logger.info(f"LoRA r={cfg.model.lora.r} α={cfg.model.lora.alpha:g}: {trainable / 1e6:.3f}M trainable parameters "
                    f"of {policy.num_parameters() / 1e6:.2f}M")
    return policy


def run_engine(rollout: RolloutConfig, policy: Policy, run_dir: Path, logger: MetricsLogger, samples: SampleLog, *,
            sync_weights: bool = True) -> WatchedEngine:
    """The engine of a run or stage (`vlrl.rollout.build_engine`: in-process / threaded / rollout servers, the
    configured rollout function), watched by the report. ``sync_weights``: push the policy to the servers as
    version 0 (rank 0 alone under torchrun)."""
    return watch(build_engine(rollout, policy, run_dir=run_dir, sync_weights=sync_weights), logger, samples)


def share_servers(engine, ctx: DistContext) -> None:
    """``rollout.servers.urls`` under torchrun: every rank generates its share of each step on the servers, and weight
    updates become collective calls in which rank 0 alone updates the servers (`HTTPEngine.join_trainer_ranks`)."""
    servers = capability(engine, WeightPublisher)
    if servers is not None and ctx.enabled:
        servers.join_trainer_ranks(ctx.rank, ctx.world_size)


def save_policy(policy: Policy, target: Path, logger: MetricsLogger) -> Path:
    with logger.progress.task(f"save {target.parent.name}/{target.name}"):
        return policy.save(target)


def evaluate_stage(engine: WatchedEngine, test, cfg: RunConfig, logger: MetricsLogger, stage: str, *,
          validation: Validation | None = None, step: int = 0) -> EvalResult:
    """Evaluate on the held-out prompts, log ``eval/<stage>`` and return the typed result (`EvalResult`);
    ``validation`` (``eval.every``): the result is also its curve's point at ``step`` (the start or the end)."""
    with logger.progress.task(f"eval/{stage}"), engine.capture() as batches:
        result: EvalResult = evaluate(engine, test, cfg.eval)
    engine.samples.write(f"eval/{stage}", 0, batches)
    logger.log(f"eval/{stage}", 0, result.metrics(),
               show=("accuracy/mean", "greedy/mean", f"pass@{result.k}/mean", "strict/mean", "well_formed/mean"))
    if validation is not None:
        validation.log(step, result)
    return result


def validation_for(cfg: RunConfig, engine, test, logger: MetricsLogger, stage: str, total_steps: int,
                ctx: DistContext | None = None) -> Validation | None:
    """``eval.every``: the stage's validation during training (None when off)."""
    if not cfg.eval.every:
        return None
    return Validation(engine, test, cfg.eval, logger, stage=stage, total_steps=total_steps, ctx=ctx)


def log_last_step(logger: MetricsLogger, stage: str, result: StageResult) -> None:
    """A stage stopped by its time budget between two ``log_every`` steps: log its last step, so the curves
    (and metrics.jsonl) end where training ended (a run that trained no step — resumed from its last checkpoint —
    logs nothing)."""
    logged = [r["step"] for r in logger.records if r["stage"] == stage]
    if result.steps and result.trained and (not logged or logged[-1] != result.steps):
        logger.log(stage, result.steps, result.metrics)


def summary_json(summary: dict[str, Any]) -> dict[str, Any]:
    """A recipe's summary as ``summary.json`` holds it: each typed record (an `EvalResult`, a `StageResult`) in its
    JSON layout (``to_dict``), nested dictionaries converted too."""
    if hasattr(summary, "to_dict"):
        return summary.to_dict()
    if isinstance(summary, dict):
        return {k: summary_json(v) for k, v in summary.items()}
    return summary


def sample_log(cfg: RunConfig, run_dir: Path) -> SampleLog:
    return SampleLog(run_dir, per_task=cfg.report.samples_per_task)


def export_final(policy: Policy, runtime: Runtime, target: Path, logger: MetricsLogger) -> Path:
    """The final weights in the transformers layout (gathered from all ranks under DDP/FSDP2)."""
    with logger.progress.task(f"save {target.parent.name}/{target.name}"):
        return export_hf(policy, runtime.module, target, runtime.ctx)


def eval_policy(policy: Policy, runtime: Runtime, exported: Path, cfg: RunConfig) -> Policy:
    """What rank 0 evaluates: the trained policy itself, or (distributed) the exported full weights."""
    if not runtime.ctx.enabled:
        return policy
    return load_policy(str(exported), dtype=cfg.model.dtype, device=str(runtime.ctx.device),
                       min_pixels=cfg.model.min_pixels, max_pixels=cfg.model.max_pixels, options=LoadOptions.of(cfg.model))


def link_final(run_dir: Path, stage: str) -> None:
    """checkpoints/final → checkpoints/<last stage>."""
    final = run_dir / "checkpoints" / "final"
    if final.is_symlink() or final.is_file():
        final.unlink()
    elif final.is_dir():
        shutil.rmtree(final)
    final.symlink_to(stage, target_is_directory=True)
