"""Optional verifier dependencies: `missing_dependency` and `vlrl check` name the install command (issue 22)."""

import json
import sys

from typer.testing import CliRunner

from vlrl.cli import app
from vlrl.rewards import deps, missing_dependency


def test_vlrl_check_reports_a_verifier_without_its_extra(tmp_path, monkeypatch):
    records = [{"id": f"q{k}", "task": "t", "prompt": "What is 2+2?", "answer": "4", "reward": {"math": 0.8, "format": 0.2}}
               for k in range(4)]
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    config = tmp_path / "rl.yaml"
    config.write_text(f"data: {{train: {data}, test: {data}}}\nrollout: {{n: 4}}\ntrain: {{prompts_per_step: 4}}\n")
    runner = CliRunner()
    passed = runner.invoke(app, ["check", str(config)])
    assert passed.exit_code == 0 and "math" not in passed.output, passed.output  # installed here: nothing to say
    monkeypatch.setattr(deps, "_FOUND", set())
    monkeypatch.setitem(sys.modules, "math_verify", None)  # as if `vlrl[rewards]` were not installed
    assert missing_dependency("format") is None
    failed = runner.invoke(app, ["check", str(config)])
    assert failed.exit_code == 1, failed.output
    assert ("✗ data: the 'math' verifier needs math_verify, which is not installed: pip install 'vlrl[rewards]'"
            in failed.output)
