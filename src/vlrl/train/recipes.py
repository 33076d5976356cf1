"""The runnable recipes behind `vlrl sft`, `vlrl rl` and `vlrl demo`: check, load, train, evaluate, save, report.

Every recipe reads the same way:

    run directory + metric sinks → data → preflight check (no weights yet) → policy → train / eval → report.html

``report.html`` is written at the end even when the run fails part-way (then it shows what was logged).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from vlrl.check import CheckReport, PreflightError, preflight, sandbox_isolation
from vlrl.config import DataConfig, DemoConfig, RLConfig, RolloutConfig, RunConfig, SFTConfig
from vlrl.data import Sample
from vlrl.data.curriculum import with_template
from vlrl.data.packing import PackingPlan
from vlrl.data.splits import load_split, load_splits
from vlrl.eval import EvalResult, evaluate
from vlrl.models import Policy, load_policy
from vlrl.models.policy import DTYPES, LoadOptions, load_processor
from vlrl.report import MetricsLogger, make_sink
from vlrl.report.environment import describe, environment
from vlrl.report.progress import LiveProgress
from vlrl.report.samples import SampleLog
from vlrl.report.watch import WatchedEngine, watch
from vlrl.rollout import build_engine, close_engine
from vlrl.rollout.types import WeightPublisher, capability
from vlrl.synth.workflow import syn_eval_samples
from vlrl.train.async_grpo import train_async_grpo
from vlrl.train.budget import FlopMeter, control_budget
from vlrl.train.checkpoint import export_hf, metrics_offset, resolve_resume
from vlrl.train.common import prepare_run_dir, seed_everything, write_json
from vlrl.train.distributed import DistContext, check_scalable, init_distributed, shutdown_distributed
from vlrl.train.grpo import train_grpo
from vlrl.train.runtime import Runtime, make_runtime
from vlrl.train.select import select_for_training
from vlrl.train.sft import train_sft
from vlrl.train.validation import Validation


# ----------------------------------------------------------------------------------------------- set-up
def _open_run(cfg: RunConfig, ctx: DistContext | None = None, resume: Path | None = None) -> tuple[Path, MetricsLogger]:
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
def _reporting(cfg: RunConfig, run_dir: Path, logger: MetricsLogger, ctx: DistContext | None = None) -> Iterator[None]:
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
                _write_report(run_dir, logger)
        finally:
            logger.release()  # the run directory's lock, once everything of the run is written
        if ctx is not None:
            shutdown_distributed(ctx)


def _write_report(run_dir: Path, logger: MetricsLogger) -> None:
    from vlrl.report.html import write_report

    try:
        with logger.progress.task("report.html"):
            path = write_report([run_dir])
        logger.progress.stop()
        logger.info(f"report: {path}")
    except Exception as err:  # the run's results are saved; a report bug must not hide them, nor pass unseen
        logger.warn(f"report.html not written ({type(err).__name__}: {err}); retry with `vlrl report {run_dir}`")


def _data(cfg: RunConfig, logger: MetricsLogger) -> tuple[list[Sample], list[Sample]]:
    with logger.progress.task("data"):
        return load_splits(cfg.data, logger)  # a training file without a test file: a seeded share held out


def _check(cfg: RunConfig, logger: MetricsLogger, train: list[Sample], test: list[Sample]) -> dict:
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


def _load(cfg: RunConfig, logger: MetricsLogger, ctx: DistContext | None = None) -> Policy:
    """The policy (``model.lora``: with its adapters). Under FSDP2 with ``dist.rank0_load`` the ranks other than 0
    build it on the meta device — tokenizer, processor and module tree, no weights — and `make_runtime` gives
    them their shards of rank 0's weights (`vlrl.train.distributed.shard`)."""
    seed_everything(cfg.seed)
    device = str(ctx.device if ctx is not None else cfg.model.device)
    on_meta = (ctx is not None and ctx.enabled and not ctx.is_main and cfg.dist.strategy == "fsdp"
               and cfg.dist.rank0_load and not _whole_copy_per_rank(cfg))
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
    return _with_lora(cfg, policy, logger)


