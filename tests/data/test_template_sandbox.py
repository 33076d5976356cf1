"""Issue 47, item 1: a prompt template is untrusted input (it comes with a dataset or a shared recipe). vlrl renders
every template in jinja's immutable sandbox; one that reaches for what it may not is refused in one line naming its
file — through `vlrl check` and `vlrl data import`, the doors a user opens."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from vlrl.cli import app

EXPLOIT = "{{{{ cycler.__init__.__globals__.os.system('touch {marker}') }}}}{{{{ content }}}}"


def _data(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{k}", "task": "t", "prompt": "What is 2+2?", "answer": "4",
                                        "reward": "number", "response": "<answer>4</answer>"}) + "\n" for k in range(2)))
    return path


def test_vlrl_check_refuses_a_template_file_that_reaches_for_code(tmp_path):
    """Before: `os.system` ran during `vlrl check` and the preflight said ok. Now nothing runs, and the problem is
    one line naming the template file."""
    marker = tmp_path / "M"
    template = tmp_path / "fmt.jinja"
    template.write_text(EXPLOIT.format(marker=marker))
    data = _data(tmp_path)
    config = tmp_path / "sft.yaml"
    config.write_text(f"model: {{path: tiny-qwen2}}\ndata: {{train: {data}, test: {data}, prompt_template: {template}, "
                      "on_error: skip}\ntrain: {batch_size: 2, micro_batch_size: 2}\ncheck: {samples_per_task: 1}\n")
    result = CliRunner().invoke(app, ["check", str(config)])
    assert not marker.exists(), "the template ran code"
    assert result.exit_code == 1, result.output
    problems = [line for line in result.output.splitlines() if line.startswith("  ✗")]
    assert problems and all(line.startswith("  ✗ data.") and f"data.prompt_template ({template}): refused by the "
                            "template sandbox: access to attribute '__init__' of 'type' object is unsafe" in line
                            for line in problems), result.output


def test_vlrl_data_import_refuses_it_too(tmp_path):
    marker = tmp_path / "M"
    template = tmp_path / "fmt.jinja"
    template.write_text(EXPLOIT.format(marker=marker))
    result = CliRunner().invoke(app, ["data", "import", str(_data(tmp_path)), "--out", str(tmp_path / "out"),
                                      "--prompt-template", str(template)])
    assert not marker.exists() and result.exit_code == 1, result.output
    assert f"data.prompt_template ({template}): refused by the template sandbox" in result.output
    # an honest template still renders, in the sandbox
    template.write_text("{{ content | trim }} Answer in \\boxed{}.")
    result = CliRunner().invoke(app, ["data", "import", str(_data(tmp_path)), "--out", str(tmp_path / "out"),
                                      "--prompt-template", str(template)])
    assert result.exit_code == 0, result.output
    row = json.loads((tmp_path / "out" / "train.jsonl").read_text().splitlines()[0])
    assert row["messages"][0]["content"] == [{"type": "text", "text": "What is 2+2? Answer in \\boxed{}."}]


@pytest.mark.parametrize("template", ["{answer.__class__.__init__.__globals__}", "{answer[0]}", "{0}", "{}",
                                      "{answer:{response}}"])
def test_a_judge_template_takes_plain_field_names_only(template):
    """The judge prompts are ``str.format`` templates from a config: ``{answer.__class__...}`` would read any object
    the fields reach. Only plain names are filled; the rest is refused when the judge is built."""
    from vlrl.rewards.judge import fill_template
    from vlrl.rollout.envs.judge import JudgeEnv
    from vlrl.rollout.judge import JudgeReward

    with pytest.raises(ValueError, match="judge template: field"):
        fill_template(template, {"answer": "4", "response": "x"})
    with pytest.raises(ValueError, match="judge template: field"):
        JudgeReward(engine=None, template=template)
    with pytest.raises(ValueError, match="rollout.agent.env_kwargs.template: field"):
        JudgeEnv(judge=object(), template=template)
    assert fill_template("Q {question} A {answer!r:>4}", {"question": "2+2", "answer": "4"}) == "Q 2+2 A  '4'"
