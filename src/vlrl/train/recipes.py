"""The runnable recipes behind `vlrl sft`, `vlrl rl` and `vlrl demo`: load, train, evaluate, save."""

from __future__ import annotations

import time
from pathlib import Path

from vlrl.config import DemoConfig, RLConfig, RunConfig, SFTConfig
from vlrl.eval import evaluate
from vlrl.models import Policy, load_policy
from vlrl.report import MetricsLogger
from vlrl.rollout import Engine, HFEngine
from vlrl.train.async_grpo import make_engine, train_async_grpo
from vlrl.train.common import load_split, prepare_run_dir, seed_everything, write_json
from vlrl.train.grpo import train_grpo
from vlrl.train.sft import train_sft


def _setup(cfg: RunConfig) -> tuple[Path, MetricsLogger, Policy]:
    run_dir, logger = prepare_run_dir(cfg.out, cfg)
    seed_everything(cfg.seed)
    policy = load_policy(cfg.model.path, dtype=cfg.model.dtype, device=cfg.model.device, seed=cfg.model.init_seed)
    logger.info(f"policy {policy.source}: {policy.num_parameters() / 1e6:.2f}M parameters, family {policy.adapter.family}")
    return run_dir, logger, policy


def _eval(engine: Engine, test, cfg: RunConfig, logger: MetricsLogger, stage: str) -> dict:
    result = evaluate(engine, test, cfg.eval)
    logger.log(f"eval/{stage}", 0, {
        **{f"accuracy/{k}": v for k, v in result["accuracy"].items()},
        **{f"greedy/{k}": v for k, v in result["greedy"].items()},
        **{f"pass@{result['k']}/{k}": v for k, v in result["pass@k"].items()},
    }, show=("accuracy/mean", "greedy/mean", f"pass@{result['k']}/mean"))
    return result


def run_sft(cfg: SFTConfig) -> dict:
    run_dir, logger, policy = _setup(cfg)
    train, test = load_split(cfg.data, "train", logger), load_split(cfg.data, "test", logger)
    stats = train_sft(policy, train, cfg, logger=logger, seed=cfg.seed)
    policy.save(run_dir / "checkpoints" / "final")
    summary = {"sft": _eval(HFEngine(policy), test, cfg, logger, "final"), "train": stats}
    write_json(run_dir / "summary.json", summary)
    return summary


def run_rl(cfg: RLConfig) -> dict:
    run_dir, logger, policy = _setup(cfg)
    train, test = load_split(cfg.data, "train", logger), load_split(cfg.data, "test", logger)
    engine = make_engine(cfg.rollout, policy, run_dir=run_dir)  # in-process, or rollout.servers over HTTP
    loop = train_async_grpo if cfg.rollout.mode == "async" else train_grpo
    try:
        before = _eval(engine, test, cfg, logger, "initial")
        stats = loop(policy, engine, train, cfg, logger=logger, seed=cfg.seed)
        policy.save(run_dir / "checkpoints" / "final")
        summary = {"initial": before, "rl": _eval(engine, test, cfg, logger, "final"), "train": stats}
    finally:
        if hasattr(engine, "close"):
            engine.close()
    write_json(run_dir / "summary.json", summary)
    return summary


def run_demo(cfg: DemoConfig) -> dict:
    """SFT warm start → eval → RL → eval, and the equal-time SFT control from the same checkpoint."""
    start = time.time()
    run_dir, logger, policy = _setup(cfg)
    train, test = load_split(cfg.data, "train", logger), load_split(cfg.data, "test", logger)
    engine = HFEngine(policy, max_batch_size=cfg.rl.rollout.max_batch_size)
    sft_stats = train_sft(policy, train, cfg.sft, logger=logger, seed=cfg.seed)
    sft_dir = policy.save(run_dir / "checkpoints" / "sft")
    sft_eval = _eval(engine, test, cfg, logger, "sft")
    rl_stats = train_grpo(policy, engine, train, cfg.rl, logger=logger, seed=cfg.seed)
    policy.save(run_dir / "checkpoints" / "rl")
    rl_eval = _eval(engine, test, cfg, logger, "rl")
    summary = {"sft": sft_eval, "rl": rl_eval, "sft_train": sft_stats, "rl_train": rl_stats}
    if cfg.control:
        # The control: the same SFT checkpoint, trained by more SFT for the RL stage's wall time.
        control = load_policy(str(sft_dir), dtype=cfg.model.dtype, device=cfg.model.device)
        control_stats = train_sft(control, train, cfg.sft, logger=logger, seed=cfg.seed + 1, stage_name="sft_control",
                                  max_seconds=rl_stats["seconds"])
        control.save(run_dir / "checkpoints" / "sft_control")
        summary["sft_control"] = _eval(HFEngine(control), test, cfg, logger, "sft_control")
        summary["sft_control_train"] = control_stats
    summary["wall_seconds"] = round(time.time() - start, 1)
    write_json(run_dir / "summary.json", summary)
    _print_summary(logger, summary)
    return summary


def _print_summary(logger: MetricsLogger, summary: dict) -> None:
    rows = [("sft", "SFT checkpoint"), ("rl", "after RL"), ("sft_control", "SFT control (same time)")]
    logger.info("held-out accuracy (sampled pass@1 / greedy):")
    for key, label in rows:
        if key in summary:
            s = summary[key]
            logger.info(f"  {label:26s} {s['accuracy']['mean']:.3f} / {s['greedy']['mean']:.3f}   "
                        + "  ".join(f"{t}={v:.2f}/{s['greedy'][t]:.2f}" for t, v in s["accuracy"].items() if t != "mean"))
    logger.info(f"wall time {summary['wall_seconds']:.0f}s")