def _whole_copy_per_rank(cfg: RunConfig) -> bool:
    """An asynchronous run without rollout servers generates on every rank with a private whole copy of the policy
    (`vlrl.rollout.threaded_engine.ThreadedEngine`, built before the model is sharded): every rank loads the whole
    model, ``dist.rank0_load`` or not (a rank built on the meta device had nothing to copy)."""
    rollout = getattr(cfg, "rollout", None)
    return rollout is not None and rollout.mode == "async" and not rollout.servers.urls


def _with_lora(cfg: RunConfig, policy: Policy, logger: MetricsLogger | None = None) -> Policy:
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


def _engine(rollout: RolloutConfig, policy: Policy, run_dir: Path, logger: MetricsLogger, samples: SampleLog, *,
            sync_weights: bool = True) -> WatchedEngine:
    """The engine of a run or stage (`vlrl.rollout.build_engine`: in-process / threaded / rollout servers, the
    configured rollout function), watched by the report. ``sync_weights``: push the policy to the servers as
    version 0 (rank 0 alone under torchrun)."""
    return watch(build_engine(rollout, policy, run_dir=run_dir, sync_weights=sync_weights), logger, samples)


def _share_servers(engine, ctx: DistContext) -> None:
    """``rollout.servers.urls`` under torchrun: every rank generates its share of each step on the servers, and weight
    updates become collective calls in which rank 0 alone updates the servers (`HTTPEngine.join_trainer_ranks`)."""
    servers = capability(engine, WeightPublisher)
    if servers is not None and ctx.enabled:
        servers.join_trainer_ranks(ctx.rank, ctx.world_size)


def _save(policy: Policy, target: Path, logger: MetricsLogger) -> Path:
    with logger.progress.task(f"save {target.parent.name}/{target.name}"):
        return policy.save(target)


def _eval(engine: WatchedEngine, test, cfg: RunConfig, logger: MetricsLogger, stage: str, *,
          validation: Validation | None = None, step: int = 0) -> dict:
    """Evaluate on the held-out prompts, log ``eval/<stage>`` and return the result as summary.json holds it;
    ``validation`` (``eval.every``): the result is also its curve's point at ``step`` (the start or the end)."""
    with logger.progress.task(f"eval/{stage}"), engine.capture() as batches:
        result: EvalResult = evaluate(engine, test, cfg.eval)
    engine.samples.write(f"eval/{stage}", 0, batches)
    logger.log(f"eval/{stage}", 0, result.metrics(),
               show=("accuracy/mean", "greedy/mean", f"pass@{result.k}/mean", "strict/mean", "well_formed/mean"))
    if validation is not None:
        validation.log(step, result)
    return result.to_dict()


def _validation(cfg: RunConfig, engine, test, logger: MetricsLogger, stage: str, total_steps: int,
                ctx: DistContext | None = None) -> Validation | None:
    """``eval.every``: the stage's validation during training (None when off)."""
    if not cfg.eval.every:
        return None
    return Validation(engine, test, cfg.eval, logger, stage=stage, total_steps=total_steps, ctx=ctx)


def _sft(policy, train, stage, cfg: RunConfig, logger: MetricsLogger, *, seed: int, name: str = "sft",
         max_seconds: float | None = None, plan: PackingPlan | None = None, runtime: Runtime | None = None,
         validate: Validation | None = None) -> dict:
    with logger.progress.task(name, total=None if max_seconds else stage.train.steps, stage=name):
        stats = train_sft(policy, train, stage, logger=logger, seed=seed, stage_name=name, max_seconds=max_seconds,
                          plan=plan, runtime=runtime, validate=validate)
    _log_last_step(logger, name, stats)
    return stats


