"""The HTML report: sections, curves of whatever groups appear, eval tables, samples, comparison, and one built
from a real tiny `vlrl demo` run (a rendering check: every image decodes, nothing is fetched from outside)."""

import base64
import io
import json
import re

import pytest
from PIL import Image

from vlrl.report.html import ReportError, build_report, config_differences, load_run, write_report


def _png(src):
    assert src.startswith("data:image/png;base64,"), src[:40]
    image = Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1])))
    image.load()
    return image


def test_single_run_has_every_section_and_plots_every_group(make_run, parse):
    page = parse(build_report([make_run()]))
    assert page.sections == ["summary", "dynamics", "eval", "samples", "metrics", "config"]
    titles = {f["data-title"] for f in page.figures_in("dynamics")}
    # every curve the run logged has its chart; KL and staleness were not logged, so they are absent
    assert {"Reward (per task)", "Entropy", "Generation probability", "Response length", "Truncated responses",
            "Clip fractions", "Gradient norm", "Diversity (distinct responses per group)"} <= titles
    assert "KL" not in titles and "Staleness / behaviour weights" not in titles
    reward = page.figure("Reward (per task)", "dynamics")
    assert json.loads(reward["data-metrics"]) == ["reward/mean", "reward/shapes/count"]  # reward/std excluded
    groups = {f["data-group"] for f in page.figures_in("metrics")}
    assert groups == {"reward", "accuracy", "policy", "response", "rollout", "perf", "zzz"}  # zzz: unknown group
    assert json.loads(page.figure("zzz/custom_thing")["data-stages"]) == ["rl"]
    for src in page.images:
        assert _png(src).size[0] > 50
    assert not page.links or all(link.startswith("#") for link in page.links)  # offline: in-page anchors only


def test_eval_table_and_samples(make_run, parse):
    page = parse(build_report([make_run()]))
    accuracy = next(t for t in page.tables if t["kind"] == "accuracy")
    # rows in the order the evaluations ran: initial 0.25 → final 0.75
    assert accuracy["rows"] == [["accuracy", "mean", "shapes/count"], ["initial", "0.250", "0.250"],
                                ["final", "0.750", "0.750"]]
    assert page.stages == ["eval/final"]
    responses = next(t for t in page.tables if t["class"] == "responses")
    assert responses["rows"][1][:3] == ["greedy", "<answer>3</answer>", "1.00"]  # escaped text, shown as text
    assert responses["rows"][2][3] == "accuracy 0"
    assert "sft 0.25" not in page.text and "initial" in page.text


def test_nan_values_and_bad_lines_are_reported_not_lost(make_run, parse):
    run = load_run(make_run(bad_line=True))
    assert any("metrics.jsonl:8: line skipped" in note for note in run.notes)
    entropy = [r.get("policy/entropy") for r in run.records if r["stage"] == "rl"]
    assert entropy[2] != entropy[2]  # "nan" read back as NaN
    page = parse(build_report([run.path]))
    assert "metrics.jsonl:8: line skipped" in page.text


def test_comparison_overlays_both_runs(make_run, parse, tmp_path):
    a = make_run(name="baseline", lr=5e-4)
    b = make_run(name="higher_lr", lr=1e-3, reward=lambda step: 0.2 * step)
    out = write_report([a, b], tmp_path / "compare.html")
    page = parse(out.read_text())
    assert page.figures_in("dynamics") and page.figures_in("metrics")
    for figure in page.figures_in("dynamics") + page.figures_in("metrics"):
        assert json.loads(figure["data-runs"]) == ["baseline", "higher_lr"], figure["data-title"]
    accuracy = next(t for t in page.tables if t["kind"] == "accuracy")
    assert [row[0] for row in accuracy["rows"][1:]] == ["baseline · initial", "baseline · final",
                                                         "higher_lr · initial", "higher_lr · final"]
    differences = next(t for t in page.tables if t["class"] == "differences")
    assert differences["rows"][1:] == [["optim.lr", "0.0005", "0.001"]]  # `out` differs too but is not a setting


def test_same_directory_names_get_distinct_labels(make_run, parse, tmp_path):
    a, b = make_run(root=tmp_path / "x"), make_run(root=tmp_path / "y")
    page = parse(build_report([a, b]))
    assert json.loads(page.figure("Entropy")["data-runs"]) == ["x/run", "y/run"]
    assert config_differences([load_run(a), load_run(b)]) == []


SYNC_ONE_UPDATE = {"rollout": {"n": 4, "mode": "sync"}, "algo": {"kl_coef": 0.0},
                   "train": {"minibatches": 1, "ppo_epochs": 1, "skip_zero_advantage": False}}


