"""The three-stage SFT recipe (LLaVA-OV-1.5: align → midtrain → instruct) on the tiny Qwen2-VL."""

import pytest
import torch

from vlrl.config import ConfigError, SFTConfig, load_config
from vlrl.models import load_policy
from vlrl.recipes import run_sft


def _weights(path):
    return load_policy(str(path)).model.state_dict()


def _changed(a, b):
    return {k for k in a if not torch.equal(a[k], b[k])}


def test_three_stages_align_trains_only_the_projector(tmp_path):
    small = {"batch_size": 4, "micro_batch_size": 4, "log_every": 1}
    cfg = SFTConfig.model_validate({
        "model": {"path": "tiny-qwen2-vl", "min_pixels": 3136, "max_pixels": 12544},
        "data": {"suite": "shapes", "tasks": ["count", "color"], "n_train": 8, "n_test": 2},
        "stages": [
            {"name": "align", "data": {"suite": "shapes", "tasks": ["color"], "n_train": 8},
             "optim": {"lr": 1e-2}, "train": {**small, "steps": 2, "trainable": ["projector"]}},
            {"name": "midtrain", "optim": {"lr": 1e-3, "module_lr": {"vision": 1e-4}},
             "train": {**small, "steps": 2, "padding_free": True}},
            {"name": "instruct", "train": {**small, "steps": 1, "trainable": ["llm"]}},
        ],
        "eval": {"samples": 1, "max_new_tokens": 2}, "out": str(tmp_path / "run"),
        "report": {"html": False}, "check": {"enabled": False},
    })
    summary = run_sft(cfg)
    ckpt = tmp_path / "run" / "checkpoints"
    base = {k: v for k, v in load_policy("tiny-qwen2-vl").model.state_dict().items()}
    align, midtrain, instruct = (_weights(ckpt / name) for name in ("align", "midtrain", "instruct"))
    # align: the projector (model.visual.merger) moved, nothing else did
    changed = _changed(align, base)
    assert changed and all(k.startswith("model.visual.merger.") for k in changed)
    assert all(k in changed for k in align if k.startswith("model.visual.merger.") and "weight" in k)
    # midtrain (full parameters) starts from align and moves the vision tower and the LLM too
    changed = _changed(midtrain, align)
    assert any(k.startswith("model.visual.blocks.") for k in changed)
    assert any(k.startswith("model.language_model.") for k in changed) and "lm_head.weight" in changed
    # instruct (LLM only) continued from the midtrain checkpoint: its frozen vision tower is midtrain's exactly
    changed = _changed(instruct, midtrain)
    assert changed and all(k.startswith(("model.language_model.", "lm_head.")) for k in changed)
    assert (ckpt / "final").resolve() == (ckpt / "instruct").resolve()
    assert set(summary["train"]) == {"align", "midtrain", "instruct"}
    assert summary["train"]["midtrain"]["steps"] == 2
    # native resolution: the pixel bounds travel with every checkpoint's image processor
    reloaded = load_policy(str(ckpt / "align"))
    assert (reloaded.image_processor.size["shortest_edge"], reloaded.image_processor.size["longest_edge"]) == (3136, 12544)


def test_stage_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="train: with `stages` set"):
        load_config(SFTConfig, None, ["stages=[{name: a}]", "train.steps=3"])
    with pytest.raises(ConfigError, match=r"duplicate stage name\(s\) \['a'\]"):
        load_config(SFTConfig, None, ["stages=[{name: a}, {name: a}]"])
    with pytest.raises(ConfigError, match="model.min_pixels .* exceeds model.max_pixels"):
        load_config(SFTConfig, None, ["model.min_pixels=5000", "model.max_pixels=4000"])
    cfg = load_config(SFTConfig, "src/vlrl/configs/three_stage_sft.yaml")
    assert [s.name for s in cfg.stages] == ["align", "midtrain", "instruct"]
    assert cfg.stages[0].train.trainable == ["projector"]
