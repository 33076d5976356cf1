"""The RL curriculum (LLaVA-OV-1.5-RL: answer-only, then chain-of-thought), each stage from the previous one."""

import json

import pytest
import torch

from vlrl.config import ConfigError, RLConfig, load_config
from vlrl.data.tasks import TEMPLATES
from vlrl.models import load_policy
from vlrl.recipes import run_rl


def test_two_stage_curriculum(tmp_path):
    small = {"steps": 1, "prompts_per_step": 2, "micro_batch_size": 4}
    rollout = {"n": 2, "max_new_tokens": 3}
    cfg = RLConfig.model_validate({
        "data": {"suite": "shapes", "tasks": ["count"], "n_train": 8, "n_test": 2},
        "stages": [
            {"name": "answer_only", "prompt_template": "answer", "rollout": rollout,
             "optim": {"lr": 1e-2, "weight_decay": 0.1},
             "train": small},
            {"name": "chain_of_thought", "prompt_template": "think", "rollout": rollout, "optim": {"lr": 1e-12},
             "train": small, "data": {"suite": "shapes", "tasks": ["color"], "n_train": 8}},
        ],
        "eval": {"samples": 1, "max_new_tokens": 2}, "out": str(tmp_path / "run"),
        "report": {"html": False, "rl_snapshots": 2}, "check": {"enabled": False},
    })
    summary = run_rl(cfg)
    assert set(summary) >= {"initial", "answer_only", "chain_of_thought", "rl", "train"}
    assert summary["train"]["chain_of_thought"]["steps"] == 1
    ckpt = tmp_path / "run" / "checkpoints"
    base = load_policy("tiny-qwen2-vl").model.state_dict()
    first = load_policy(str(ckpt / "answer_only")).model.state_dict()
    second = load_policy(str(ckpt / "chain_of_thought")).model.state_dict()
    # stage 1 moved the weights (AdamW's decoupled decay lr · 0.1 · θ moves them even when a random model earns
    # no reward and every advantage is 0)
    assert any(not torch.allclose(first[k], base[k], atol=1e-6) for k in base)
    # stage 2 (lr 1e-12) starts from stage 1's checkpoint: its weights are stage 1's, not the base model's
    assert all(torch.allclose(second[k], first[k], atol=1e-6) for k in first)
    assert (ckpt / "final").resolve() == (ckpt / "chain_of_thought").resolve()
    records = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    prompts = {r["stage"]: r["prompt"] for r in records if r["stage"] in ("answer_only", "chain_of_thought")}
    assert prompts["answer_only"].endswith(TEMPLATES["answer"]) and "How many" in prompts["answer_only"]
    assert prompts["chain_of_thought"].endswith(TEMPLATES["think"]) and "What color" in prompts["chain_of_thought"]


def test_curriculum_config_errors():
    with pytest.raises(ConfigError, match="rollout: with `stages` set"):
        load_config(RLConfig, None, ["stages=[{name: a}]", "rollout.n=4"])
    cfg = load_config(RLConfig, "src/vlrl/configs/curriculum_grpo.yaml")
    assert [s.prompt_template for s in cfg.stages] == ["answer", "think"]
