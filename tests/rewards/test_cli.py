import json

from typer.testing import CliRunner

from vlrl.cli import app

runner = CliRunner()


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_reward_score_offline(tmp_path):
    _write(tmp_path / "samples.jsonl", [
        {"id": "q1", "task": "arith/add", "prompt": "1+2?", "answer": "3", "reward": "number"},
        {"id": "q2", "task": "math", "prompt": "half?", "answer": "0.5", "reward": {"math": 0.8, "cot_format": 0.2}},
        {"id": "q3", "task": "code", "prompt": "sleep", "answer": [{"input": "", "output": "1"}], "reward": "code",
         "metadata": {"timeout": 0.5, "time_budget": 2.0}},
    ])
    _write(tmp_path / "responses.jsonl", [
        {"id": "q1", "response": "<answer>3</answer>"},
        {"id": "q1", "response": "<answer>4</answer>"},
        {"id": "q2", "response": "<think>" + "x" * 40 + "</think>\\boxed{\\frac{1}{2}}"},
        {"id": "q3", "response": "```python\nimport time\ntime.sleep(60)\n```"},
    ])
    out = tmp_path / "out" / "scored.jsonl"
    result = runner.invoke(app, ["reward", "score", "--data", str(tmp_path / "samples.jsonl"), "--responses",
                                 str(tmp_path / "responses.jsonl"), "--out", str(out), "--workers", "1"])
    assert result.exit_code == 0, result.output
    scored = [json.loads(line) for line in out.read_text().splitlines()]
    # 0.8 · math + 0.2 · cot_format = 1; the sleeping program times out on its one test → 0
    assert [s["reward"] for s in scored] == [1.0, 0.0, 1.0, 0.0]
    assert scored[2]["reward_parts"]["math/accuracy"] == 1.0 and scored[3]["reward_parts"]["timeouts"] == 1.0
    assert "arith/add: mean reward 0.5000 over 2" in result.output


def test_reward_score_names_the_bad_line(tmp_path):
    _write(tmp_path / "samples.jsonl", [{"id": "q1", "task": "t", "prompt": "?", "answer": "3", "reward": "number"}])
    (tmp_path / "responses.jsonl").write_text('{"id": "q1", "response": "3"}\n{"id": "q1"}\n')
    result = runner.invoke(app, ["reward", "score", "--data", str(tmp_path / "samples.jsonl"), "--responses",
                                 str(tmp_path / "responses.jsonl"), "--out", str(tmp_path / "o.jsonl")])
    assert result.exit_code == 2 and "responses.jsonl:2: needs string fields 'id' and 'response'" in result.output
    (tmp_path / "responses.jsonl").write_text('{"id": "q9", "response": "3"}\n')
    result = runner.invoke(app, ["reward", "score", "--data", str(tmp_path / "samples.jsonl"), "--responses",
                                 str(tmp_path / "responses.jsonl"), "--out", str(tmp_path / "o.jsonl")])
    assert result.exit_code == 2 and "'q9'" in result.output
