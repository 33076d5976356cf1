"""`WatchedEngine`: an `Engine` seen by the report — without touching the training loops.

The recipes hand the loops a `WatchedEngine` around the real engine (`watch`). It forwards the `Engine` calls
unchanged, passes on the engine's other capabilities (`WatchedEngine.offer`: a recipe asks for them with
`vlrl.rollout.types.capability`) and, on the side:

- shows the rollout phase in the live progress (``sample 16×8``) and moves the RL bar at every weight update;
- notes rollout statistics of each training batch for the next logged record of the stage
  (``rollout/gen_prob``, ``rollout/unique_frac``; the loop's own metrics win on a name clash);
- writes a few trajectories of chosen RL steps, and of every evaluation, to ``samples.jsonl``.

The batch of step k is written when the weights of step k are published: by then the loop has scored it
(`score_trajectories` fills ``reward`` and ``reward_parts`` in place).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from vlrl.report.metrics import MetricsLogger
from vlrl.report.samples import SampleLog
from vlrl.rollout.types import C, Closable, capability


def generation_prob(trajectories: Sequence[Any]) -> float:
    """Mean probability of the sampled tokens under the policy that sampled them (DAPO §3.3.3 "generation
    probability"): mean over model tokens of exp(behaviour_logp). ``behaviour_logp`` carries the sampling
    temperature, so this is the probability of the tempered distribution actually sampled from."""
    logps = [t.behaviour_logp[t.loss_mask.bool()] for t in trajectories if len(t.behaviour_logp)]
    if not logps:
        return float("nan")
    return float(torch.cat(logps).float().exp().mean())


def unique_fraction(trajectories: Sequence[Any]) -> float:
    """Diversity of the groups: mean over prompts of (#distinct response texts / group size); 1/n when every
    group collapsed to one answer (DAPO's entropy-collapse symptom), 1 when all responses differ."""
    groups: dict[int, list[str]] = {}
    for t in trajectories:
        groups.setdefault(t.group_index, []).append(t.response_text)
    if not groups:
        return float("nan")
    return sum(len(set(texts)) / len(texts) for texts in groups.values()) / len(groups)


def rollout_metrics(trajectories: Sequence[Any]) -> dict[str, float]:
    return {"rollout/gen_prob": generation_prob(trajectories), "rollout/unique_frac": unique_fraction(trajectories)}


def snapshot_steps(total_steps: int, count: int) -> set[int]:
    """``count`` steps spread over 1..total (first and last included): 10 steps, 4 → {1, 4, 7, 10}."""
    if total_steps <= 0 or count <= 0:
        return set()
    if count == 1:
        return {total_steps}
    return {round(1 + k * (total_steps - 1) / (count - 1)) for k in range(count)}


def watch(engine: Any, logger: MetricsLogger, samples: SampleLog | None = None) -> WatchedEngine:
    """``engine`` (built by `vlrl.rollout.build_engine`) seen by the report: the one place a recipe wraps one."""
    return WatchedEngine(engine, logger, samples)


class WatchedEngine:
    """Forward to ``engine``; report progress, rollout statistics and sampled responses on the side."""

    def __init__(self, engine: Any, logger: MetricsLogger, samples: SampleLog | None = None) -> None:
        self.engine = engine
        self.logger = logger
        self.samples = samples
        self.stage: str | None = None
        self._snapshots: set[int] = set()
        self._last: list[Any] = []
        self._last_label = "train"
        self._recorded: int | None = None
        self._captured: list[tuple[str, list[Any]]] | None = None

    # -- the Engine protocol
    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def encode(self, sample):
        return self.engine.encode(sample)

    def generate(self, requests, sampling):
        label = "greedy" if sampling.temperature <= 0 else f"t={sampling.temperature:g}"
        self.logger.progress.status(f"rollout {len(requests)}×{sampling.n} ({label})")
        out = self.engine.generate(requests, sampling)
        if self._captured is not None:
            self._captured.append((label, out))
        if self.stage is not None:
            self._last, self._last_label = out, f"train {label}"
            self.logger.note(self.stage, rollout_metrics(out))
        return out

    def observe(self, trajectories, label: str, step: int) -> None:
        """The batch step ``step`` trains on, generated out of this watcher's sight (the asynchronous feed's, through
        the inner engine's ``agenerate``; `vlrl.rollout.types.BatchObserver`): recorded as the snapshot of version
        ``step + 1`` when that is one (rollout servers load it behind the watcher's back)."""
        if self.stage is None:
            return
        self._last, self._last_label = list(trajectories), f"train {label}"
        if step + 1 in self._snapshots:
            self._record(step + 1)

    def update_weights(self, *, version: int, state_dict=None) -> None:
        self.engine.update_weights(version=version, state_dict=state_dict)
        if self.stage is None:
            return
        self.logger.progress.stage_step(self.stage, version)
        if version in self._snapshots and self._recorded != version:  # (`observe` may have recorded it)
            self._record(version)

    def offer(self, protocol: type[C]) -> C | None:
        """What the watched engine can do besides (`vlrl.rollout.types.capability`): passed on unwatched (e.g. the
        asynchronous recipe's ``agenerate``, or ``publish``)."""
        return capability(self.engine, protocol)

    def close(self) -> None:
        if isinstance(self.engine, Closable):
            self.engine.close()

    # -- what the recipes use
    @contextmanager
    def training(self, stage: str, *, total_steps: int, snapshots: int) -> Iterator[None]:
        """Observe the RL loop of ``stage``: note rollout metrics, write ``snapshots`` batches to samples.jsonl
        (the last batch is written at the end even when a time budget stopped the loop early)."""
        self.stage, self._snapshots, self._last, self._recorded = stage, snapshot_steps(total_steps, snapshots), [], None
        try:
            yield
        finally:
            if snapshots > 0 and self._last and self._recorded != self.weight_version:
                self._record(self.weight_version)
            self.stage, self._snapshots, self._last = None, set(), []

    @contextmanager
    def aside(self) -> Iterator[None]:
        """Generation that is not the training loop's (an evaluation within it, ``eval.every``): not noted as the
        stage's rollout statistics, not a training snapshot."""
        stage, last, label = self.stage, self._last, self._last_label
        self.stage = None
        try:
            yield
        finally:
            self.stage, self._last, self._last_label = stage, last, label

    @contextmanager
    def capture(self) -> Iterator[list[tuple[str, list[Any]]]]:
        """Collect ``(sampling label, trajectories)`` of every generate call in the block (e.g. one eval)."""
        self._captured = captured = []
        try:
            yield captured
        finally:
            self._captured = None

    def _record(self, step: int) -> None:
        if self.samples is not None and self.stage is not None:
            self.samples.write(self.stage, step, [(self._last_label, self._last)])
        self._recorded = step
