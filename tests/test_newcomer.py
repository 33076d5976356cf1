"""The newcomer's path, through the `vlrl` command as the README's "Train on your own data" gives it: real photos
that ship with scikit-image, written by this test into the documented jsonl format (questions a verifier can
score), then check → sft → data select → rl → eval. The evaluation must use the user's held-out split — never
the procedural shapes — and every bad input must end with its message and no traceback."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

import forked_runs  # tests/ is on sys.path

ROOT = Path(__file__).parents[1]
PHOTOS = ["astronaut", "coffee", "chelsea", "camera", "rocket", "coins", "text", "page", "moon", "brick", "grass",
          "clock", "colorwheel", "immunohistochemistry"]
QUADRANTS = {"A": "top-left", "B": "top-right", "C": "bottom-left", "D": "bottom-right"}
INSTRUCTION = " Put ONLY your final answer within <answer></answer>."
SMALL = ["eval.samples=1", "eval.max_new_tokens=4", "check.samples_per_task=2", "report.html=false"]

pytestmark = pytest.mark.e2e


def _brightest(image: Image.Image) -> str:
    """The quadrant with the highest mean grey level, as the multiple-choice letter."""
    grey = np.asarray(image.convert("L"), dtype=np.float64)
    h, w = grey.shape[0] // 2, grey.shape[1] // 2
    means = [grey[:h, :w].mean(), grey[:h, w:].mean(), grey[h:, :w].mean(), grey[h:, w:].mean()]
    return "ABCD"[int(np.argmax(means))]


def _record(sample_id, task, question, image, answer, reward, metadata=None):
    return {"id": sample_id, "task": task, "prompt": f"<image>{question}{INSTRUCTION}", "images": [image],
            "answer": answer, "reward": reward, "response": f"<answer>{answer}</answer>",
            **({"metadata": metadata} if metadata else {})}


@pytest.fixture(scope="module")
def mine(tmp_path_factory):
    """``mine.jsonl``: 14 scikit-image photos, each upright and upside down, three questions per picture (84
    samples): colour or not (`bool`), upside down or not (`bool`), the brightest quadrant (`multiple_choice`,
    options in metadata). Images at their own sizes (172×448 to 1411×1411), paths relative to the file."""
    from skimage import data

    root = tmp_path_factory.mktemp("user")
    (root / "images").mkdir()
    rows = []
    for name in PHOTOS:
        array = getattr(data, name)()
        photo = Image.fromarray(array if array.dtype == np.uint8 else (array * 255).astype(np.uint8)).convert(
            "RGB" if array.ndim == 3 else "L")
        for flipped in (False, True):
            picture = photo.transpose(Image.Transpose.FLIP_TOP_BOTTOM) if flipped else photo
            path = f"images/{name}_{int(flipped)}.png"
            picture.save(root / path)
            key = f"{name}-{int(flipped)}"
            rows.append(_record(f"{key}-colour", "colour", "Is this a colour photo?", path,
                                "yes" if array.ndim == 3 else "no", "bool"))
            rows.append(_record(f"{key}-flip", "flip", "Is this picture upside down?", path,
                                "yes" if flipped else "no", "bool"))
            options = ", ".join(f"{k}. {v}" for k, v in QUADRANTS.items())
            rows.append(_record(f"{key}-bright", "bright", f"Which quadrant is the brightest? {options}", path,
                                _brightest(picture), "multiple_choice", {"options": QUADRANTS}))
    (root / "mine.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _held_out(ids: list[str], fraction=0.1, seed=0) -> set[str]:
    """The README's rule, worked out here on its own: round(0.1 × 84) = 8 ids whose sha256("0:<id>") sort first."""
    count = round(fraction * len(ids))
    return set(sorted(ids, key=lambda i: hashlib.sha256(f"{seed}:{i}".encode()).hexdigest())[:count])