def _rl(policy, engine: WatchedEngine, train, stage, cfg: RunConfig, logger: MetricsLogger, name: str = "rl",
        runtime: Runtime | None = None, validate: Validation | None = None) -> dict:
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
        if stage.rollout.mode == "async":
            stats = train_async_grpo(policy, engine, train, stage, logger=logger, seed=cfg.seed, stage_name=name,
                                     runtime=runtime)
        else:
            stats = train_grpo(policy, engine, train, stage, logger=logger, seed=cfg.seed, stage_name=name,
                               runtime=runtime, validate=validate)
    _log_last_step(logger, name, stats)
    return stats if selected is None else {**stats, "select": selected}


def _log_last_step(logger: MetricsLogger, stage: str, stats: dict) -> None:
    """A stage stopped by its time budget between two ``log_every`` steps: log its last step, so the curves
    (and metrics.jsonl) end where training ended. The loops return that step's metrics in ``stats``."""
    logged = [r["step"] for r in logger.records if r["stage"] == stage]
    resumed_at_end = not any("/" in k for k in stats)  # resumed from the last step's checkpoint: nothing new
    if stats.get("steps") and not resumed_at_end and (not logged or logged[-1] != stats["steps"]):
        logger.log(stage, stats["steps"], {k: v for k, v in stats.items() if "/" in k})


def _samples(cfg: RunConfig, run_dir: Path) -> SampleLog:
    return SampleLog(run_dir, per_task=cfg.report.samples_per_task)


