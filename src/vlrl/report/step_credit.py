"""The step-credit analysis of a run: ``RUN_DIR/step_credit/`` files → report tables and images.

The ``step_credit`` advantage shaper (`vlrl.train.step_credit`) appends one record per RL step to
``step_credit/step_credit.jsonl`` (counts, not rates, so that steps add up) and writes a per-token advantage
heatmap every few steps (``heatmap_step00025.png``). This module sums the records over the run into the
tables the embodied seed asks for — sign flips over action tokens by trajectory success and by step
correctness; the step signal A^S on rule-correct vs rule-wrong steps — and draws the heatmaps and the A^S
histogram.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ANALYSIS_DIR = "step_credit"
RECORDS_FILE = "step_credit.jsonl"
FLIP_ROWS = [("all", "all action tokens"), ("success", "successful trajectories"), ("failed", "failed trajectories"),
             ("correct_step", "rule-correct steps"), ("wrong_step", "rule-wrong steps")]


@dataclass
class HeatmapRow:
    """One response of a heatmap: its tokens, the shaped advantage A of each, which tokens got step credit."""

    title: str
    tokens: list[str]
    advantages: list[float]
    target: list[bool]


def render_heatmap(rows: list[HeatmapRow], *, per_line: int = 16, vmax: float | None = None) -> bytes:
    """Tokens laid out like text, ``per_line`` to a line, each cell coloured by its advantage (blue > 0,
    red < 0, white 0; one symmetric scale for the whole image), credit-target tokens outlined. PNG bytes."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    values = [abs(v) for row in rows for v in row.advantages]
    vmax = vmax or max(values + [1e-6])
    norm, cmap = Normalize(-vmax, vmax), colormaps["RdBu"]
    lines = [max(1, math.ceil(len(row.tokens) / per_line)) for row in rows]
    fig = Figure(figsize=(per_line * 0.62, 0.3 * sum(lines) + 0.45 * len(rows) + 0.3), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0.01, 0.01, 0.98, 0.98))
    total = sum(lines) + 1.5 * len(rows)
    ax.set_xlim(0, per_line)
    ax.set_ylim(total, 0)
    ax.axis("off")
    y = 0.0
    for row, n_lines in zip(rows, lines, strict=True):
        ax.text(0, y + 0.9, row.title, fontsize=7, fontweight="bold", va="bottom")
        y += 1.5
        for t, (token, value, target) in enumerate(zip(row.tokens, row.advantages, row.target, strict=True)):
            x, line = t % per_line, y + t // per_line
            ax.add_patch(Rectangle((x + 0.02, line + 0.05), 0.96, 0.9, facecolor=cmap(norm(value)),
                                   edgecolor="black" if target else "#dddddd", linewidth=1.2 if target else 0.4))
            label = token.replace("\n", "⏎")
            ax.text(x + 0.5, line + 0.55, label if len(label) <= 9 else label[:8] + "…", fontsize=5.5,
                    ha="center", va="center", family="monospace")
        y += n_lines
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def render_histogram(correct: list[float], wrong: list[float], title: str) -> bytes:
    """Overlaid histograms of the step signal A^S on rule-correct and rule-wrong steps. PNG bytes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.4, 2.7), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    bins = [-1 + k * 0.1 for k in range(21)]
    for values, label, color in ((correct, "rule-correct steps", "#1f77b4"), (wrong, "rule-wrong steps", "#d62728")):
        if values:
            ax.hist([max(-1.0, min(1.0, v)) for v in values], bins=bins, alpha=0.55, color=color,
                    label=f"{label} ({len(values)})", density=True)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("A^S", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


@dataclass
class StepCreditSummary:
    """The run's step-credit analysis, summed over its RL steps."""

    signal: str
    steps_logged: int
    totals: dict[str, float]
    flips: list[dict[str, Any]]
    proxy: list[dict[str, Any]]
    histogram: bytes | None = None
    heatmaps: list[tuple[str, bytes]] = field(default_factory=list)


def read_records(run_dir: str | Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The records of ``RUN_DIR/step_credit/step_credit.jsonl`` and notes on the lines that could not be read."""
    path = Path(run_dir) / ANALYSIS_DIR / RECORDS_FILE
    records, notes = [], []
    if not path.is_file():
        return records, notes
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except ValueError as err:
                notes.append(f"{path}:{number}: line skipped ({err})")
    return records, notes


def summarize(run_dir: str | Path, *, max_heatmaps: int = 3) -> tuple[StepCreditSummary | None, list[str]]:
    """Sum the records of a run; None when the run has no step-credit analysis."""
    records, notes = read_records(run_dir)
    if not records:
        return None, notes
    totals = {key: float(sum(r.get(key, 0) for r in records))
              for key in ("responses", "parsed", "parse_failures", "no_gold", "truncated_plans", "prefix_decode",
                          "steps", "correct_steps", "successes")}
    flips = []
    for key, label in FLIP_ROWS:
        counts = {name: sum(r["flips"].get(key, {}).get(name, 0) for r in records)
                  for name in ("flips", "signed", "new_signal", "unsigned")}
        flips.append({"group": label, **counts, "ratio": counts["flips"] / counts["signed"] if counts["signed"] else None,
                      "new_ratio": counts["new_signal"] / counts["unsigned"] if counts["unsigned"] else None})
    values = {name: [v for r in records for v in r.get("step_scores", {}).get(name, [])] for name in ("correct", "wrong")}
    proxy = [_distribution(label, values[name]) for name, label in (("correct", "rule-correct steps"),
                                                                     ("wrong", "rule-wrong steps"))]
    signal = records[-1].get("signal", "?")
    from vlrl.report.plots import can_draw

    histogram = render_histogram(values["correct"], values["wrong"], f"A^S ({signal}) by rule correctness") \
        if (values["correct"] or values["wrong"]) and can_draw() else None
    pictures = sorted((Path(run_dir) / ANALYSIS_DIR).glob("heatmap_step*.png"))[-max_heatmaps:]
    heatmaps = [(p.stem.replace("heatmap_", ""), p.read_bytes()) for p in pictures]
    return StepCreditSummary(signal, len(records), totals, flips, proxy, histogram, heatmaps), notes


def _distribution(label: str, values: list[float]) -> dict[str, Any]:
    n = len(values)
    if not n:
        return {"group": label, "n": 0, "mean": None, "std": None, "positive": None, "negative": None,
                "q25": None, "median": None, "q75": None}
    mean = sum(values) / n
    ordered = sorted(values)

    def quantile(q: float) -> float:
        position = q * (n - 1)
        low, high = math.floor(position), math.ceil(position)
        return ordered[low] + (ordered[high] - ordered[low]) * (position - low)

    return {"group": label, "n": n, "mean": mean, "std": math.sqrt(sum((v - mean) ** 2 for v in values) / n),
            "positive": sum(v > 0 for v in values) / n, "negative": sum(v < 0 for v in values) / n,
            "q25": quantile(0.25), "median": quantile(0.5), "q75": quantile(0.75)}
