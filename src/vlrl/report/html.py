"""`vlrl report RUN_DIR [RUN_DIR ...]`: one self-contained ``report.html`` (images as data URLs, no network).

Sections, top to bottom: a headline per run; the training dynamics DAPO §3.3.3 says to watch over the RL stages (reward per
task, accuracy, entropy, generation probability, response length, truncation, clip fractions, KL, grad norm,
staleness / behaviour weights, diversity — each shown when the run logged it); evaluation before / after;
sampled responses per task with rewards, sub-scores and images; for Syn-GRPO runs, the original → synthesised
images with their descriptions (``synth_gallery.jsonl``); step-level credit (sign flips, A^S by rule correctness,
per-token advantage heatmaps — when the run used the ``step_credit`` shaper, `vlrl.report.step_credit`); every
logged metric by group (whatever groups appear); the resolved configuration (and, for several runs, the
settings that differ).

With several run directories every chart overlays the runs.
"""

from __future__ import annotations

import base64
import datetime
import fnmatch
import io
import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlrl import safe_yaml
from vlrl.report.environment import describe
from vlrl.report.plots import NO_CHARTS, Line, Panel, can_draw, describe_panel, render_bars, render_panel
from vlrl.report.samples import read_jsonl_rows, read_sample_rows
from vlrl.report.sinks import RESERVED, flatten
from vlrl.report.verdict import demo_verdict

REPORT_FILE = "report.html"
MAX_LINES = 10  # series per chart; more are listed under the chart, not drawn

# (title, name patterns, excluded names): the curves DAPO §3.3.3 monitors, plus loss and zero-advantage groups.
DYNAMICS: list[tuple[str, list[str], list[str]]] = [
    ("Reward (per task)", ["reward/*"], ["reward/std", "reward/failures"]),
    ("Accuracy (training batches)", ["accuracy/*"], []),
    ("Entropy", ["*entropy*"], []),
    ("Generation probability", ["*gen_prob*", "*token_prob*"], []),
    ("Response length", ["response/length*", "*response_len*"], []),
    ("Truncated responses", ["*truncat*"], []),
    ("Clip fractions", ["policy/clip*", "*clip_frac*"], []),
    ("KL", ["*kl*"], []),
    ("Gradient norm", ["*grad_norm*"], []),
    ("Loss", ["*/loss"], []),
    ("Staleness / behaviour weights", ["*stale*", "*behaviour*", "*behavior*", "*is_weight*", "*version_lag*"], []),
    ("Diversity (distinct responses per group)", ["*unique*", "*divers*", "*distinct*"], []),
    ("Groups with zero advantage", ["*zero_adv*"], []),
    ("Model FLOPs utilisation (perf/mfu: update, perf/gen_mfu: generation)", ["perf/*mfu"], []),
]
GROUP_ORDER = ["reward", "accuracy", "policy", "response", "rollout", "sft", "perf", "data"]


def _one_update_per_batch(stage: dict[str, Any]) -> str | None:
    train, rollout = stage.get("train", {}), stage.get("rollout", {})
    if train.get("minibatches") == 1 and train.get("ppo_epochs") == 1 and rollout.get("mode") == "sync":
        return "one optimizer step per batch: π_θ = π_old at every token (train.minibatches = train.ppo_epochs = 1, sync)"
    return None


# Metrics a stage's configuration makes constant: (name patterns, the reason read from the stage's config
# section, or None when this config lets the metric move). A series is left out of the charts only when its
# logged values are also all identical (`hidden_constant_series`), so a metric that moves is always drawn.
CONSTANT_BY_CONFIG: list[tuple[list[str], Any]] = [
    (["policy/kl_ref*"], lambda s: "algo.kl_coef = 0: no reference model"
     if s.get("algo", {}).get("kl_coef") == 0 else None),
    (["staleness/*", "policy/behaviour_weight*", "policy/logp_drift"], lambda s: "rollout.mode = sync: every sample "
     "comes from the current weights" if s.get("rollout", {}).get("mode") == "sync" else None),
    (["policy/approx_kl_old", "policy/ratio*", "policy/clip_low", "policy/clip_high", "policy/clip_dual"],
     _one_update_per_batch),
    (["policy/skipped_rows_frac"], lambda s: "train.skip_zero_advantage = false"
     if s.get("train", {}).get("skip_zero_advantage") is False else None),
]


