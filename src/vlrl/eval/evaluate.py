"""Held-out evaluation: greedy accuracy, sampled accuracy (pass@1 at the training temperature), pass@k.

Correctness of a response is the ``accuracy`` sub-score its verifier reports (1 correct, 0 wrong; e.g.
IoU ≥ 0.5 for boxes, exact match for OCR); a verifier without one counts ``overall ≥ 0.5`` as correct.
``mean`` is the macro-average over tasks (each task weighs the same).
"""

from __future__ import annotations

import math
from collections import defaultdict

from vlrl.config import EvalConfig
from vlrl.data import Sample
from vlrl.rewards import score_trajectories
from vlrl.rollout import Engine, SamplingParams, Trajectory


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021): 1 − C(n−c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def correct(t: Trajectory) -> float:
    acc = t.reward_parts.get("accuracy")
    return float(acc) if acc is not None else float(t.reward >= 0.5)


def evaluate(engine: Engine, samples: list[Sample], cfg: EvalConfig) -> dict:
    """Return ``{"accuracy": {task: x, "mean": m}, "greedy": {...}, "pass@k": {...}, "reward": {...}, "k": k}``."""
    requests = [engine.encode(s) for s in samples]
    greedy = engine.generate(requests, SamplingParams(n=1, temperature=0.0, max_new_tokens=cfg.max_new_tokens))
    sampled = engine.generate(
        requests, SamplingParams(n=cfg.samples, temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens)
    )
    failures = len(score_trajectories(greedy).failures) + len(score_trajectories(sampled).failures)
    k = cfg.samples
    per_task: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for t in greedy:
        per_task[t.sample.task]["greedy"].append(correct(t))
    by_prompt: dict[int, list[Trajectory]] = defaultdict(list)
    for t in sampled:
        by_prompt[t.group_index].append(t)
    for group in by_prompt.values():
        task = group[0].sample.task
        c = sum(correct(t) >= 0.5 for t in group)
        per_task[task]["accuracy"].append(sum(correct(t) for t in group) / len(group))
        per_task[task]["pass@k"].append(pass_at_k(len(group), c, k))
        per_task[task]["reward"].append(sum(t.reward for t in group) / len(group))
    result: dict = {"k": k, "n_prompts": len(samples), "reward_failures": failures}
    for metric in ("accuracy", "greedy", "pass@k", "reward"):
        table = {task: _mean(v[metric]) for task, v in sorted(per_task.items())}
        table["mean"] = _mean(list(table.values()))
        result[metric] = table
    result["examples"] = [
        {"task": t.sample.task, "id": t.sample.id, "response": t.response_text, "answer": t.sample.answer,
         "reward": t.reward} for t in greedy[:8]
    ]
    return result


def _mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 4) if values else 0.0
