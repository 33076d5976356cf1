"""Discrepancy-driven selection of RL data: keep the prompts the model can solve but does not solve reliably.

LLaVA-OneVision-1.5-RL ("Discrepancy-Driven Selection", "Reward-Based Sampling"): roll out N responses per
prompt with the current model, score them with the rule-based rewards, and keep medium-difficulty items —
high pass@N but low pass@1 (latent capability), dropping the trivial (reward ≈ 1) and the unsolvable (≈ 0).
Per item, from n scored responses of which c are correct (`vlrl.eval.evaluate.correct`):

    pass@1   = c / n                                   (unbiased)
    pass@k   = 1 − C(n − c, k) / C(n, k)               (Chen et al. 2021, `vlrl.eval.evaluate.pass_at_k`)
    gap      = pass@k − pass@1
    mean reward = mean of the n rewards

An item is kept when every configured bound holds (`Band`): ``min_mean_reward ≤ mean ≤ max_mean_reward``
and ``gap ≥ min_gap``. Dropped items are labelled ``too_easy`` (mean above the band), ``too_hard`` (below
it), or ``small_gap``.

Rollouts are cached in a `RolloutStore` (jsonl, append-only) keyed by (model key, sampling settings, sample
id): a later selection with the same model re-uses them instead of generating again, and an online
dynamic-sampling filter can read per-item statistics from it (`RolloutStore.item_stats`). An RL stage's
``select.enabled`` runs it through `vlrl.train.select.select_for_training`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlrl.data.sample import Sample

if TYPE_CHECKING:
    from vlrl.rollout import Engine, SamplingParams


@dataclass(frozen=True)
class Band:
    """The selection band; None leaves a bound open."""

    min_mean_reward: float | None = 0.1
    max_mean_reward: float | None = 0.9
    min_gap: float | None = None
    k: int | None = None  # pass@k with k ≤ n; None: k = n (pass@N)

    def verdict(self, stats: ItemStats) -> str:
        """``keep``, ``too_easy``, ``too_hard`` or ``small_gap``."""
        if self.max_mean_reward is not None and stats.mean_reward > self.max_mean_reward:
            return "too_easy"
        if self.min_mean_reward is not None and stats.mean_reward < self.min_mean_reward:
            return "too_hard"
        if self.min_gap is not None and stats.gap < self.min_gap:
            return "small_gap"
        return "keep"


@dataclass
class ItemStats:
    id: str
    task: str
    n: int
    correct: int
    mean_reward: float
    pass_at_1: float
    pass_at_k: float
    k: int
    verdict: str = ""

    @property
    def gap(self) -> float:
        return self.pass_at_k - self.pass_at_1


def item_stats(sample: Sample, rewards: Sequence[float], correct: Sequence[float], k: int | None) -> ItemStats:
    """Statistics of one item from its n rewards and correctness values (1 correct, 0 wrong)."""
    from vlrl.eval.evaluate import pass_at_k

    n = len(rewards)
    if n == 0:
        raise ValueError(f"sample {sample.id}: no rollouts to compute pass@k from")
    k = n if k is None else k
    if not 1 <= k <= n:
        raise ValueError(f"pass@k: k = {k} must be in 1..{n} (the rollouts per item)")
    c = sum(1 for x in correct if x >= 0.5)
    return ItemStats(id=sample.id, task=sample.task, n=n, correct=c, mean_reward=sum(rewards) / n,
                     pass_at_1=c / n, pass_at_k=pass_at_k(n, c, k), k=k)


# ----------------------------------------------------------------------------------------------- the store
@dataclass
class Rollouts:
    """The cached, scored responses of one item under one model and sampling setting."""

    id: str
    model: str
    sampling: dict[str, Any]
    responses: list[str] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    correct: list[float] = field(default_factory=list)
    weight_version: int = 0


class RolloutStore:
    """Append-only jsonl of `Rollouts`; records of the same (model, sampling, id) accumulate.

    A line that does not parse stops the load with ``file:line`` (the store is written only by vlrl).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._items: dict[tuple[str, str, str], Rollouts] = {}
        if self.path.exists():
            with open(self.path, encoding="utf-8") as handle:
                for number, line in enumerate(handle, start=1):
                    if not line.strip():
                        continue
                    try:
                        self._merge(Rollouts(**json.loads(line)))
                    except (json.JSONDecodeError, TypeError) as err:
                        raise ValueError(f"{self.path}:{number}: not a rollout record ({err})") from err

    @staticmethod
    def _key(model: str, sampling: dict[str, Any], sample_id: str) -> tuple[str, str, str]:
        return model, json.dumps(sampling, sort_keys=True), sample_id

    def _merge(self, record: Rollouts) -> None:
        key = self._key(record.model, record.sampling, record.id)
        if key in self._items:
            held = self._items[key]
            held.responses += record.responses
            held.rewards += record.rewards
            held.correct += record.correct
        else:
            self._items[key] = Rollouts(**asdict(record))

    def get(self, model: str, sampling: dict[str, Any], sample_id: str) -> Rollouts | None:
        return self._items.get(self._key(model, sampling, sample_id))

    def add(self, records: Sequence[Rollouts]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as handle:
            for record in records:
                handle.write(json.dumps(asdict(record), ensure_ascii=False) + "\n")
                self._merge(record)

    def item_stats(self, model: str, sampling: dict[str, Any]) -> dict[str, tuple[int, int, float]]:
        """``{id: (n, correct, mean reward)}`` of every item cached for (model, sampling) — what an online
        filter needs to skip prompts known to be trivial or unsolvable."""
        wanted = json.dumps(sampling, sort_keys=True)
        return {sid: (len(r.rewards), sum(1 for x in r.correct if x >= 0.5), sum(r.rewards) / max(len(r.rewards), 1))
                for (m, s, sid), r in self._items.items() if m == model and s == wanted}

    def __len__(self) -> int:
        return len(self._items)


# ----------------------------------------------------------------------------------------------- selection
def rollout_and_score(
    engine: Engine, samples: Sequence[Sample], sampling: SamplingParams, store: RolloutStore, *, model: str,
    batch_prompts: int = 64, on_progress: Callable[[int], None] | None = None, strict: bool = True,
) -> tuple[dict[str, Rollouts], int, int]:
    """n scored rollouts per sample: from the store when it holds at least n for (model, sampling, strict), else
    generated with ``engine`` in batches, scored with the reward library, and appended to the store.
    ``strict`` (the RL stage's ``algo.strict_reward``): a response counts as correct only when it is also
    well-formed (ended, in its sample's answer form), and its reward is the strict one — the prompts are judged
    as training will score them. Returns (rollouts by id, items generated, reward failures)."""
    from vlrl.eval.evaluate import correct, formed
    from vlrl.rewards import score_trajectories

    key = {"n": sampling.n, "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
           "max_new_tokens": sampling.max_new_tokens, "stop": list(sampling.stop), "strict": strict}
    out: dict[str, Rollouts] = {}
    todo = []
    for sample in samples:
        cached = store.get(model, key, sample.id)
        if cached is not None and len(cached.rewards) >= sampling.n:
            out[sample.id] = cached
        else:
            todo.append(sample)
    failures = 0
    for start in range(0, len(todo), batch_prompts):
        chunk = todo[start : start + batch_prompts]
        trajectories = engine.generate([engine.encode(s) for s in chunk], sampling)
        failures += len(score_trajectories(trajectories, strict=strict).failures)
        records = [Rollouts(id=s.id, model=model, sampling=key, weight_version=engine.weight_version) for s in chunk]
        for t in trajectories:
            record = records[t.group_index]
            record.responses.append(t.response_text)
            record.rewards.append(float(t.reward))
            record.correct.append(correct(t) * formed(t) if strict else correct(t))
        store.add(records)
        for s in chunk:
            out[s.id] = store.get(model, key, s.id)
        if on_progress is not None:
            on_progress(len(samples) - len(todo) + start + len(chunk))
    return out, len(todo), failures


def select(samples: Sequence[Sample], rollouts: dict[str, Rollouts], band: Band) -> tuple[list[Sample], list[ItemStats]]:
    """The samples inside ``band`` (in input order) and every item's statistics with its verdict."""
    kept, stats = [], []
    for sample in samples:
        r = rollouts[sample.id]
        s = item_stats(sample, r.rewards, r.correct, band.k)
        s.verdict = band.verdict(s)
        stats.append(s)
        if s.verdict == "keep":
            kept.append(sample)
    return kept, stats


def summarise(stats: Sequence[ItemStats]) -> dict[str, Any]:
    """Counts per verdict overall and per task, and mean pass@1 / pass@k of the kept and of all items."""
    out: dict[str, Any] = {"items": len(stats), "verdicts": {}, "by_task": {}}
    for s in stats:
        out["verdicts"][s.verdict] = out["verdicts"].get(s.verdict, 0) + 1
        task = out["by_task"].setdefault(s.task, {})
        task[s.verdict] = task.get(s.verdict, 0) + 1
    for name, group in (("all", list(stats)), ("kept", [s for s in stats if s.verdict == "keep"])):
        if group:
            out[f"{name}_pass_at_1"] = sum(s.pass_at_1 for s in group) / len(group)
            out[f"{name}_pass_at_k"] = sum(s.pass_at_k for s in group) / len(group)
            out[f"{name}_mean_reward"] = sum(s.mean_reward for s in group) / len(group)
    return out
