"""``samples.jsonl``: a few sampled responses per task, with rewards, sub-scores and images, for the report.

One line per response::

    {"stage": "eval/rl", "step": 0, "sampling": "t=1.0", "task": "shapes/count", "sample_id": "...",
     "group": 3, "prompt": "<image>How many shapes ...", "images": ["samples/shapes-count-3_0.png"],
     "answer": "2", "response": "<answer>2</answer>", "reward": 1.0, "reward_parts": {"accuracy": 1.0},
     "well_formed": true, "status": "completed", "length": 5, "weight_version": 150,
     "token_versions": [[150, 3], [151, 2]]}

``token_versions``: the versions that sampled the response's tokens, as runs ``[version, count]`` in order — one run
unless the generation was continued across a weight update (``rollout.servers.on_weight_update=partial``).

Images are written once per sample under ``RUN_DIR/samples/`` (PNG), paths relative to the run directory.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlrl.data.sample import load_image

if TYPE_CHECKING:
    from vlrl.rollout.types import Trajectory

SAMPLES_FILE = "samples.jsonl"
IMAGE_DIR = "samples"


class SampleLog:
    """Append selected trajectories of a batch to ``RUN_DIR/samples.jsonl``."""

    def __init__(self, run_dir: str | Path, *, per_task: int = 2, per_prompt: int = 8) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / SAMPLES_FILE
        self.per_task, self.per_prompt = per_task, per_prompt
        self.written = 0

    def write(self, stage: str, step: int, batches: Sequence[tuple[str, Sequence[Trajectory]]]) -> int:
        """Write the responses of ``per_task`` prompts per task, the prompts chosen from the first batch;
        ``batches`` are ``(sampling label, trajectories)`` of the same requests (e.g. greedy and sampled).
        Returns the number of lines written."""
        if self.per_task <= 0 or not batches or not batches[0][1]:
            return 0
        chosen = _choose_prompts(batches[0][1], self.per_task)
        lines = []
        for label, trajectories in batches:
            taken: dict[int, int] = defaultdict(int)
            for t in trajectories:
                if t.group_index in chosen and taken[t.group_index] < self.per_prompt:
                    taken[t.group_index] += 1
                    lines.append(self._row(stage, step, label, t))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as handle:
            for row in lines:
                handle.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
        self.written += len(lines)
        return len(lines)

    def _row(self, stage: str, step: int, label: str, t: Trajectory) -> dict[str, Any]:
        return {
            "stage": stage, "step": step, "sampling": label, "task": t.sample.task, "sample_id": t.sample.id,
            "group": t.group_index, "prompt": t.sample.prompt_text(), "images": self._images(t),
            "answer": t.sample.answer, "response": t.response_text,
            "reward": t.reward, "reward_parts": dict(t.reward_parts), "well_formed": t.well_formed,
            "status": getattr(t.status, "value", str(t.status)), "length": int(len(t.response_ids)),
            "weight_version": t.weight_version, "token_versions": version_runs(t.versions),
        }

    def _images(self, t: Trajectory) -> list[str]:
        sources = list(t.images) or list(t.sample.images)
        paths = []
        for k, source in enumerate(sources):
            relative = f"{IMAGE_DIR}/{_safe(t.sample.id)}_{k}.png"
            target = self.run_dir / relative
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                load_image(source).save(target)
            paths.append(relative)
        return paths


def version_runs(versions: Any) -> list[list[int]]:
    """(R,) versions as runs ``[version, count]`` in order (``[[3, 5]]``: five tokens of version 3)."""
    runs: list[list[int]] = []
    for version in versions.tolist():
        if runs and runs[-1][0] == version:
            runs[-1][1] += 1
        else:
            runs.append([version, 1])
    return runs


def _choose_prompts(trajectories: Sequence[Trajectory], per_task: int) -> set[int]:
    """The group indices of the first ``per_task`` prompts of every task, in batch order."""
    by_task: dict[str, list[int]] = defaultdict(list)
    for t in trajectories:
        groups = by_task[t.sample.task]
        if t.group_index not in groups and len(groups) < per_task:
            groups.append(t.group_index)
    return {g for groups in by_task.values() for g in groups}


def read_sample_rows(run_dir: str | Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows of ``samples.jsonl`` (empty if absent) and a note per unreadable line (``file:line: reason``)."""
    return read_jsonl_rows(Path(run_dir) / SAMPLES_FILE)


def read_jsonl_rows(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The JSON-object rows of a JSONL file (empty if absent) and a note per unreadable line."""
    rows, problems = [], []
    if not path.exists():
        return rows, problems
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError("not a JSON object")
            rows.append(row)
        except ValueError as err:
            problems.append(f"{path}:{number}: skipped ({err})")
    return rows, problems


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
