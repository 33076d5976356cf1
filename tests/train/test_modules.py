import pytest
import torch

from vlrl.train.modules import assign, param_groups, restore_trainable, set_trainable

GROUPS = {"projector": ("model.visual.merger.",), "vision": ("model.visual.",), "llm": ("model.language_model.", "lm_head.")}


def test_groups_take_the_most_specific_prefix(tiny_vlm):
    owner = assign(tiny_vlm.model, ["vision", "projector", "llm"], GROUPS, field="optim.module_lr")
    names = [n for n, _ in tiny_vlm.model.named_parameters()]
    assert set(owner) == set(names)  # every parameter of Qwen2-VL is in one of the three groups
    assert {owner[n] for n in names if n.startswith("model.visual.merger.")} == {"projector"}
    assert {owner[n] for n in names if n.startswith("model.visual.blocks.")} == {"vision"}
    assert owner["lm_head.weight"] == "llm"
    # a plain prefix beats a group that contains it
    owner = assign(tiny_vlm.model, ["llm", "model.language_model.layers.0."], GROUPS, field="f")
    assert owner["model.language_model.layers.0.mlp.up_proj.weight"] == "model.language_model.layers.0."
    assert owner["model.language_model.layers.1.mlp.up_proj.weight"] == "llm"


def test_unknown_names_are_errors(tiny_vlm):
    with pytest.raises(ValueError, match="train.trainable: 'projektor' matches no parameter .*projector, vision"):
        set_trainable(tiny_vlm.model, ["projektor"], GROUPS)
    with pytest.raises(ValueError, match="'all' cannot be combined"):
        set_trainable(tiny_vlm.model, ["all", "llm"], GROUPS)


def test_param_groups_carry_their_learning_rates(tiny_vlm):
    frozen = set_trainable(tiny_vlm.model, ["projector", "llm"], GROUPS)
    groups = {g["name"]: g for g in param_groups(tiny_vlm.model, 1e-3, {"projector": 5e-3}, GROUPS)}
    assert set(groups) == {"projector", "default"}  # the frozen vision tower is in no group
    assert groups["projector"]["lr"] == 5e-3 and groups["default"]["lr"] == 1e-3
    merger = sum(p.numel() for n, p in tiny_vlm.model.named_parameters() if n.startswith("model.visual.merger."))
    assert sum(p.numel() for p in groups["projector"]["params"]) == merger
    optimizer = torch.optim.AdamW(list(groups.values()))
    assert [g["lr"] for g in optimizer.param_groups] == [groups[g["name"]]["lr"] for g in optimizer.param_groups]
    restore_trainable(tiny_vlm.model, frozen)
    assert all(p.requires_grad for p in tiny_vlm.model.parameters())
