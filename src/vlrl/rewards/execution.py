"""Batch scoring with deadlines: `RewardExecutor` and `score_trajectories`.

Each item's reward is a weighted sum of verifiers; each (item, verifier) pair is a *unit*, run where the
verifier's `RewardSpec` says:

* ``inline`` — in the calling thread. Only for verifiers whose cost is bounded by construction (linear
  scans of at most ``max_chars`` characters): numbers, choices, boxes, OCR, format. No process hop, so the
  RL loop's ~128 short responses per step cost about a millisecond (``benchmarks/rewards.py``). Their time
  is measured; an item over its deadline is counted as ``slow`` and logged (it cannot be pre-empted).
* ``pool`` — in a worker process (pebble ``ProcessPool``, forkserver start, address-space limit per
  worker). The deadline is enforced by the pool's manager thread — no ``signal.alarm``, so it works from
  any thread — by killing the worker, which is then replaced; a worker that dies (segfault, OOM) is
  replaced too. Used for SymPy, HTML/SVG parsing and rendering, and running code.
* ``judge`` — scored by a `JudgeReward` in one batched engine call.

A unit that times out, raises, loses its worker or returns a non-finite value makes its item score
``fallback`` (parts ``{"reward_failed": 1.0}``); the failure is counted in the `ScoreReport`, logged, and
— given ``failures_path`` — appended with its input to a ``reward_failures.jsonl``. A response longer than
``max_chars`` is not verified: it scores every verifier's minimum (0, or −1 for ``overlong``), part
``too_long``.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import multiprocessing
import os
import resource
import threading
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlrl.rewards.base import RewardOutput, as_output, combine, get_reward, reward_weights, spec_of
from vlrl.rewards.format import has_answer_form
from vlrl.rewards.sandbox import ENV as SANDBOX_ENV

log = logging.getLogger(__name__)

MAX_LOGGED_CHARS = 65_536  # a failure's response is logged up to this many characters
_PRELOAD = ["vlrl.rewards", "vlrl.rewards.math_equiv", "vlrl.rewards.markup", "math_verify", "cairosvg",
            "skimage.metrics"]


@dataclass
class RewardItem:
    """One response to score: its text, the sample's ground truth, reward spec and metadata."""

    response: str
    answer: Any
    reward: str | Mapping[str, float]
    meta: Mapping[str, Any] = field(default_factory=dict)
    id: str = ""
    task: str = ""
    gated: bool = False  # strict scoring refused the response (truncated, or not in its declared answer form):
    # every verifier that reports an ``accuracy`` scores its minimum, the others (format, length) as usual


@dataclass
class Failure:
    """A unit that did not produce a score: ``kind`` is ``timeout``, ``error`` or ``worker_died``."""

    id: str
    task: str
    verifier: str
    kind: str
    error: str
    seconds: float


@dataclass
class ScoreReport:
    """Outcome of scoring a batch: failures are counted and kept, never silently zeroed.

    ``failures`` holds ``(sample id, error)`` pairs (one per failed unit); ``details`` the full records;
    ``counts`` the number of items, units per mode, ``timeouts``, ``errors``, ``worker_deaths``, ``slow``
    inline units and ``too_long`` items; ``seconds`` / ``max_seconds`` the total and worst unit time per
    verifier (worker-side for pool units; the deadline for a timed-out one).
    """

    failures: list[tuple[str, str]] = field(default_factory=list)
    details: list[Failure] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    max_seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    wall_seconds: float = 0.0

    def _time(self, verifier: str, seconds: float) -> None:
        self.seconds[verifier] += seconds
        self.max_seconds[verifier] = max(self.max_seconds[verifier], seconds)

    def _fail(self, item: RewardItem, verifier: str, kind: str, error: str, seconds: float) -> None:
        self.details.append(Failure(item.id, item.task, verifier, kind, error, seconds))
        self.failures.append((item.id, f"{verifier}: {error}"))
        self.counts[{"timeout": "timeouts", "worker_died": "worker_deaths"}.get(kind, "errors")] += 1


@dataclass
class _Unit:
    index: int  # item index
    name: str  # verifier name
    fn: Any
    deadline: float
    mode: str


