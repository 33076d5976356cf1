"""Curves as PNG bytes, drawn with matplotlib's Agg canvas (no display, no pyplot global state).

A `Panel` is one small chart: a title and a few `Line` series (one per run × stage × metric). Noisy series
(more than `SMOOTH_FROM` points) are drawn raw and faint, with an exponential moving average on top.

matplotlib comes with the ``report`` extra (``pip install 'vlrl[report]'``, in ``vlrl[all]``). Without it
`can_draw` is False: the report gives each chart as text (`describe_panel`) under the note `NO_CHARTS`, and
the pictures drawn elsewhere (step-credit heatmaps, ``vlrl data balance``'s coverage plot) are skipped with it.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field

SMOOTH_FROM = 40
NO_CHARTS = "charts not drawn: matplotlib is not installed (pip install 'vlrl[report]'); each chart is given as text"
PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"]


@dataclass
class Line:
    label: str
    steps: list[float]
    values: list[float]


@dataclass
class Panel:
    title: str
    lines: list[Line] = field(default_factory=list)
    ylabel: str = ""


def can_draw() -> bool:
    """Whether matplotlib can be imported here (the ``report`` extra)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def describe_panel(panel: Panel) -> list[str]:
    """A panel as text, one line per series: its steps, first and last value, min and max (NaN left out)."""
    lines = []
    for line in panel.lines:
        points = [(s, v) for s, v in zip(line.steps, line.values, strict=True) if not math.isnan(v)]
        if not points:
            lines.append(f"{line.label or panel.title}: no finite values")
            continue
        values = [v for _, v in points]
        lines.append(f"{line.label or panel.title}: {len(points)} points, steps {points[0][0]:g}–{points[-1][0]:g}, "
                     f"first {values[0]:.4g}, last {values[-1]:.4g}, min {min(values):.4g}, max {max(values):.4g}")
    return lines


def ema(values: list[float], span: int) -> list[float]:
    """Exponential moving average with α = 2 / (span + 1), skipping NaN (it carries the last average)."""
    alpha, out, average = 2.0 / (span + 1), [], math.nan
    for v in values:
        if not math.isnan(v):
            average = v if math.isnan(average) else alpha * v + (1 - alpha) * average
        out.append(average)
    return out


def render_panel(panel: Panel, *, width: float = 4.4, height: float = 2.7, dpi: int = 100) -> bytes:
    """Draw ``panel`` and return PNG bytes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(width, height), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for k, line in enumerate(panel.lines):
        color = PALETTE[k % len(PALETTE)]
        if len(line.steps) == 1:
            ax.plot(line.steps, line.values, "o", color=color, label=line.label)
        elif len(line.steps) > SMOOTH_FROM:
            ax.plot(line.steps, line.values, color=color, alpha=0.25, linewidth=0.8)
            ax.plot(line.steps, ema(line.values, max(3, len(line.values) // 25)), color=color, linewidth=1.6,
                    label=line.label)
        else:
            ax.plot(line.steps, line.values, color=color, linewidth=1.4, marker="." if len(line.steps) < 25 else None,
                    label=line.label)
    ax.set_title(panel.title, fontsize=9.5, loc="left")
    ax.set_xlabel("step", fontsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=6, integer=True))
    if panel.ylabel:
        ax.set_ylabel(panel.ylabel, fontsize=8)
    ax.tick_params(labelsize=7.5)
    ax.grid(True, alpha=0.3, linewidth=0.6)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    if len(panel.lines) > 1 or (panel.lines and panel.lines[0].label):
        ax.legend(fontsize=6.5, frameon=False, loc="best", ncol=2 if len(panel.lines) > 4 else 1)
    fig.subplots_adjust(left=0.14, right=0.97, top=0.89, bottom=0.17)  # fixed margins: tight_layout costs a draw
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def render_bars(title: str, groups: list[str], series: dict[str, list[float]], *, width: float = 6.0,
                height: float = 2.8, dpi: int = 100) -> bytes:
    """Grouped bars: one group per x label (``groups``), one bar per series; NaN bars are left out."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    n = max(1, len(series))
    bar = 0.8 / n
    for k, (label, values) in enumerate(series.items()):
        xs = [i + (k - (n - 1) / 2) * bar for i in range(len(groups))]
        bars = ax.bar(xs, [0 if math.isnan(v) else v for v in values], bar, label=label, color=PALETTE[k % len(PALETTE)])
        for rect, v in zip(bars, values, strict=True):
            if not math.isnan(v):
                ax.annotate(f"{v:.2f}", (rect.get_x() + rect.get_width() / 2, rect.get_height()), ha="center",
                            va="bottom", fontsize=6.5, xytext=(0, 1), textcoords="offset points")
    ax.set_xticks(range(len(groups)), groups, fontsize=7.5, rotation=15 if len(groups) > 4 else 0)
    ax.set_ylim(0, 1.08)
    ax.set_title(title, fontsize=9.5, loc="left")
    ax.tick_params(labelsize=7.5)
    ax.grid(True, axis="y", alpha=0.3, linewidth=0.6)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.legend(fontsize=7, frameon=False, loc="upper left", ncol=min(4, n))
    fig.tight_layout(pad=0.4)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()