def _constant_metrics(step):
    return {"policy/clip_low": 0.0, "policy/approx_kl_old": 0.0, "policy/behaviour_weight_mean": 1.0,
            "policy/skipped_rows_frac": 0.0, "policy/kl_ref": 0.0}


def test_metrics_constant_by_construction_are_listed_not_charted(make_run, parse):
    """Hidden only when the data AND the config say so: the same constant values under a config that lets them
    move (2 minibatches, async, kl_coef > 0, skip_zero_advantage) stay charted, and so do values that move."""
    html = build_report([make_run(config=SYNC_ONE_UPDATE, metrics=_constant_metrics)])
    page = parse(html)
    # the fixture also logs policy/clip_high = 0.01 at every step: constant, and covered by the same rule
    assert set(re.findall(r'data-series="([^"]+)"', html)) == {f"rl · {name}" for name in
                                                                [*_constant_metrics(1), "policy/clip_high"]}
    titles = {f["data-title"] for f in page.figures_in("dynamics")}
    assert not {"KL", "Staleness / behaviour weights", "Clip fractions"} & titles
    assert {"Entropy", "Reward (per task)"} <= titles  # the metrics that move are all still there
    assert "algo.kl_coef = 0" in page.text and "rollout.mode = sync" in page.text

    moving = {"rollout": {"n": 4, "mode": "async"}, "algo": {"kl_coef": 0.01},
              "train": {"minibatches": 2, "ppo_epochs": 1, "skip_zero_advantage": True}}
    page = parse(build_report([make_run(name="moving", config=moving, metrics=_constant_metrics)]))
    assert "Not charted" not in page.text
    for name in _constant_metrics(1):
        page.figure(name, "metrics")
    varying = lambda step: {"policy/clip_low": 0.01 * step, "policy/behaviour_weight_mean": 1.0 + 1e-7 * step}  # noqa: E731
    page = parse(build_report([make_run(name="varying", config=SYNC_ONE_UPDATE, metrics=varying)]))
    page.figure("policy/clip_low", "metrics")
    page.figure("policy/behaviour_weight_mean", "metrics")


def test_run_cards_wrap_long_model_paths(make_run, parse, tmp_path):
    """The card shows the whole model path and held-out line (wrapped, never clipped or overflowing)."""
    long_path = "/data/checkpoints/" + "a-very-long-directory-name-without-spaces" * 4 + "/final"
    a = make_run(name="a", config={"model": {"path": long_path}})
    html = build_report([a, make_run(name="b")])
    assert long_path in html
    # the value column may shrink below its longest word and wraps it; the label column never wraps (checked by
    # eye in headless Chromium at 1280 px: before, the path ran out of its card and "held-out acc." broke in two)
    assert ".card dd { margin: 0; min-width: 0; overflow-wrap: anywhere; }" in html
    assert "grid-template-columns: auto minmax(0, 1fr)" in html and "white-space: nowrap" in html
    assert "initial 0.250 / 0.500 → final 0.750 / 1.000" in " ".join(parse(html).text.split())


def test_not_a_run_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ReportError, match="no metrics.jsonl"):
        build_report([tmp_path])
    with pytest.raises(ReportError, match="not a run directory"):
        build_report([tmp_path / "missing"])


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """A tiny `vlrl demo` (SFT → eval → RL → eval → control): the recipe writes report.html itself."""
    from vlrl.config import DemoConfig, load_config
    from vlrl.recipes import run_demo

    out = tmp_path_factory.mktemp("demo")
    cfg = load_config(DemoConfig, None, [
        f"out={out}", "data.n_train=64", "data.n_test=8", "data.tasks=[count,color]",
        "sft.train.steps=6", "sft.train.batch_size=8", "sft.train.micro_batch_size=8", "sft.train.log_every=2",
        "rl.train.steps=3", "rl.train.prompts_per_step=4", "rl.rollout.n=4", "rl.rollout.max_new_tokens=6",
        "rl.train.micro_batch_size=16", "eval.samples=2", "eval.max_new_tokens=6", "report.samples_per_task=1",
        "report.rl_snapshots=2",
    ])
    run_demo(cfg)
    return out


