import io
import json

from PIL import Image

from vlrl.report.html import build_report
from vlrl.report.step_credit import HeatmapRow, render_heatmap, summarize


def _record(step, flips_all, flips_failed, correct, wrong):
    zero = {"flips": 0, "signed": 0, "new_signal": 0, "unsigned": 0}
    return {"step": step, "signal": "forward_proxy/contrast", "responses": 8, "parsed": 7, "parse_failures": 1,
            "no_gold": 0, "truncated_plans": 1, "prefix_decode": 2, "steps": 20, "correct_steps": 15, "successes": 3,
            "flips": {"all": flips_all, "success": zero, "failed": flips_failed, "correct_step": flips_failed,
                      "wrong_step": zero},
            "step_scores": {"correct": correct, "wrong": wrong}}


def _write(run):
    directory = run / "step_credit"
    directory.mkdir()
    records = [
        _record(1, {"flips": 2, "signed": 10, "new_signal": 1, "unsigned": 4}, {"flips": 2, "signed": 6, "new_signal": 0, "unsigned": 0},
                [0.5, 0.25], [-0.5]),
        _record(2, {"flips": 1, "signed": 10, "new_signal": 0, "unsigned": 0}, {"flips": 1, "signed": 4, "new_signal": 0, "unsigned": 0},
                [0.75], [0.1, -0.3]),
    ]
    (directory / "step_credit.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n{broken\n")
    rows = [HeatmapRow("#0 success", ['{"', "action", "_id", '": ', "3"], [0.5, 0.5, 0.5, 0.5, 1.5],
                       [False, False, False, False, True])]
    (directory / "heatmap_step00001.png").write_bytes(render_heatmap(rows))


def test_summary_adds_counts_over_steps(make_run):
    run = make_run()
    _write(run)
    summary, notes = summarize(run)
    assert summary.steps_logged == 2 and len(notes) == 1 and "line skipped" in notes[0]
    flips = {row["group"]: row for row in summary.flips}
    assert flips["all action tokens"]["flips"] == 3 and flips["all action tokens"]["ratio"] == 3 / 20
    assert flips["failed trajectories"]["ratio"] == 3 / 10 and flips["successful trajectories"]["ratio"] is None
    assert flips["all action tokens"]["new_ratio"] == 1 / 4
    proxy = {row["group"]: row for row in summary.proxy}
    assert proxy["rule-correct steps"]["n"] == 3 and proxy["rule-correct steps"]["mean"] == 0.5  # (.5 + .25 + .75) / 3
    assert proxy["rule-wrong steps"]["positive"] == 1 / 3 and proxy["rule-wrong steps"]["median"] == -0.3
    assert summary.totals["parse_failures"] == 2 and summary.histogram[:4] == b"\x89PNG"
    assert [name for name, _ in summary.heatmaps] == ["step00001"]


def test_report_shows_the_step_credit_tables(make_run, parse):
    run = make_run()
    _write(run)
    page = parse(build_report([run]))
    assert "step_credit" in page.sections and "#step_credit" in page.links
    flips = next(t for t in page.tables if t["class"] == "step-flips")
    assert flips["rows"][1] == ["all action tokens", "3", "20", "0.150", "1", "4"]
    assert flips["rows"][3][0] == "failed trajectories" and flips["rows"][3][3] == "0.300"
    proxy = next(t for t in page.tables if t["class"] == "step-proxy")
    assert proxy["rows"][1][:3] == ["rule-correct steps", "3", "0.500"]
    titles = [f.get("data-title") for f in page.figures_in("step_credit")]
    assert "step advantage by rule correctness" in titles and "advantage heatmap step00001" in titles
    assert "line skipped" in page.text  # the broken record line is reported, not lost


def test_no_section_without_step_credit(make_run, parse):
    page = parse(build_report([make_run()]))
    assert "step_credit" not in page.sections


def test_heatmap_grows_with_the_response():
    short = Image.open(io.BytesIO(render_heatmap([HeatmapRow("a", ["x"] * 10, [0.1] * 10, [False] * 10)])))
    long = Image.open(io.BytesIO(render_heatmap([HeatmapRow("a", ["x"] * 100, [0.1] * 100, [True] * 100)])))
    assert long.size[0] == short.size[0] and long.size[1] > short.size[1]