def test_check_sft_select_rl_eval_on_real_images(mine, tmp_path, monkeypatch):
    from vlrl.cli import app

    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    data = mine / "mine.jsonl"
    ids = [json.loads(line)["id"] for line in data.read_text().splitlines()]
    expected_test = _held_out(ids)
    assert len(ids) == 84 and len(expected_test) == 8

    # 1. check: the held-out split is stated, the photos' resize is a warning (from what to what), nothing fails
    result = runner.invoke(app, ["check", str(ROOT / "configs" / "shapes_sft.yaml"), "--data", str(data), *SMALL])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "8 of 84 samples of data.train held out for evaluation" in text
    assert "will be resized by the image processor" in text and "512×512 → 112×112" in text
    assert "shapes" not in text.split("(as a `vlrl sft` config)")[1]  # the shapes suite is not touched

    # 2. SFT on the file alone: 76 trained, 8 held out and evaluated; the run says so
    result = runner.invoke(app, ["sft", "--config", str(ROOT / "configs" / "shapes_sft.yaml"), "--data", str(data),
                                 "out=runs/mine_sft", "train.steps=2", "train.batch_size=4", "train.micro_batch_size=4",
                                 *SMALL])
    assert result.exit_code == 0, result.output
    assert "held out 8 of 84 samples" in " ".join(result.output.split())
    _assert_evaluated_on(tmp_path / "runs" / "mine_sft", expected_test)

    # 3. select RL prompts with the SFT model (a random-ish model: whatever it keeps, the command completes)
    result = runner.invoke(app, ["data", "select", "--data", str(data), "--model", "runs/mine_sft/checkpoints/final",
                                 "--n", "2", "--max-new-tokens", "4", "--out", "data/rl_selected"])
    assert result.exit_code == 0, result.output
    stats = [json.loads(line) for line in (tmp_path / "data" / "rl_selected" / "stats.jsonl").read_text().splitlines()]
    assert len(stats) == 84 and {s["id"] for s in stats} == set(ids)

    # 4. RL from the SFT checkpoint on the same file: the same 8 samples held out
    result = runner.invoke(app, ["rl", "--config", str(ROOT / "configs" / "shapes_grpo.yaml"), "--data", str(data),
                                 "model.path=runs/mine_sft/checkpoints/final", "out=runs/mine_rl", "train.steps=1",
                                 "train.prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=4",
                                 "train.micro_batch_size=4", *SMALL])
    assert result.exit_code == 0, result.output
    _assert_evaluated_on(tmp_path / "runs" / "mine_rl", expected_test)

    # 5. eval of the RL checkpoint: the run's held-out split and eval settings, a seed
    result = runner.invoke(app, ["eval", "--model", "runs/mine_rl/checkpoints/final", "--seed", "3",
                                 "--out", "eval.json"])
    assert result.exit_code == 0, result.output
    assert "the run's held-out split of" in result.output
    evaluated = json.loads((tmp_path / "eval.json").read_text())
    assert evaluated["n_prompts"] == 8 and set(evaluated["accuracy"]) <= {"colour", "flip", "bright", "mean"}
    assert evaluated["settings"] == {"samples": 1, "temperature": 1.0, "top_k": 50, "max_new_tokens": 4,
                                     "max_batch_size": 256, "seed": 3,  # top_k: shapes_grpo.yaml's eval.top_k
                                     "numerics": {"requested": "native", "mode": "native", "reason": "asked for"}}
    result = runner.invoke(app, ["report", "runs/mine_sft", "runs/mine_rl", "--out", "mine.html"])
    assert result.exit_code == 0 and (tmp_path / "mine.html").is_file()


def _assert_evaluated_on(run: Path, expected_test: set[str]) -> None:
    """The final evaluation's prompts (samples.jsonl, all of them recorded for these 8) are the held-out ids,
    and summary.json's tasks are the user's."""
    summary = json.loads((run / "summary.json").read_text())
    final = summary.get("rl") or summary["sft"]
    assert final["n_prompts"] == 8
    assert set(final["accuracy"]) - {"mean"} <= {"colour", "flip", "bright"}
    rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    evaluated = {r["sample_id"] for r in rows if r["stage"].startswith("eval/")}
    assert evaluated and evaluated <= expected_test
    assert not any(r["task"].startswith("shapes/") for r in rows)


