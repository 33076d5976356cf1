import json

from typer.testing import CliRunner

from vlrl.cli import app

runner = CliRunner()


def test_data_gen_writes_readable_samples(tmp_path):
    result = runner.invoke(app, ["data", "gen", "shapes", "--n", "6", "--split", "test", "--out", str(tmp_path),
                                 "--tasks", "count,ocr"])
    assert result.exit_code == 0, result.output
    lines = (tmp_path / "test.jsonl").read_text().splitlines()
    assert len(lines) == 6 and json.loads(lines[1])["task"] == "shapes/ocr"
    from vlrl.data import read_samples

    assert len(read_samples(tmp_path / "test.jsonl").samples) == 6


def test_unknown_suite_is_a_clear_error(tmp_path):
    result = runner.invoke(app, ["data", "gen", "juggling", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "unknown task suite 'juggling'" in result.output


def test_bad_override_exits_with_the_field_name(tmp_path):
    result = runner.invoke(app, ["rl", f"out={tmp_path}", "algo.clip_hihg=0.3"])
    assert result.exit_code == 2
    assert "config field 'algo.clip_hihg': unknown field" in result.output


def test_sft_on_a_user_file_then_eval(tmp_path):
    runner.invoke(app, ["data", "gen", "arith", "--n", "16", "--out", str(tmp_path / "data")])
    result = runner.invoke(app, ["sft", "--data", str(tmp_path / "data" / "train.jsonl"), f"out={tmp_path / 'run'}",
                                 "model.path=tiny-qwen2", "data.suite=arith", "data.tasks=[add]", "data.n_test=8",
                                 "train.steps=2", "train.batch_size=4", "eval.samples=2"])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert set(summary["sft"]["accuracy"]) == {"arith/add", "mean"}
    assert (tmp_path / "run" / "checkpoints" / "final" / "model.safetensors").exists()
    result = runner.invoke(app, ["eval", "--model", str(tmp_path / "run" / "checkpoints" / "final"),
                                 "--data", str(tmp_path / "data" / "train.jsonl"), "--samples", "2",
                                 "--out", str(tmp_path / "eval.json")])
    assert result.exit_code == 0, result.output
    assert "pass@k" in json.loads((tmp_path / "eval.json").read_text())
