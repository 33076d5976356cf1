"""Held-out evaluation: greedy accuracy, sampled accuracy (pass@1 at the training temperature), pass@k — and each
strictly: right, well-formed and ended.

Correctness of a response is its verifiers' accuracy (`RewardOutput.accuracy`, carried as `Trajectory.accuracy`:
1 correct, 0 wrong; e.g. IoU ≥ 0.5 for boxes, exact match for OCR); a verifier without one counts
``overall ≥ 0.5`` as correct. A response is *well-formed* when it ended (not truncated) and has its sample's
declared answer form (`Trajectory.well_formed`: ``<answer>3</answer>3</answer>`` has none); *strict* correctness
is correctness × well-formed — what a user's parser would accept as right. ``accuracy`` / ``greedy`` are the
verifier's alone (it reads the first answer block), ``strict`` / ``strict_greedy`` and ``well_formed`` /
``well_formed_greedy`` beside them. ``mean`` is the macro-average over tasks (each task weighs the same). The engine
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


def formed(t: Trajectory) -> float:
    """1 if the response ended and has its declared answer form (scored: `Trajectory.well_formed`), else 0."""
    return float(bool(t.well_formed))


METRICS = ("accuracy", "greedy", "pass@k", "reward", "strict", "strict_greedy", "well_formed", "well_formed_greedy")


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
    strict: dict[str, float] = field(default_factory=dict)  # sampled pass@1, counting only well-formed responses
    strict_greedy: dict[str, float] = field(default_factory=dict)  # the greedy response right and well-formed
    well_formed: dict[str, float] = field(default_factory=dict)  # fraction of the samples well-formed and ended
    well_formed_greedy: dict[str, float] = field(default_factory=dict)  # the greedy response well-formed and ended
    examples: list[dict[str, Any]] = field(default_factory=list)  # a few greedy responses with their answers
    agent: dict[str, float] = field(default_factory=dict)  # multi-turn: `agent_metrics` of the sampled episodes

    def to_dict(self, *, examples: bool = True) -> dict[str, Any]:
        """The JSON layout of ``summary.json`` and ``vlrl eval``: ``{"accuracy": {...}, "greedy": {...},
        "pass@k": {...}, "reward": {...}, "strict": {...}, "strict_greedy": {...}, "well_formed": {...},
        "well_formed_greedy": {...}, "k": k, "n_prompts": n, "reward_failures": f[, "examples": [...]]}``."""
        out = {"k": self.k, "n_prompts": self.n_prompts, "reward_failures": self.reward_failures,
               "accuracy": self.accuracy, "greedy": self.greedy, "pass@k": self.pass_at_k, "reward": self.reward,
               "strict": self.strict, "strict_greedy": self.strict_greedy, "well_formed": self.well_formed,
               "well_formed_greedy": self.well_formed_greedy}
        if self.agent:
            out["agent"] = self.agent
        if examples:
            out["examples"] = self.examples
        return out

    def metrics(self) -> dict[str, float]:
        """What an evaluation logs: ``accuracy/<task>``, ``greedy/<task>``, ``pass@<k>/<task>``, ``strict/<task>``,
        ``strict_greedy/<task>``, ``well_formed/<task>``, ``well_formed_greedy/<task>`` (and ``mean``), and for
        episodes their ``agent/…`` metrics."""
        tables = {"accuracy": self.accuracy, "greedy": self.greedy, f"pass@{self.k}": self.pass_at_k,
                  "strict": self.strict, "strict_greedy": self.strict_greedy, "well_formed": self.well_formed,
                  "well_formed_greedy": self.well_formed_greedy}
        return {**{f"{name}/{task}": v for name, table in tables.items() for task, v in table.items()}, **self.agent}


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
        group, first = by_prompt.get(index, []), greedy_of.get(index)
        c = sum(correct(s) >= 0.5 for s in group)
        scores.append({"task": sample.task, "greedy": correct(first) if first else 0.0,
                       "accuracy": _mean_of(correct, group), "pass@k": pass_at_k(len(group), c, k) if group else 0.0,
                       "reward": _mean_of(lambda s: s.reward, group),
                       "strict": _mean_of(lambda s: correct(s) * formed(s), group),
                       "strict_greedy": correct(first) * formed(first) if first else 0.0,
                       "well_formed": _mean_of(formed, group), "well_formed_greedy": formed(first) if first else 0.0})
    examples = [{"task": t.sample.task, "id": t.sample.id, "prompt": t.sample.prompt_text(), "response": t.response_text,
                 "answer": t.sample.answer, "reward": t.reward, "well_formed": t.well_formed, "status": t.status.value}
                for t in greedy[:8]]
    agent = agent_metrics(sampled) if any(t.turns for t in sampled) else {}
    return scores, failures, examples, agent


def _result(scores: list[dict[str, Any]], k: int, n_prompts: int, failures: int, examples: list[dict[str, Any]],
            agent: dict[str, float]) -> EvalResult:
    per_task: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for score in scores:
        for metric in METRICS:
            per_task[score["task"]][metric].append(score[metric])
    tables = {}
    for metric in METRICS:
        table = {task: _mean(v[metric]) for task, v in sorted(per_task.items())}
        table["mean"] = _mean(list(table.values()))
        tables[metric] = table
    return EvalResult(accuracy=tables["accuracy"], greedy=tables["greedy"], pass_at_k=tables["pass@k"],
                      reward=tables["reward"], k=k, n_prompts=n_prompts, reward_failures=failures, examples=examples,
                      agent=agent, strict=tables["strict"], strict_greedy=tables["strict_greedy"],
                      well_formed=tables["well_formed"], well_formed_greedy=tables["well_formed_greedy"])


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


def _mean_of(value, group: list[Trajectory]) -> float:
    return sum(value(t) for t in group) / max(len(group), 1)


def _mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 4) if values else 0.0
