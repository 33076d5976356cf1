"""A quick demo configuration end to end: SFT → eval → RL → eval → control, summary.json complete."""

import json

import pytest

from vlrl.config import DemoConfig, load_config
from vlrl.train.recipes import run_demo


@pytest.mark.e2e
def test_quick_demo_writes_a_complete_run(tmp_path):
    cfg = load_config(DemoConfig, None, [
        f"out={tmp_path}", "data.n_train=400", "data.n_test=40", "data.tasks=[count]",
        "sft.train.steps=40", "sft.optim.betas=[0.5,0.9]", "sft.train.batch_size=16", "sft.train.micro_batch_size=16", "sft.optim.lr=2e-3",
        "rl.train.steps=4", "rl.train.prompts_per_step=8", "rl.rollout.n=4", "rl.rollout.max_new_tokens=6",
        "eval.samples=2", "eval.max_new_tokens=6",
    ])
    summary = run_demo(cfg)
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["wall_seconds"] == summary["wall_seconds"] > 0
    for stage in ("base", "sft", "rl", "sft_control"):
        assert set(saved[stage]["accuracy"]) == {"shapes/count", "mean"}
        assert set(saved[stage]["greedy"]) == {"shapes/count", "mean"}
    assert (tmp_path / "config.yaml").exists()
    for name in ("sft", "rl", "sft_control"):
        assert (tmp_path / "checkpoints" / name / "model.safetensors").exists()
    stages = {json.loads(line)["stage"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()}
    assert {"sft", "rl", "sft_control", "eval/sft", "eval/rl", "eval/sft_control"} <= stages
    # SFT taught the answer format: the untrained model earns no reward, the SFT checkpoint does
    assert saved["base"]["reward"]["mean"] == 0.0
    assert saved["sft"]["reward"]["mean"] > 0.15
    # the control trained for (about) the RL stage's wall time, bounded by time, not by sft.train.steps
    assert saved["sft_control_train"]["seconds"] >= saved["rl_train"]["seconds"]