def _init_worker(memory_mb: int | None) -> None:
    """Pool worker start: cap its address space, and ignore the parent's Ctrl-C (the parent handles it)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if memory_mb:
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))


def _ping() -> int:
    return os.getpid()


def _run_unit(fn, response: str, answer: Any, meta: Mapping[str, Any],
              sandbox: str | None = None) -> tuple[float, dict[str, float], float]:
    """Worker side: call the verifier, return (overall, parts, seconds). ``sandbox``: the caller's
    ``VLRL_SANDBOX_ISOLATION`` when the unit was submitted (a worker started earlier may hold another)."""
    if sandbox is None:
        os.environ.pop(SANDBOX_ENV, None)
    else:
        os.environ[SANDBOX_ENV] = sandbox
    start = time.perf_counter()
    out = as_output(fn(response, answer, **meta))
    return float(out.overall), {k: float(v) for k, v in out.parts.items()}, time.perf_counter() - start


class RewardExecutor:
    """Scores batches of `RewardItem` with per-unit deadlines (see the module docstring).

    Args:
        workers: pool processes (default: the CPU count). The pool starts at the first ``pool`` unit.
        deadlines: per-verifier deadline overrides in seconds, e.g. ``{"code": 60}``.
        max_chars: responses longer than this are not verified (scored each verifier's minimum).
        worker_memory_mb: address-space limit of each pool worker (None: no limit).
        judge: the `JudgeReward` used for ``judge`` verifiers whose metadata names none.
        task_rewards: per-task override of the samples' ``reward`` field, e.g.
            ``{"chart/count": {"number": 0.8, "format": 0.2}}``.
    """

    def __init__(self, *, workers: int | None = None, deadlines: Mapping[str, float] | None = None,
                 max_chars: int = 200_000, worker_memory_mb: int | None = 4096, judge: Any = None,
                 task_rewards: Mapping[str, str | Mapping[str, float]] | None = None) -> None:
        self.workers = workers or os.cpu_count() or 1
        self.deadlines = dict(deadlines or {})
        self.max_chars = max_chars
        self.worker_memory_mb = worker_memory_mb
        self.judge = judge
        self.task_rewards = dict(task_rewards or {})
        self._pool = None
        self._lock = threading.Lock()

    # -- public ------------------------------------------------------------------------------------

    def score(self, items: Sequence[RewardItem], *, fallback: float = 0.0,
              failures_path: str | Path | None = None) -> tuple[list[RewardOutput], ScoreReport]:
        """Score ``items``; returns one `RewardOutput` per item, in order, and the `ScoreReport`."""
        start = time.perf_counter()
        report = ScoreReport()
        report.counts["items"] = len(items)
        weights = [reward_weights(self.task_rewards.get(item.task, item.reward)) for item in items]
        outputs: list[dict[str, RewardOutput]] = [{} for _ in items]
        failed = [False] * len(items)
        units: dict[str, list[_Unit]] = defaultdict(list)
        for i, (item, w) in enumerate(zip(items, weights, strict=True)):
            if len(item.response) > self.max_chars:
                report.counts["too_long"] += 1
                outputs[i] = {name: RewardOutput(spec_of(name).low, {}) for name in w}
                continue
            for name in w:
                spec = spec_of(name)
                deadline = self.deadlines.get(name, spec.deadline)
                units[spec.mode].append(_Unit(i, name, get_reward(name), deadline, spec.mode))
        for unit in units["pool"] + units["inline"] + units["judge"]:
            report.counts[f"{unit.mode}_units"] += 1
        pending = self._submit(units["pool"], items)
        for unit in units["inline"]:
            self._run_inline(unit, items[unit.index], outputs, failed, report)
        self._run_judge(units["judge"], items, outputs, failed, report)
        self._collect(pending, items, outputs, failed, report)

        results = []
        for i, item in enumerate(items):
            if failed[i]:
                results.append(RewardOutput(overall=fallback, parts={"reward_failed": 1.0}))
            else:
                out = combine(weights[i], _gate(outputs[i]) if item.gated else outputs[i])
                if len(item.response) > self.max_chars:
                    out.parts.update({"too_long": 1.0, "accuracy": 0.0})
                results.append(out)
        report.wall_seconds = time.perf_counter() - start
        if report.details:
            first = report.details[0]
            log.warning("%d reward failure(s) (%d timeouts, %d errors, %d worker deaths); first: %s %s %s: %s",
                        len(report.details), report.counts["timeouts"], report.counts["errors"],
                        report.counts["worker_deaths"], first.id, first.verifier, first.kind, first.error)
            if failures_path is not None:
                _append_failures(Path(failures_path), report.details, items)
        return results, report

    def start(self) -> RewardExecutor:
        """Start the worker pool now and wait until every worker answers (otherwise it starts lazily at
        the first ``pool`` unit, and that batch pays the start-up: ~1-3 s with the heavy imports)."""
        pool = self._ensure_pool()
        for future in [pool.schedule(_ping) for _ in range(self.workers)]:
            future.result()
        return self

    def close(self) -> None:
        """Stop the worker pool (idempotent)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()  # graceful first: stopping while a worker is being replaced makes it print errors
            pool.join(timeout=5)
            pool.stop()
            pool.join()

    def __enter__(self) -> RewardExecutor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the three modes ---------------------------------------------------------------------------

    def _run_inline(self, unit: _Unit, item: RewardItem, outputs, failed, report: ScoreReport) -> None:
        t0 = time.perf_counter()
        try:
            out = as_output(unit.fn(item.response, item.answer, **item.meta))
            _check_finite(out)
        except Exception as err:  # a verifier bug must not kill the run, nor vanish  # noqa: BLE001
            failed[unit.index] = True
            report._fail(item, unit.name, "error", f"{type(err).__name__}: {err}", time.perf_counter() - t0)
            return
        seconds = time.perf_counter() - t0
        report._time(unit.name, seconds)
        if seconds > unit.deadline:
            report.counts["slow"] += 1
            log.warning("inline reward %r took %.2f s (> %.2f s deadline) on item %r; register it with "
                        "mode='pool' if it can be slow", unit.name, seconds, unit.deadline, item.id)
        outputs[unit.index][unit.name] = out

    def _submit(self, units: list[_Unit], items: Sequence[RewardItem]) -> list[tuple[_Unit, Any]]:
        if not units:
            return []
        pool = self._ensure_pool()
        pending = []
        sandbox = os.environ.get(SANDBOX_ENV)  # the isolation the caller's run configured (`sandbox.isolation`)
        for u in units:
            item = items[u.index]
            meta = {k: v for k, v in item.meta.items() if k != "judge"}  # an engine does not cross processes
            pending.append((u, pool.schedule(_run_unit, args=(u.fn, item.response, item.answer, meta, sandbox),
                                             timeout=u.deadline)))
        return pending

    def _collect(self, pending, items, outputs, failed, report: ScoreReport) -> None:
        from pebble import ProcessExpired

        for unit, future in pending:
            item = items[unit.index]
            try:
                overall, parts, seconds = future.result()
                out = RewardOutput(overall, parts)
                _check_finite(out)
            except FutureTimeout:
                failed[unit.index] = True
                report._time(unit.name, unit.deadline)
                report._fail(item, unit.name, "timeout", f"no result within {unit.deadline:g} s", unit.deadline)
                continue
            except ProcessExpired as err:
                failed[unit.index] = True
                report._fail(item, unit.name, "worker_died", f"worker exited with code {err.exitcode}", 0.0)
                continue
            except Exception as err:  # noqa: BLE001
                failed[unit.index] = True
                report._fail(item, unit.name, "error", f"{type(err).__name__}: {err}", 0.0)
                if type(err).__name__ == "BrokenProcessPool":
                    self.close()  # a fresh pool next time
                continue
            report._time(unit.name, seconds)
            outputs[unit.index][unit.name] = out

    def _run_judge(self, units: list[_Unit], items, outputs, failed, report: ScoreReport) -> None:
        by_judge: dict[int, tuple[Any, list[_Unit]]] = {}
        for unit in units:
            judge = items[unit.index].meta.get("judge", self.judge)
            if judge is None:
                failed[unit.index] = True
                report._fail(items[unit.index], unit.name, "error",
                             "no judge: pass RewardExecutor(judge=JudgeReward(...)) or meta['judge']", 0.0)
                continue
            by_judge.setdefault(id(judge), (judge, []))[1].append(unit)
        for judge, group in by_judge.values():
            t0 = time.perf_counter()
            try:
                scored = judge.score_batch([(items[u.index].response, items[u.index].answer,
                                             {k: v for k, v in items[u.index].meta.items() if k != "judge"})
                                            for u in group])
            except Exception as err:  # noqa: BLE001
                for u in group:
                    failed[u.index] = True
                    report._fail(items[u.index], u.name, "error", f"{type(err).__name__}: {err}", 0.0)
                continue
            per_item = (time.perf_counter() - t0) / len(group)
            for u, out in zip(group, scored, strict=True):
                report._time(u.name, per_item)
                outputs[u.index][u.name] = out

    def _ensure_pool(self):
        with self._lock:
            if self._pool is None:
                from pebble import ProcessPool

                context = multiprocessing.get_context("forkserver")
                context.set_forkserver_preload(_PRELOAD)
                self._pool = ProcessPool(max_workers=self.workers, context=context, initializer=_init_worker,
                                         initargs=(self.worker_memory_mb,))
            return self._pool


def _gate(outputs: Mapping[str, RewardOutput]) -> dict[str, RewardOutput]:
    """Strict scoring of a refused response: the ``overall`` of each verifier that reports an ``accuracy`` (a
    correctness verifier) set to its minimum, its parts kept as it reported them; a verifier of the response's
    shape (format, length: no ``accuracy``) left as it is."""
    return {name: out if out.accuracy is None else RewardOutput(spec_of(name).low, dict(out.parts))
            for name, out in outputs.items()}


def _check_finite(out: RewardOutput) -> None:
    if not math.isfinite(out.overall):
        raise ValueError(f"non-finite reward {out.overall!r}")


_failures_lock = threading.Lock()


def _append_failures(path: Path, failures: list[Failure], items: Sequence[RewardItem]) -> None:
    """Append one JSON line per failure with the input that caused it (response capped at 64 KiB)."""
    by_id = {item.id: item for item in items}
    path.parent.mkdir(parents=True, exist_ok=True)
    with _failures_lock, path.open("a", encoding="utf-8") as f:
        for failure in failures:
            item = by_id.get(failure.id)
            record = {**failure.__dict__, "time": time.time()}
            if item is not None:
                record.update(response=item.response[:MAX_LOGGED_CHARS], response_chars=len(item.response),
                              answer=item.answer, reward=item.reward,
                              meta={k: v for k, v in item.meta.items() if k != "judge"})
            f.write(json.dumps(record, default=repr, ensure_ascii=False) + "\n")


# -- the default executor and the RL-loop entry point ---------------------------------------------------

_default: RewardExecutor | None = None
_default_lock = threading.Lock()


def default_executor() -> RewardExecutor:
    """The process-wide executor used when none is given (its pool starts only when needed)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = RewardExecutor()
            atexit.register(_default.close)
        return _default


def score_trajectories(trajectories: list, *, strict: bool = False, fallback: float = 0.0,
                       failures_path: str | Path | None = None, executor: RewardExecutor | None = None) -> ScoreReport:
    """Fill ``reward``, ``accuracy`` (`RewardOutput.accuracy`), ``well_formed`` and ``reward_parts`` of each
    trajectory; returns the `ScoreReport`.

    ``well_formed``: the response ended (not truncated, failed or aborted) and has its sample's declared answer
    form (`vlrl.data.Sample.declared_format`, `has_answer_form`); it is also the part ``well_formed``. With
    ``strict`` (the RL recipes' ``algo.strict_reward``) a response that is not well-formed scores the minimum of
    every verifier that reports an accuracy — a truncated ``<answer>1</answer>1</answer>1…`` earns no accuracy
    reward — while ``accuracy`` keeps what the verifier said (evaluation's ``strict`` is accuracy × well-formed).

    The verifier metadata is the sample's ``metadata`` plus ``response_length`` (the trajectory's number
    of model tokens, for ``overlong``) and, for judge verifiers, ``question`` (the prompt's text). A unit
    that fails gives its item ``fallback`` and is recorded in the report (and in ``failures_path``, e.g.
    ``<run dir>/reward_failures.jsonl``).
    """
    items, forms = [], []
    for t in trajectories:
        meta = dict(t.sample.metadata)
        meta.setdefault("response_length", t.response_length)
        if any(spec_of(name).mode == "judge" for name in reward_weights(t.sample.reward)):
            meta.setdefault("question", t.sample.prompt_text())
        formed = _ended(t) and has_answer_form(t.response_text, t.sample.declared_format())
        forms.append(formed)
        items.append(RewardItem(t.response_text, t.sample.answer, t.sample.reward, meta, t.sample.id, t.sample.task,
                                gated=strict and not formed))
    outputs, report = (executor or default_executor()).score(items, fallback=fallback, failures_path=failures_path)
    for t, out, formed in zip(trajectories, outputs, forms, strict=True):
        t.reward = out.overall
        t.accuracy = out.accuracy
        t.well_formed = formed
        t.reward_parts = {**out.parts, "well_formed": float(formed)}
    return report


def _ended(trajectory: Any) -> bool:
    """The response ended on its own (status ``completed``): not cut at the token budget, failed or aborted."""
    return trajectory.status == "completed"  # `vlrl.rollout.Status` is a str enum


def summarize(trajectories: list) -> dict[str, float]:
    """Mean of every reward part per task, as metrics: ``reward/<task>/<part>`` (and ``reward/<task>``)."""
    sums: dict[str, list[float]] = defaultdict(list)
    for t in trajectories:
        sums[f"reward/{t.sample.task}"].append(float(t.reward))
        for part, value in t.reward_parts.items():
            sums[f"reward/{t.sample.task}/{part}"].append(float(value))
    return {k: sum(v) / len(v) for k, v in sorted(sums.items())}
