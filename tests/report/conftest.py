"""Synthetic run directories (no training): what the recipes write, with hand-picked values."""

import json

import pytest
import yaml
from PIL import Image


def write_run(root, *, name="run", lr=5e-4, reward=lambda step: 0.1 * step, extra_groups=True, bad_line=False,
              config=None, metrics=None):
    """A run dir with sft + rl stages, two evals, a custom metric group, samples with an image. ``config``:
    sections merged into its config.yaml; ``metrics``: ``step → {name: value}`` added to each RL record."""
    run = root / name
    (run / "samples").mkdir(parents=True)
    config = {"model": {"path": "tiny-qwen2-vl"}, "rollout": {"n": 4}, "optim": {"lr": lr}, "out": str(run),
              **(config or {})}
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    lines = [{"stage": "eval/initial", "step": 0, "time": 1.0, "accuracy/mean": 0.25, "accuracy/shapes/count": 0.25,
              "greedy/mean": 0.5, "greedy/shapes/count": 0.5, "pass@4/mean": 0.5, "pass@4/shapes/count": 0.5}]
    for step in range(1, 6):
        record = {"stage": "rl", "step": step, "time": 1.0 + step, "reward/mean": reward(step),
                  "reward/shapes/count": reward(step), "reward/std": 0.3, "accuracy/mean": reward(step),
                  "policy/entropy": 2.0 - 0.1 * step, "policy/clip_high": 0.01, "policy/grad_norm": 1.5,
                  "response/length_mean": 6.0, "response/truncated_frac": 0.0, "rollout/gen_prob": 0.3,
                  "rollout/unique_frac": 1.0, "perf/step_seconds": 0.5}
        if extra_groups:
            record["zzz/custom_thing"] = float(step)  # a group the report has never heard of
        record.update(metrics(step) if metrics else {})
        if step == 3:
            record["policy/entropy"] = "nan"  # how MetricsLogger writes a NaN
        lines.append(record)
    lines.append({"stage": "eval/final", "step": 0, "time": 9.0, "accuracy/mean": 0.75, "accuracy/shapes/count": 0.75,
                  "greedy/mean": 1.0, "greedy/shapes/count": 1.0, "pass@4/mean": 1.0, "pass@4/shapes/count": 1.0})
    text = "\n".join(json.dumps(r) for r in lines) + "\n"
    if bad_line:
        text += "{not json\n"
    (run / "metrics.jsonl").write_text(text)
    Image.new("RGB", (112, 112), (200, 30, 30)).save(run / "samples" / "q1_0.png")
    rows = [{"stage": "eval/final", "step": 0, "sampling": sampling, "task": "shapes/count", "sample_id": "q1",
             "group": 0, "prompt": "<image>How many shapes?", "images": ["samples/q1_0.png"], "answer": "3",
             "response": response, "reward": reward_value, "reward_parts": {"accuracy": reward_value},
             "status": "completed", "length": 4, "weight_version": 5}
            for sampling, response, reward_value in [("greedy", "<answer>3</answer>", 1.0), ("t=1", "<answer>2</answer>", 0.0)]]
    (run / "samples.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return run


@pytest.fixture
def make_run(tmp_path):
    """``make_run(name=..., root=...)`` → a synthetic run directory (see `write_run`)."""
    return lambda root=None, **kwargs: write_run(root or tmp_path, **kwargs)


@pytest.fixture
def parse():
    """``parse(html)`` → a `Page`."""
    return Page




class Page:
    """What a report page holds, read with the standard library's HTML parser."""

    def __init__(self, html):
        from html.parser import HTMLParser

        page = self
        self.sections, self.figures, self.images, self.links, self.tables, self.stages = [], [], [], [], [], []
        self.text = []

        class Parser(HTMLParser):
            def __init__(self):
                super().__init__()
                self.in_section = None
                self.table = None
                self.row = None

            def handle_starttag(self, tag, attrs):
                attrs = dict(attrs)
                if tag == "section":
                    page.sections.append(attrs.get("id"))
                    self.in_section = attrs.get("id")
                if tag == "figure":
                    page.figures.append({**attrs, "section": self.in_section})
                if tag == "img":
                    page.images.append(attrs.get("src", ""))
                if tag in ("a", "link", "script") and (attrs.get("href") or attrs.get("src")):
                    page.links.append(attrs.get("href") or attrs.get("src"))
                if tag == "details" and "data-stage" in attrs:
                    page.stages.append(attrs["data-stage"])
                if tag == "table":
                    self.table = {"class": attrs.get("class"), "kind": attrs.get("data-kind"), "rows": []}
                    page.tables.append(self.table)
                if tag == "tr" and self.table is not None:
                    self.row = []
                    self.table["rows"].append(self.row)
                if tag in ("td", "th") and self.row is not None:
                    self.row.append("")

            def handle_endtag(self, tag):
                if tag == "table":
                    self.table = self.row = None

            def handle_data(self, data):
                page.text.append(data)
                if self.row is not None and self.row:
                    self.row[-1] += data.strip()

        Parser().feed(html)
        self.text = " ".join(self.text)

    def figures_in(self, section):
        return [f for f in self.figures if f["section"] == section]

    def figure(self, title, section=None):
        matches = [f for f in self.figures if f.get("data-title") == title and section in (None, f["section"])]
        assert matches, f"no chart titled {title!r}"
        return matches[0]
