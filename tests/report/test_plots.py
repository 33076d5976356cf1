"""Charts: the moving average by hand, PNG output of the stated size, NaN and single points drawn."""

import io
import math

from PIL import Image

from vlrl.report.plots import Line, Panel, ema, render_bars, render_panel


def test_ema_by_hand():
    # span 3 → α = 2 / 4 = 0.5: 2 → 0.5·4 + 0.5·2 = 3 → (NaN keeps 3) → 0.5·7 + 0.5·3 = 5
    assert ema([2.0, 4.0, math.nan, 7.0], 3) == [2.0, 3.0, 3.0, 5.0]
    assert math.isnan(ema([math.nan, 1.0], 3)[0])


def test_panels_and_bars_are_pngs_of_the_asked_size():
    long = Line("rl", list(range(100)), [math.sin(i / 5) for i in range(100)])  # > 40 points: raw + smoothed
    png = render_panel(Panel("entropy", [long, Line("sft", [1.0], [0.5]), Line("nan", [1.0, 2.0], [math.nan, 1.0])]),
                       width=4.0, height=2.5, dpi=100)
    assert Image.open(io.BytesIO(png)).size == (400, 250)
    bars = render_bars("acc", ["sft", "rl"], {"greedy": [0.5, math.nan]}, width=3.0, height=2.0, dpi=100)
    assert Image.open(io.BytesIO(bars)).size == (300, 200)