# ----------------------------------------------------------------------------------------------- recipes
def run_sft(cfg: SFTConfig) -> dict:
    """Under torchrun: every rank trains its share of each batch; rank 0 evaluates the exported weights."""
    check_scalable(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    ctx, resume = init_distributed(cfg.dist, cfg.model.device), resolve_resume(cfg.checkpoint, cfg.out)
    run_dir, logger = _open_run(cfg, ctx, resume)
    summary: dict = {}
    with _reporting(cfg, run_dir, logger, ctx):
        train, test = _data(cfg, logger)
        setup = _check(cfg, logger, train, test)
        policy = _load(cfg, logger, ctx)
        if cfg.stages:  # one process, no resumable checkpoints (check_scalable)
            policy, stats = _sft_stages(policy, train, cfg, run_dir, logger, test)
            final, runtime = run_dir / "checkpoints" / "final", Runtime(ctx, policy.model)
            validation = None
        else:
            runtime = make_runtime(cfg, ctx, policy, run_dir, resume)
            validation = _validation(cfg, _engine(RolloutConfig(), policy, run_dir, logger, _samples(cfg, run_dir)),
                                     test, logger, "sft", cfg.train.steps, ctx) if cfg.eval.every else None
            stats = _sft(policy, train, cfg, cfg, logger, seed=cfg.seed, plan=_plan(cfg.data, logger), runtime=runtime,
                         validate=validation)
            final = _export(policy, runtime, run_dir / "checkpoints" / "final", logger)
        if ctx.is_main:
            engine = _engine(RolloutConfig(), _eval_policy(policy, runtime, final, cfg), run_dir, logger,
                             _samples(cfg, run_dir))
            summary = {"sft": _eval(engine, test, cfg, logger, "final", validation=validation,
                                    step=int(stats.get("steps", 0))), "train": stats, **setup}
            write_json(run_dir / "summary.json", summary)
    return summary


def _export(policy: Policy, runtime: Runtime, target: Path, logger: MetricsLogger) -> Path:
    """The final weights in the transformers layout (gathered from all ranks under DDP/FSDP2)."""
    with logger.progress.task(f"save {target.parent.name}/{target.name}"):
        return export_hf(policy, runtime.module, target, runtime.ctx)


def _eval_policy(policy: Policy, runtime: Runtime, exported: Path, cfg: RunConfig) -> Policy:
    """What rank 0 evaluates: the trained policy itself, or (distributed) the exported full weights."""
    if not runtime.ctx.enabled:
        return policy
    return load_policy(str(exported), dtype=cfg.model.dtype, device=str(runtime.ctx.device),
                       min_pixels=cfg.model.min_pixels, max_pixels=cfg.model.max_pixels, options=LoadOptions.of(cfg.model))


def _plan(data: DataConfig, logger: MetricsLogger) -> PackingPlan | None:
    if data.packing_plan is None:
        return None
    plan = PackingPlan.load(data.packing_plan)
    stats = plan.meta.get("stats", {})
    logger.info(f"packing plan {data.packing_plan}: {plan.num_bins} sequences of {plan.capacity} tokens, fill "
                f"{stats.get('fill_ratio', 0):.1%}, {len(plan.truncated)} truncated, {len(plan.dropped)} dropped samples")
    return plan


def _sft_stages(policy: Policy, train: list[Sample], cfg: SFTConfig, run_dir: Path, logger: MetricsLogger,
                test: list[Sample] | None = None):
    """Staged SFT (LLaVA-OV-1.5: align → midtrain → instruct): each stage trains with its own data, optimizer
    and trainable modules, is saved to checkpoints/<name>, and the next stage starts from that checkpoint."""
    stats = {}
    for k, stage in enumerate(cfg.stages):
        data = stage.data or cfg.data
        samples = train if stage.data is None else load_split(stage.data, "train", logger)
        validation = _validation(cfg, _engine(RolloutConfig(), policy, run_dir, logger, _samples(cfg, run_dir)), test,
                                 logger, stage.name, stage.train.steps) if cfg.eval.every else None
        stats[stage.name] = _sft(policy, samples, stage, cfg, logger, seed=cfg.seed, name=stage.name,
                                 plan=_plan(data, logger), validate=validation)
        checkpoint = _save(policy, run_dir / "checkpoints" / stage.name, logger)
        if k + 1 < len(cfg.stages):  # the next stage continues from this checkpoint, with a fresh optimizer
            policy = _with_lora(cfg, load_policy(str(checkpoint), dtype=cfg.model.dtype, device=cfg.model.device,
                                                 min_pixels=cfg.model.min_pixels, max_pixels=cfg.model.max_pixels,
                                                 options=LoadOptions.of(cfg.model)))
    _link_final(run_dir, cfg.stages[-1].name)
    return policy, stats


def run_rl(cfg: RLConfig) -> dict:
    """Under torchrun: every rank generates and trains on its share of each step (in-process rollout); rank 0
    evaluates the initial weights and the exported final weights. A resumed run skips the initial evaluation
    (metrics.jsonl already holds it)."""
    check_scalable(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    ctx, resume = init_distributed(cfg.dist, cfg.model.device), resolve_resume(cfg.checkpoint, cfg.out)
    run_dir, logger = _open_run(cfg, ctx, resume)
    summary: dict = {}
    with _reporting(cfg, run_dir, logger, ctx):
        train, test = _data(cfg, logger)
        test = syn_eval_samples(cfg.synth, test)  # Syn-GRPO: held-out prompts ask for the training template
        summary.update(_check(cfg, logger, train, test))
        policy = _load(cfg, logger, ctx)
        if cfg.stages:  # one process, no resumable checkpoints (check_scalable)
            summary.update(_rl_stages(policy, train, test, cfg, run_dir, logger))
            write_json(run_dir / "summary.json", summary)
            return summary
        # in-process, threaded (rollout.mode=async) or rollout.servers.urls over HTTP; single- or multi-turn
        # (rollout.servers.urls under torchrun: rank 0 gives the servers the initial weights, every rank generates on them)
        engine = _engine(cfg.rollout, policy, run_dir, logger, _samples(cfg, run_dir), sync_weights=ctx.is_main)
        validation = _validation(cfg, engine, test, logger, "rl", cfg.train.steps, ctx)
        try:
            if ctx.is_main and resume is None:
                summary["initial"] = _eval(engine, test, cfg, logger, "initial", validation=validation)
            runtime = make_runtime(cfg, ctx, policy, run_dir, resume)  # (collective: rank 0's servers are ready)
            _share_servers(engine, ctx)
            stats = _rl(policy, engine, train, cfg, cfg, logger, runtime=runtime, validate=validation)
            final = _export(policy, runtime, run_dir / "checkpoints" / "final", logger)
            if ctx.is_main:  # the servers hold the final weights; an in-process engine must load the exported ones
                evaluator = engine if not ctx.enabled or cfg.rollout.servers.urls else \
                    _engine(cfg.rollout, _eval_policy(policy, runtime, final, cfg), run_dir, logger, engine.samples)
                summary.update({"rl": _eval(evaluator, test, cfg, logger, "final", validation=validation,
                                            step=int(stats.get("steps", 0))), "train": stats})
        finally:
            close_engine(engine)
        if ctx.is_main:
            write_json(run_dir / "summary.json", summary)
    return summary


def _rl_stages(policy: Policy, train: list[Sample], test: list[Sample], cfg: RLConfig, run_dir: Path,
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
        engine = _engine(stage.rollout, policy, run_dir, logger, _samples(cfg, run_dir))
        validation = _validation(cfg, engine, held_out, logger, stage.name, stage.train.steps)
        try:
            if k == 0:
                summary["initial"] = _eval(engine, held_out, cfg, logger, "initial", validation=validation)
            summary["train"][stage.name] = _rl(policy, engine, samples, stage, cfg, logger, name=stage.name,
                                               validate=validation)
            checkpoint = _save(policy, run_dir / "checkpoints" / stage.name, logger)
            summary[stage.name] = _eval(engine, held_out, cfg, logger, stage.name, validation=validation,
                                        step=int(summary["train"][stage.name].get("steps", 0)))
        finally:
            close_engine(engine)
        if k + 1 < len(cfg.stages):
            policy = _with_lora(cfg, load_policy(str(checkpoint), dtype=cfg.model.dtype, device=cfg.model.device,
                                                 min_pixels=cfg.model.min_pixels, max_pixels=cfg.model.max_pixels,
                                                 options=LoadOptions.of(cfg.model)))
    summary["rl"] = summary[cfg.stages[-1].name]
    _link_final(run_dir, cfg.stages[-1].name)
    return summary


def _link_final(run_dir: Path, stage: str) -> None:
    """checkpoints/final → checkpoints/<last stage>."""
    final = run_dir / "checkpoints" / "final"
    if final.is_symlink() or final.is_file():
        final.unlink()
    elif final.is_dir():
        shutil.rmtree(final)
    final.symlink_to(stage, target_is_directory=True)


def run_demo(cfg: DemoConfig) -> dict:
    """SFT warm start → eval → RL → eval, and the SFT control: the same SFT checkpoint trained by more SFT with
    the RL stage's budget (``control_budget``: its FLOPs — training and generation, counted by `FlopMeter` —
    or its wall time), evaluated the same way."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("vlrl demo runs in one process; under torchrun or `vlrl launch` use `vlrl sft` and `vlrl rl`")
    start = time.time()
    run_dir, logger = _open_run(cfg)
    with _reporting(cfg, run_dir, logger):
        summary: dict = {"seed": cfg.seed, "environment": environment()}
        logger.info(describe(summary["environment"]))
        train, test = _data(cfg, logger)
        summary.update(_check(cfg, logger, train, test))
        policy = _load(cfg, logger)
        samples = _samples(cfg, run_dir)
        engine = _engine(cfg.rl.rollout, policy, run_dir, logger, samples)
        summary["base"] = _eval(engine, test, cfg, logger, "base")
        with FlopMeter(policy.model) as meter:  # counts the stages' passes; evaluations sit between snapshots
            summary["sft_train"] = _sft(policy, train, cfg.sft, cfg, logger, seed=cfg.seed)
            sft_flops = meter.snapshot()
            sft_dir = _save(policy, run_dir / "checkpoints" / "sft", logger)
            summary["sft"] = _eval(engine, test, cfg, logger, "sft")
            before_rl = meter.snapshot()
            summary["rl_train"] = _rl(policy, engine, train, cfg.rl, cfg, logger)
            rl_flops = meter.snapshot() - before_rl
        _save(policy, run_dir / "checkpoints" / "rl", logger)
        summary["rl"] = _eval(engine, test, cfg, logger, "rl")
        if cfg.control:
            summary.update(_control(cfg, train, test, sft_dir, run_dir, samples, logger, rl_flops=rl_flops, sft_flops=sft_flops,
                                    sft_stats=summary["sft_train"], rl_stats=summary["rl_train"]))
        summary["wall_seconds"] = round(time.time() - start, 1)
        write_json(run_dir / "summary.json", summary)
        _print_summary(logger, summary)
    return summary


def _control(cfg: DemoConfig, train, test, sft_dir: Path, run_dir: Path, samples: SampleLog, logger: MetricsLogger, *,
             rl_flops, sft_flops, sft_stats: dict, rl_stats: dict) -> dict:
    """The SFT checkpoint trained by more SFT on the same labelled samples with the RL stage's budget, evaluated."""
    budget = control_budget(cfg.control_budget, rl_flops=rl_flops, rl_seconds=rl_stats["seconds"], sft_flops=sft_flops,
                            sft_steps=sft_stats["steps"], sft_seconds=sft_stats["seconds"])
    control = _with_lora(cfg, load_policy(str(sft_dir), dtype=cfg.model.dtype, device=cfg.model.device,
                                          options=LoadOptions.of(cfg.model)))
    steps = budget["control_steps"] or 10**9  # wall: bounded by time only, not by the SFT stage's step count
    stage = cfg.sft.model_copy(update={"train": cfg.sft.train.model_copy(update={"steps": steps})})
    with FlopMeter(control.model) as meter:
        stats = _sft(control, train, stage, cfg, logger, seed=cfg.seed + 1, name="sft_control",
                     max_seconds=budget["max_seconds"])
    budget.update(control_flops=meter.flops.total, control_seconds=round(stats["seconds"], 1),
                  control_steps=stats["steps"])
    _save(control, run_dir / "checkpoints" / "sft_control", logger)
    engine = _engine(cfg.rl.rollout, control, run_dir, logger, samples)
    return {"sft_control": _eval(engine, test, cfg, logger, "sft_control"), "sft_control_train": stats,
            "budget": budget}


def _print_summary(logger: MetricsLogger, summary: dict) -> None:
    from vlrl.report.verdict import demo_verdict

    rows = [("base", "untrained"), ("sft", "SFT checkpoint"), ("rl", "after RL"), ("sft_control", "SFT control")]
    logger.info("held-out accuracy (sampled pass@1 / greedy; strict: right, well-formed and ended):")
    for key, label in rows:
        if key in summary:
            s = summary[key]
            logger.info(f"  {label:16s} {s['accuracy']['mean']:.3f} / {s['greedy']['mean']:.3f}   strict "
                        f"{s['strict']['mean']:.3f} / {s['strict_greedy']['mean']:.3f}   well-formed "
                        f"{s['well_formed']['mean']:.2f} / {s['well_formed_greedy']['mean']:.2f}   "
                        + "  ".join(f"{t}={v:.2f}/{s['greedy'][t]:.2f}" for t, v in s["accuracy"].items() if t != "mean"))
    budget = summary.get("budget")
    if budget:
        logger.info(f"control budget ({budget['unit']}): {budget['control_steps']} SFT steps; the RL stage's FLOPs "
                    f"({budget['rl_flops']['total']:.3g}) match {budget['flops_matched_steps']} SFT steps, its "
                    f"{budget['rl_seconds']:.0f} s match {budget['wall_matched_steps']} on this machine now")
    verdict = demo_verdict(summary)
    if verdict:
        logger.info(verdict["sentence"])
    logger.info(f"wall time {summary['wall_seconds']:.0f}s")