class ReportError(ValueError):
    """A run directory that cannot be reported (the message names it)."""


@dataclass
class Run:
    """What a run directory holds, read leniently: unreadable lines are skipped and listed in ``notes``."""

    label: str
    path: Path
    records: list[dict[str, Any]]
    config: dict[str, Any]
    config_text: str
    samples: list[dict[str, Any]]
    summary: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    @property
    def train_stages(self) -> list[str]:
        return _unique(r["stage"] for r in self.records if not str(r["stage"]).startswith("eval/"))

    @property
    def eval_records(self) -> list[dict[str, Any]]:
        return [r for r in self.records if str(r["stage"]).startswith("eval/")]

    @property
    def recipe(self) -> str:
        if "sft" in self.config and "rl" in self.config:
            return "demo"
        return "rl" if "rollout" in self.config else "sft" if self.config else "?"

    @property
    def wall_seconds(self) -> float | None:
        if isinstance(self.summary.get("wall_seconds"), (int, float)):
            return float(self.summary["wall_seconds"])
        return max((float(r.get("time", 0)) for r in self.records), default=None)


def load_run(path: str | Path, label: str | None = None) -> Run:
    """Read ``metrics.jsonl``, ``config.yaml``, ``summary.json`` and ``samples.jsonl`` of a run directory."""
    path = Path(path)
    if not path.is_dir():
        raise ReportError(f"{path}: not a run directory")
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise ReportError(f"{path}: no metrics.jsonl (is this a vlrl run directory?)")
    notes: list[str] = []
    records = []
    for number, line in enumerate(metrics.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or "stage" not in record or "step" not in record:
                raise ValueError("expected an object with 'stage' and 'step'")
        except ValueError as err:
            notes.append(f"{metrics}:{number}: line skipped ({err})")
            continue
        records.append({k: _number(v) for k, v in record.items()})
    config_text, config = "", {}
    if (path / "config.yaml").is_file():
        config_text = (path / "config.yaml").read_text(encoding="utf-8")
        try:
            config = safe_yaml.load(config_text, str(path / "config.yaml")) or {}
        except safe_yaml.YamlRefused as err:
            notes.append(f"{path / 'config.yaml'}: unreadable YAML ({err.reason})")
    else:
        notes.append(f"{path}: no config.yaml")
    summary: dict[str, Any] = {}
    if (path / "summary.json").is_file():
        try:
            summary = json.loads((path / "summary.json").read_text(encoding="utf-8"))
        except ValueError as err:
            notes.append(f"{path / 'summary.json'}: unreadable ({err})")
    samples, sample_notes = read_sample_rows(path)
    return Run(label or path.resolve().name, path, records, config if isinstance(config, dict) else {}, config_text,
               samples, summary, notes + sample_notes)


def _number(value: Any) -> Any:
    if isinstance(value, str) and value.lower() in ("nan", "inf", "-inf", "infinity", "-infinity"):
        return float(value)
    return value


def _unique(items) -> list:
    return list(dict.fromkeys(items))


def _labels(paths: list[Path]) -> list[str]:
    """Short distinct labels: the directory names, widened with parents where two collide."""
    labels = [p.resolve().name for p in paths]
    depth = 1
    while len(set(labels)) < len(labels) and depth < 6:
        depth += 1
        labels = ["/".join(p.resolve().parts[-depth:]) for p in paths]
    if len(set(labels)) < len(labels):
        labels = [f"{label} ({k + 1})" for k, label in enumerate(labels)]
    return labels


# ----------------------------------------------------------------------------------------------- curves
@dataclass
class Chart:
    """A rendered panel plus what it shows (kept as attributes in the HTML for readers and tests)."""

    title: str
    png: str | None  # data URL; None without matplotlib (then ``text``)
    runs: list[str]
    stages: list[str]
    metrics: list[str]
    hidden: list[str] = field(default_factory=list)  # series not drawn (over MAX_LINES)
    text: list[str] = field(default_factory=list)  # the chart as text, one line per series (no matplotlib)


def _series(runs: list[Run]) -> dict[tuple[str, str, str], tuple[list[float], list[float]]]:
    """(run, stage, metric) → (steps, values) over the training stages."""
    out: dict[tuple[str, str, str], tuple[list[float], list[float]]] = {}
    for run in runs:
        for record in run.records:
            stage = str(record["stage"])
            if stage.startswith("eval/"):
                continue
            for name, value in record.items():
                if name in RESERVED or isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                steps, values = out.setdefault((run.label, stage, name), ([], []))
                steps.append(float(record["step"]))
                values.append(float(value))
    return out


def stage_configs(run: Run) -> dict[str, dict[str, Any]]:
    """The config section each training stage of a run ran with: ``rl`` of a demo, each named stage of a
    curriculum, the whole config of a one-stage run."""
    config = run.config
    out = {stage.get("name"): stage for stage in config.get("stages") or [] if isinstance(stage, dict)}
    if isinstance(config.get("rl"), dict):
        out["rl"] = config["rl"]
    if isinstance(config.get("sft"), dict):
        out["sft"] = config["sft"]
    for stage in run.train_stages:
        out.setdefault(stage, config)
    return out


def hidden_constant_series(runs: list[Run], series) -> dict[tuple[str, str, str], str]:
    """(run, stage, metric) → why it is not charted: every logged value (two or more) is the same AND the stage's config
    makes the metric constant (`CONSTANT_BY_CONFIG`): the KL to a reference that does not exist, staleness and
    behaviour weights of a synchronous run, clip fractions when π_θ = π_old."""
    configs = {run.label: stage_configs(run) for run in runs}
    hidden = {}
    for key, (_steps, values) in series.items():
        run, stage, name = key
        if len(values) < 2 or len(set(values)) != 1:  # one point cannot show that a metric stays put
            continue
        section = configs.get(run, {}).get(stage)
        for patterns, reason_of in CONSTANT_BY_CONFIG:
            if section and any(fnmatch.fnmatchcase(name, p) for p in patterns) and (reason := reason_of(section)):
                hidden[key] = f"{values[0]:g} ({reason})"
                break
    return hidden


def _chart(title: str, keys: list[tuple[str, str, str]], series, multi_run: bool) -> Chart:
    drawn, hidden = keys[:MAX_LINES], keys[MAX_LINES:]
    vary = [len({key[i] for key in drawn}) > 1 for i in range(3)]
    vary[0] = vary[0] or multi_run
    lines = []
    for key in drawn:
        parts = [part for part, show in zip(key, vary, strict=True) if show]
        lines.append(Line(" · ".join(parts), *series[key]))
    panel = Panel(title, lines)
    drawable = can_draw()
    return Chart(title, _data_url(render_panel(panel)) if drawable else None, _unique(k[0] for k in drawn),
                 _unique(k[1] for k in drawn), _unique(k[2] for k in drawn), [" · ".join(k) for k in hidden],
                 [] if drawable else describe_panel(panel))


def dynamics_charts(runs: list[Run], series) -> list[Chart]:
    """The `DYNAMICS` charts over the RL stages (those logging ``reward/…``), or every stage of an SFT-only run."""
    rl_stages = {(key[0], key[1]) for key in series if key[2].startswith("reward/") and not key[1].startswith("val/")}
    keep = (lambda key: (key[0], key[1]) in rl_stages) if rl_stages else (lambda key: True)
    charts = []
    for title, patterns, excluded in DYNAMICS:
        keys = [key for key in series if keep(key) and key[2] not in excluded
                and any(fnmatch.fnmatchcase(key[2], p) for p in patterns)]
        if keys:
            charts.append(_chart(title, _ordered(keys, runs), series, len(runs) > 1))
    return charts


def validation_charts(runs: list[Run], series) -> list[Chart]:
    """``eval.every``: held-out sampled and greedy accuracy (mean over tasks) and mean reward against the training
    step of each ``val/<stage>`` — the run's initial and final evaluations at its ends."""
    charts = []
    for title, metrics in (("Held-out accuracy during training", ("accuracy/mean", "greedy/mean")),
                           ("Held-out reward during training", ("reward/mean",))):
        keys = [key for key in series if key[1].startswith("val/") and key[2] in metrics]
        if keys:
            charts.append(_chart(title, _ordered(keys, runs), series, len(runs) > 1))
    return charts


def group_charts(runs: list[Run], series) -> list[tuple[str, list[Chart]]]:
    """One chart per metric name, grouped by the name's prefix (``policy/entropy`` → ``policy``)."""
    by_group: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for key in series:
        group = key[2].split("/", 1)[0] if "/" in key[2] else "other"
        by_group[group][key[2]].append(key)
    order = [g for g in GROUP_ORDER if g in by_group] + sorted(g for g in by_group if g not in GROUP_ORDER)
    return [(group, [_chart(name, _ordered(keys, runs), series, len(runs) > 1)
                     for name, keys in sorted(by_group[group].items())]) for group in order]


def _ordered(keys, runs: list[Run]) -> list[tuple[str, str, str]]:
    """Run order as given, stages in the order they ran, metric names sorted."""
    run_index = {run.label: k for k, run in enumerate(runs)}
    stage_index = {(run.label, stage): k for run in runs for k, stage in enumerate(run.train_stages)}
    return sorted(keys, key=lambda key: (run_index[key[0]], stage_index.get((key[0], key[1]), 99), key[2]))


# ----------------------------------------------------------------------------------------------- eval
@dataclass
class EvalTable:
    kind: str  # "accuracy", "greedy", "pass@4", ...
    columns: list[str]  # "mean" first, then tasks
    rows: list[tuple[str, list[float | None]]]  # ("run · stage", values)


def eval_tables(runs: list[Run]) -> list[EvalTable]:
    cells: dict[str, dict[str, dict[str, float]]] = defaultdict(dict)  # kind → row → column → value
    for run in runs:
        for record in run.eval_records:
            row = f"{run.label} · {record['stage'][5:]}" if len(runs) > 1 else record["stage"][5:]
            for name, value in record.items():
                if name in RESERVED or "/" not in name or not isinstance(value, (int, float)):
                    continue
                kind, column = name.split("/", 1)
                cells[kind].setdefault(row, {})[column] = float(value)
    tables = []
    for kind, rows in cells.items():
        columns = _unique(["mean", *sorted(c for r in rows.values() for c in r if c != "mean")])
        columns = [c for c in columns if any(c in r for r in rows.values())]
        tables.append(EvalTable(kind, columns, [(row, [values.get(c) for c in columns]) for row, values in rows.items()]))
    return tables


def eval_chart(tables: list[EvalTable]) -> str | None:
    """Bars of the mean sampled and greedy accuracy of every evaluation, the verifier's and strict."""
    names = {"accuracy": "sampled (pass@1)", "greedy": "greedy", "strict": "strict sampled",
             "strict_greedy": "strict greedy"}
    wanted = [t for t in tables if t.kind in names and "mean" in t.columns]
    if not wanted or not can_draw():  # without matplotlib the eval tables say it
        return None
    rows = _unique(row for t in wanted for row, _ in t.rows)
    series = {}
    for table in wanted:
        values = dict(table.rows)
        series[names[table.kind]] = [_or_nan(values.get(row, [None])[0]) for row in rows]
    return _data_url(render_bars("Held-out accuracy (mean over tasks)", rows, series))


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value


# ----------------------------------------------------------------------------------------------- samples
def sample_sections(run: Run, *, max_groups: int = 12) -> list[dict[str, Any]]:
    """Samples grouped stage → task → prompt, for the template; images become data URLs."""
    images: dict[str, str | None] = {}
    stages: dict[tuple, dict] = {}
    for row in run.samples:
        stage_key = (row.get("stage"), row.get("step"))
        stage = stages.setdefault(stage_key, {"title": _stage_title(*stage_key), "tasks": {}})
        task = stage["tasks"].setdefault(row.get("task", "?"), {})
        prompt = task.setdefault(row.get("sample_id"), {
            "id": row.get("sample_id"), "prompt": row.get("prompt", ""), "answer": _short(row.get("answer")),
            "images": [_image(run, p, images) for p in row.get("images", [])], "responses": [],
        })
        prompt["responses"].append({
            "sampling": row.get("sampling", ""), "response": row.get("response", ""), "reward": row.get("reward"),
            "parts": ", ".join(f"{k} {_fmt(v)}" for k, v in (row.get("reward_parts") or {}).items()),
            "status": row.get("status", ""), "length": row.get("length"),
        })
    out = []
    for stage in stages.values():
        tasks = [{"name": name, "prompts": list(prompts.values())[:max_groups]} for name, prompts in stage["tasks"].items()]
        out.append({"title": stage["title"], "tasks": tasks,
                    "mean_reward": _mean([r["reward"] for t in tasks for p in t["prompts"] for r in p["responses"]])})
    return out


def gallery_rows(run: Run, *, limit: int = 24) -> list[dict[str, Any]]:
    """Original → synthesised pairs of a Syn-GRPO run (``synth_gallery.jsonl``), images as data URLs."""
    gallery, problems = read_jsonl_rows(run.path / "synth_gallery.jsonl")
    run.notes.extend(problems)
    images: dict[str, str | None] = {}
    rows = []
    for row in gallery:
        rows.append({**row, "source": _image(run, str(row.get("source", "")), images) if row.get("source") else None,
                     "result": _image(run, str(row.get("result", "")), images) if row.get("result") else None})
        if len(rows) >= limit:
            break
    return rows


def _stage_title(stage: Any, step: Any) -> str:
    return f"{stage}" if str(stage).startswith("eval/") else f"{stage} step {step}"


def _image(run: Run, relative: str, cache: dict[str, str | None]) -> str | None:
    if relative not in cache:
        path = run.path / relative
        try:
            from PIL import Image

            with Image.open(path) as image:
                image = image.convert("RGB")
                image.thumbnail((160, 160))
                buffer = io.BytesIO()
                image.save(buffer, format="PNG")
            cache[relative] = _data_url(buffer.getvalue())
        except (OSError, ValueError) as err:
            run.notes.append(f"{path}: image not shown ({err})")
            cache[relative] = None
    return cache[relative]


def _short(value: Any, limit: int = 200) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _mean(values: list) -> float | None:
    numbers = [v for v in values if isinstance(v, (int, float))]
    return sum(numbers) / len(numbers) if numbers else None


def _fmt(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


# ----------------------------------------------------------------------------------------------- config
def config_differences(runs: list[Run]) -> list[tuple[str, list[str]]]:
    """Dotted settings whose values differ between the runs (``out`` excluded)."""
    flat = [flatten(run.config) for run in runs]
    keys = sorted({k for f in flat for k in f} - {"out"})
    missing = "—"
    return [(k, [json.dumps(f[k], default=str) if k in f else missing for f in flat])
            for k in keys if len({json.dumps(f.get(k, missing), default=str) for f in flat}) > 1]


# ----------------------------------------------------------------------------------------------- page
def _headline(run: Run) -> dict[str, Any]:
    steps = {}
    for record in run.records:
        if not str(record["stage"]).startswith("eval/"):
            steps[record["stage"]] = max(steps.get(record["stage"], 0), int(record["step"]))
    evals = [(r["stage"][5:], r.get("accuracy/mean"), r.get("greedy/mean")) for r in run.eval_records]
    model = run.config.get("model", {}).get("path", "?") if isinstance(run.config.get("model"), dict) else "?"
    env = run.summary.get("environment")
    return {"label": run.label, "path": str(run.path), "recipe": run.recipe, "model": model,
            "steps": steps, "wall": run.wall_seconds, "evals": evals, "verdict": demo_verdict(run.summary),
            "environment": describe(env) if isinstance(env, dict) else None, "seed": run.summary.get("seed")}


def step_credit_sections(runs: list[Run]) -> list[dict[str, Any]]:
    """The step-credit analysis of every run that has one (`vlrl.report.step_credit`), images as data URLs."""
    from vlrl.report.step_credit import summarize

    out = []
    for run in runs:
        summary, notes = summarize(run.path)
        run.notes.extend(notes)
        if summary is None:
            continue
        totals = summary.totals
        out.append({
            "label": run.label, "signal": summary.signal, "steps": summary.steps_logged, "flips": summary.flips,
            "proxy": summary.proxy, "histogram": _data_url(summary.histogram) if summary.histogram else None,
            "heatmaps": [(name, _data_url(png)) for name, png in summary.heatmaps],
            "parsing": {"responses": int(totals["responses"]), "parse_failures": int(totals["parse_failures"]),
                        "prefix_decode": totals["prefix_decode"] / max(totals["parsed"], 1),
                        "truncated_plans": totals["truncated_plans"] / max(totals["parsed"], 1),
                        "step_acc": totals["correct_steps"] / max(totals["steps"], 1),
                        "success": totals["successes"] / max(totals["responses"], 1)},
        })
    return out


def build_report(run_dirs: list[str | Path], *, title: str | None = None) -> str:
    """The report page of one or several runs, as an HTML string."""
    from jinja2 import PackageLoader, select_autoescape
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if not run_dirs:
        raise ReportError("give at least one run directory")
    paths = [Path(p) for p in run_dirs]
    runs = [load_run(path, label) for path, label in zip(paths, _labels(paths), strict=True)]
    series = _series(runs)
    tables = eval_tables(runs)
    env = ImmutableSandboxedEnvironment(loader=PackageLoader("vlrl.report", "templates"),
                                        autoescape=select_autoescape(["html", "j2"]), trim_blocks=True,
                                        lstrip_blocks=True)
    env.filters["fmt"] = lambda v, digits=3: "—" if v is None or (isinstance(v, float) and math.isnan(v)) else (
        f"{v:.{digits}f}" if isinstance(v, float) else str(v))
    hidden = hidden_constant_series(runs, series)
    series = {key: value for key, value in series.items() if key not in hidden}
    page = env.get_template("report.html.j2").render(
        title=title or ("vlrl report: " + " vs ".join(r.label for r in runs)),
        generated=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        runs=runs,
        headlines=[_headline(r) for r in runs],
        dynamics=dynamics_charts(runs, series),
        validation=validation_charts(runs, series),
        eval_tables=tables,
        eval_chart=eval_chart(tables),
        samples=[(run.label, sample_sections(run)) for run in runs],
        galleries=[(run.label, rows) for run in runs if (rows := gallery_rows(run))],
        step_credit=step_credit_sections(runs),
        groups=group_charts(runs, series),
        constant=[(" · ".join(key if len(runs) > 1 else key[1:]), why) for key, why in sorted(hidden.items())],
        differences=config_differences(runs) if len(runs) > 1 else [],
        notes=[*([] if can_draw() else [NO_CHARTS]), *(note for run in runs for note in run.notes)],
    )
    return page


def write_report(run_dirs: list[str | Path], out: str | Path | None = None, *, title: str | None = None) -> Path:
    """Write the report; default location ``RUN_DIR/report.html`` for one run, ``./compare.html`` for several."""
    if out is None:
        out = Path(run_dirs[0]) / REPORT_FILE if len(run_dirs) == 1 else Path("compare.html")
    out = Path(out)
    html = build_report(run_dirs, title=title)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(html, encoding="utf-8")
    return out


def _data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")