# ----------------------------------------------------------------------------------------------- bad input
def _vlrl(*args, cwd):
    """`vlrl ARGS` as a user runs it (a process of its own): (exit code, stdout + stderr)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = forked_runs.run([sys.executable, "-m", "vlrl.cli", *args], cwd=cwd, env=env, timeout=600)
    assert "Traceback" not in done.stderr and "╭─" not in done.stderr, done.stderr[-3000:]
    return done.returncode, done.stdout + done.stderr


def _lines(mine: Path, name: str, change) -> Path:
    """A copy of mine.jsonl (same directory, so the image paths hold) with ``change(records)`` applied."""
    records = [json.loads(line) for line in (mine / "mine.jsonl").read_text().splitlines()]
    change(records)
    path = mine / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_bad_inputs_end_with_their_message(mine, tmp_path):
    config = str(ROOT / "configs" / "shapes_sft.yaml")

    def seven(records):
        records[1].update(task="count", prompt="<image>How many objects? Answer with a number.", answer="seven",
                          reward="number", response="<answer>7</answer>")

    def missing_image(records):
        records[2]["images"] = ["images/nowhere.png"]

    bad = _lines(mine, "bad.jsonl", lambda r: (seven(r), missing_image(r)))
    code, out = _vlrl("sft", "--config", config, "--data", str(bad), "out=runs/bad", *SMALL, cwd=tmp_path)
    assert code == 1
    assert f"✗ {bad}:2: answer \"seven\" can never score on verifier 'number'" in out
    assert f"✗ {bad}:3: field 'images[0]': image file not found" in out and "preflight: 2 problem(s)" in out
    assert not (tmp_path / "runs" / "bad" / "checkpoints").exists()

    # the same file with the preflight switched off: the reader's first error, one line, still no traceback
    code, out = _vlrl("sft", "--config", config, "--data", str(bad), "out=runs/bad", "check.enabled=false", *SMALL,
                      cwd=tmp_path)
    assert code == 1 and f"vlrl sft: {bad}:2: answer \"seven\" can never score" in out

    code, out = _vlrl("rl", "--data", str(mine / "mine.jsonl"), "data.test_fraction=0", "out=runs/x", *SMALL,
                      cwd=tmp_path)
    assert code == 1 and "✗ data.test: unset, and data.test_fraction is 0" in out and "--test FILE" in out

    code, out = _vlrl("sft", "--data", str(mine / "mine.jsonl"), "model.path=runs/nope/checkpoints/final",
                      "out=runs/x", *SMALL, cwd=tmp_path)
    assert code == 1 and "✗ model.path: runs/nope/checkpoints/final: no such directory" in out
    code, out = _vlrl("eval", "--model", "runs/nope/checkpoints/final", "--data", str(mine / "mine.jsonl"),
                      cwd=tmp_path)
    assert code == 1 and "✗ model.path: runs/nope/checkpoints/final: no such directory" in out
    assert "Repo id" not in out

    # a 4,000-token question: named by its line before anything is generated (nothing allocated)
    long = _lines(mine, "long.jsonl", lambda r: r[0].update(prompt="<image>" + "Look closely. " * 1300 + "Colour?"))
    code, out = _vlrl("eval", "--model", "tiny-qwen2-vl", "--data", str(long), cwd=tmp_path)
    assert code == 1 and f"✗ {long}:1: the prompt is " in out and "longer than the model context of 2048 tokens" in out

    code, out = _vlrl("data", "select", "--data", str(bad), "--model", "tiny-qwen2-vl", "--out", "sel", cwd=tmp_path)
    assert code == 1 and f"✗ {bad}:2: answer \"seven\"" in out and not (tmp_path / "sel").exists()


def test_a_config_beside_the_data_finds_it(mine, tmp_path):
    """Relative paths in a config file are read from its directory, whatever the current directory is."""
    (mine / "mine.yaml").write_text("data: {train: mine.jsonl}\nout: runs/from_config\n")
    code, out = _vlrl("check", str(mine / "mine.yaml"), "--recipe", "sft", *SMALL, cwd=tmp_path)
    assert code == 0, out
    assert "8 of 84 samples of data.train held out" in " ".join(out.split())