@pytest.mark.e2e
def test_demo_writes_a_report_that_renders(demo_run, parse):
    html = (demo_run / "report.html").read_text()
    page = parse(html)
    assert page.sections == ["summary", "dynamics", "eval", "samples", "metrics", "config"]
    dynamics = {f["data-title"]: f for f in page.figures_in("dynamics")}
    for title in ("Reward (per task)", "Entropy", "Generation probability", "Response length", "Truncated responses",
                  "Gradient norm", "Diversity (distinct responses per group)"):
        assert json.loads(dynamics[title]["data-stages"]) == ["rl"], title  # dynamics: the RL stage only
    # one optimizer step per RL batch (the demo's minibatches = ppo_epochs = 1): π_θ = π_old, so the clip
    # fractions and approx_kl_old are 0 at every step by construction — listed, not charted
    assert "Clip fractions" not in dynamics and "KL" not in dynamics
    assert 'data-series="rl · policy/clip_low"' in html and 'data-series="rl · policy/approx_kl_old"' in html
    assert json.loads(page.figure("sft/loss")["data-stages"]) == ["sft", "sft_control"]
    accuracy = next(t for t in page.tables if t["kind"] == "accuracy")
    assert [row[0] for row in accuracy["rows"][1:]] == ["base", "sft", "rl", "sft_control"]
    # samples: every eval plus the first and last RL batch, each with its shapes image inline
    assert page.stages == ["eval/base", "eval/sft", "rl step 1", "rl step 3", "eval/rl", "eval/sft_control"]
    rows = [json.loads(line) for line in (demo_run / "samples.jsonl").read_text().splitlines()]
    assert {r["task"] for r in rows if r["stage"] == "eval/rl"} == {"shapes/count", "shapes/color"}
    assert all((demo_run / r["images"][0]).is_file() and "accuracy" in r["reward_parts"] for r in rows)
    # rendering check: every image is a real PNG, nothing comes from outside the file
    assert len(page.images) >= len(page.figures)
    for src in page.images:
        _png(src)
    assert "http://" not in html and "https://" not in html
    assert "<answer>" not in html.replace("&lt;answer&gt;", "")  # model text is escaped, never markup


@pytest.mark.e2e
def test_demo_metrics_carry_rollout_statistics(demo_run):
    records = [json.loads(line) for line in (demo_run / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r["stage"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2, 3]
    for record in rl:
        assert 0 < record["rollout/gen_prob"] <= 1
        assert 0.25 <= record["rollout/unique_frac"] <= 1  # n = 4: at least 1 of 4 distinct


def test_a_synthesis_gallery_shows_original_and_synthesised_images(tmp_path, parse):
    run = tmp_path / "syn"
    (run / "synth_gallery").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"stage": "rl", "step": 1, "time": 1.0, "reward/mean": 0.5}) + "\n")
    Image.new("RGB", (112, 112), (255, 255, 255)).save(run / "synth_gallery" / "q1_source.png")
    Image.new("RGB", (112, 112), (20, 90, 200)).save(run / "synth_gallery" / "q1.png")
    row = {"step": 3, "task": "shapes/locate", "original_id": "q1", "parent_id": "q1", "sample_id": "q1~syn1",
           "generation": 1, "description": "ocean waves", "source": "synth_gallery/q1_source.png",
           "result": "synth_gallery/q1.png", "latency": 0.42, "backend": "classical"}
    (run / "synth_gallery.jsonl").write_text(json.dumps(row) + "\n{broken\n")
    page = parse(build_report([run]))
    assert "synthesis" in page.sections and page.sections.index("synthesis") == page.sections.index("samples") + 1
    assert "ocean waves" in page.text and "#synthesis" in page.links
    colours = sorted(_png(src).getpixel((5, 5)) for src in page.images if _png(src).size == (112, 112))
    assert colours == [(20, 90, 200), (255, 255, 255)]
    assert "synth_gallery.jsonl:2: skipped" in page.text
    (run / "synth_gallery.jsonl").unlink()
    assert "synthesis" not in parse(build_report([run])).sections


def test_without_matplotlib_the_report_gives_its_charts_as_text(make_run, parse, monkeypatch):
    """`vlrl report` where matplotlib cannot be imported (the `report` extra not installed): the page is still
    written, every chart is its series as text, no picture is drawn, and the first note says why."""
    import sys

    from typer.testing import CliRunner

    from vlrl.cli import app
    from vlrl.report.plots import NO_CHARTS

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    run = make_run()
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    html = (run / "report.html").read_text()
    page = parse(html)
    assert page.sections == ["summary", "dynamics", "eval", "samples", "metrics", "config"]
    assert NO_CHARTS in page.text
    reward = page.figure("Reward (per task)", "dynamics")
    assert json.loads(reward["data-metrics"]) == ["reward/mean", "reward/shapes/count"]
    # reward(step) = 0.1 * step over steps 1..5: the text gives the first, last, min and max values
    assert "reward/mean: 5 points, steps 1–5, first 0.1, last 0.5, min 0.1, max 0.5" in html
    assert "policy/entropy: 4 points" in html  # step 3 is NaN: left out
    assert not re.search(r'<figure class="chart[^"]*"[^>]*>\s*<img', html)  # no chart is a picture
    assert "0.75" in page.text  # the eval table is there without its bar chart
