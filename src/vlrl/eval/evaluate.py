"""Held-out evaluation: greedy accuracy, sampled accuracy (pass@1 at the training temperature), pass@k.

Correctness of a response is its verifiers' accuracy (`RewardOutput.accuracy`, carried as `Trajectory.accuracy`:
1 correct, 0 wrong; e.g. IoU ≥ 0.5 for boxes, exact match for OCR); a verifier without one counts
``overall ≥ 0.5`` as correct. ``mean`` is the macro-average over tasks (each task weighs the same). The engine
is whatever the recipe built (`vlrl.rollout.build_engine`): with a multi-turn rollout, each response is an
episode and its final answer is scored.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from vlrl.config import EvalConfig
from vlrl.data import Sample
from vlrl.rewards import score_trajectories
from vlrl.rollout import Engine, SamplingParams, Trajectory
from vlrl.rollout.agent import agent_metrics


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021): 1 − C(n−c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def correct(t: Trajectory) -> float:
    return float(t.accuracy) if t.accuracy is not None else float(t.reward >= 0.5)


@dataclass
class EvalResult:
    """One evaluation. Each table maps task → value, plus ``mean`` (the macro-average over tasks)."""

    accuracy: dict[str, float]  # sampled pass@1: mean correctness of the ``k`` samples per prompt
    greedy: dict[str, float]  # correctness of the greedy response
    pass_at_k: dict[str, float]  # unbiased pass@k over the k samples
    reward: dict[str, float]  # mean reward of the samples
    k: int  # samples per prompt
    n_prompts: int
    reward_failures: int  # verifier units that failed (timed out, raised) and scored the fallback
    examples: list[dict[str, Any]] = field(default_factory=list)  # a few greedy responses with their answers
    agent: dict[str, float] = field(default_factory=dict)  # multi-turn: `agent_metrics` of the sampled episodes

    def to_dict(self, *, examples: bool = True) -> dict[str, Any]:
        """The JSON layout of ``summary.json`` and ``vlrl eval``: ``{"accuracy": {...}, "greedy": {...},
        "pass@k": {...}, "reward": {...}, "k": k, "n_prompts": n, "reward_failures": f[, "examples": [...]]}``."""
        out = {"k": self.k, "n_prompts": self.n_prompts, "reward_failures": self.reward_failures,
               "accuracy": self.accuracy, "greedy": self.greedy, "pass@k": self.pass_at_k, "reward": self.reward}
        if self.agent:
            out["agent"] = self.agent
        if examples:
            out["examples"] = self.examples
        return out

    def metrics(self) -> dict[str, float]:
        """What an evaluation logs: ``accuracy/<task>``, ``greedy/<task>``, ``pass@<k>/<task>`` (and ``mean``),
        and for episodes their ``agent/…`` metrics."""
        return {**{f"accuracy/{task}": v for task, v in self.accuracy.items()},
                **{f"greedy/{task}": v for task, v in self.greedy.items()},
                **{f"pass@{self.k}/{task}": v for task, v in self.pass_at_k.items()}, **self.agent}


def evaluate(engine: Engine, samples: list[Sample], cfg: EvalConfig, *, ctx: Any = None) -> EvalResult:
    """Greedy and ``cfg.samples`` sampled responses per held-out prompt, scored per task.

    ``ctx`` (a `vlrl.train.distributed.DistContext` of several ranks, ``eval.every`` under torchrun): every rank
    evaluates an equal share of the prompts (the list padded with repeats, which are then left out) with its own
    engine — the ranks' generate calls are collective under FSDP2 — and every rank returns the result of all."""
    if ctx is not None and getattr(ctx, "enabled", False):
        return _evaluate_over_ranks(engine, samples, cfg, ctx)
    scores, failures, examples, agent = _score(engine, samples, cfg)
    return _result(scores, cfg.samples, len(samples), failures, examples, agent)


def _score(engine: Engine, samples: list[Sample], cfg: EvalConfig):
    """Per prompt ``{task, greedy, accuracy, pass@k, reward}``, the verifier failures, a few greedy examples and
    (episodes) the agent metrics."""
    requests = [engine.encode(s) for s in samples]
    greedy = engine.generate(requests, SamplingParams(n=1, temperature=0.0, max_new_tokens=cfg.max_new_tokens))
    sampled = engine.generate(
        requests, SamplingParams(n=cfg.samples, temperature=cfg.temperature, top_k=cfg.top_k,
                                 max_new_tokens=cfg.max_new_tokens)
    )
    failures = len(score_trajectories(greedy).failures) + len(score_trajectories(sampled).failures)
    k = cfg.samples
    by_prompt: dict[int, list[Trajectory]] = defaultdict(list)
    for t in sampled:
        by_prompt[t.group_index].append(t)
    greedy_of = {t.group_index: t for t in greedy}
    scores = []
    for index, sample in enumerate(samples):  # group_index = the request's index (the Engine contract)
        group = by_prompt.get(index, [])
        c = sum(correct(s) >= 0.5 for s in group)
        scores.append({"task": sample.task, "greedy": correct(greedy_of[index]) if index in greedy_of else 0.0,
                       "accuracy": sum(correct(s) for s in group) / max(len(group), 1),
                       "pass@k": pass_at_k(len(group), c, k) if group else 0.0,
                       "reward": sum(s.reward for s in group) / max(len(group), 1)})
    examples = [{"task": t.sample.task, "id": t.sample.id, "prompt": t.sample.prompt_text(), "response": t.response_text,
                 "answer": t.sample.answer, "reward": t.reward} for t in greedy[:8]]
    agent = agent_metrics(sampled) if any(t.turns for t in sampled) else {}
    return scores, failures, examples, agent


def _result(scores: list[dict[str, Any]], k: int, n_prompts: int, failures: int, examples: list[dict[str, Any]],
            agent: dict[str, float]) -> EvalResult:
    per_task: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for score in scores:
        for metric in ("greedy", "accuracy", "pass@k", "reward"):
            per_task[score["task"]][metric].append(score[metric])
    tables = {}
    for metric in ("accuracy", "greedy", "pass@k", "reward"):
        table = {task: _mean(v[metric]) for task, v in sorted(per_task.items())}
        table["mean"] = _mean(list(table.values()))
        tables[metric] = table
    return EvalResult(accuracy=tables["accuracy"], greedy=tables["greedy"], pass_at_k=tables["pass@k"],
                      reward=tables["reward"], k=k, n_prompts=n_prompts, reward_failures=failures, examples=examples,
                      agent=agent)


def _evaluate_over_ranks(engine: Engine, samples: list[Sample], cfg: EvalConfig, ctx: Any) -> EvalResult:
    world = ctx.world_size
    padded = list(samples) + [samples[i % len(samples)] for i in range(-len(samples) % world)]
    size = len(padded) // world
    mine = padded[ctx.rank * size : (ctx.rank + 1) * size]
    scores, failures, examples, agent = _score(engine, mine, cfg)
    real = max(0, min(size, len(samples) - ctx.rank * size))  # this share's prompts that are not repeats
    parts = ctx.gather_objects((scores[:real], failures, examples))
    everything = [s for part, _, _ in parts for s in part]
    return _result(everything, cfg.samples, len(samples), sum(f for _, f, _ in parts),
                   [e for _, _, ex in parts for e in ex][:8], agent)


def _mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 4) if values else 0.0
