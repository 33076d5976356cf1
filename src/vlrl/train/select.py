"""``select.enabled`` of an RL stage: discrepancy-driven selection (`vlrl.eval.select`) of the training prompts
with the starting policy, its ``select/…`` metrics logged."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from vlrl.data.sample import Sample
from vlrl.eval.select import Band, RolloutStore, rollout_and_score, select, summarise

if TYPE_CHECKING:
    from vlrl.config import RolloutConfig, SelectConfig
    from vlrl.report import MetricsLogger
    from vlrl.rollout import Engine


def select_for_training(engine: Engine, samples: Sequence[Sample], cfg: SelectConfig, rollout: RolloutConfig, *,
                        logger: MetricsLogger, run_dir: Path | None, model: str, stage: str = "rl",
                        strict: bool = True) -> tuple[list[Sample], dict]:
    """``select.enabled`` of an RL stage: score the training prompts with ``engine`` (the starting policy) at the
    stage's sampling settings, keep those inside the band, log ``select/…`` metrics; returns (kept, summary).

    The rollouts go to ``cfg.cache`` (reused across runs, keyed by ``model``, the run's model.path) or, unset, to
    a fresh ``RUN_DIR/select_rollouts.jsonl``. Dropped prompts are not trained on; unscored ones
    (``cfg.max_prompts``) neither. ``strict``: the stage's ``algo.strict_reward`` (a right answer that is not
    well-formed counts as wrong, as training will score it)."""
    from vlrl.rollout import SamplingParams

    pool = list(samples[: cfg.max_prompts] if cfg.max_prompts else samples)
    sampling = SamplingParams(n=cfg.n, temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                              max_new_tokens=rollout.max_new_tokens, stop=list(rollout.stop))
    if cfg.cache is not None:
        store = RolloutStore(cfg.cache)
    else:
        path = Path(run_dir or ".") / "select_rollouts.jsonl"
        if path.exists():
            path.unlink()  # never reuse another run's rollouts unasked: its weights may differ
        store = RolloutStore(path)
    band = Band(min_mean_reward=cfg.min_mean_reward, max_mean_reward=cfg.max_mean_reward, min_gap=cfg.min_gap,
                k=cfg.k or cfg.n)
    with logger.progress.task(f"{stage}: select {len(pool)} prompts × {cfg.n}"):
        rollouts, generated, failures = rollout_and_score(engine, pool, sampling, store, model=model,
                                                                 strict=strict)
    kept, stats = select(pool, rollouts, band)
    summary = {**summarise(stats), "generated": generated, "reward_failures": failures, "n": cfg.n,
               "band": asdict(band), "store": str(store.path)}
    verdicts = summary["verdicts"]
    metrics = {"select/items": len(pool), "select/kept": len(kept), "select/kept_frac": len(kept) / max(len(pool), 1),
               "select/generated_prompts": generated, "select/reward_failures": failures,
               **{f"select/{v}": verdicts.get(v, 0) for v in ("too_easy", "too_hard", "small_gap")},
               **{f"select/{k}": summary[k] for k in ("all_pass_at_1", "all_pass_at_k", "kept_pass_at_1", "kept_pass_at_k")
                  if k in summary}}
    logger.log(f"{stage}/select", 0, metrics, show=("select/kept", "select/too_easy", "select/too_hard"))
    if not kept:
        raise ValueError(f"select: none of the {len(pool)} prompts fell inside the band (verdicts {verdicts}, mean pass@1 "
                         f"{summary.get('all_pass_at_1', 0):.3f}); widen select.min_mean_reward / select.max_mean_reward, "
                         "raise select.n, or start RL from another checkpoint")
    logger.info(f"{stage}: selected {len(kept)} of {len(pool)} prompts ({verdicts}); pass@1 {summary['all_pass_at_1']:.3f}"
                f" → {summary['kept_pass_at_1']:.3f} on the kept ones")
    return kept, summary
