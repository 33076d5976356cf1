"""One module per model family (`vlrl.models.families`): found by the config's ``model_type``, each family's
presets, parts and vision-tower arithmetic are its own, and a new module is all a new family needs."""

from __future__ import annotations

import copy
import textwrap

import pytest
from PIL import Image

from vlrl.models import PRESETS, load_policy
from vlrl.models.adapters import vision_tower
from vlrl.models.families import (
    FAMILIES,
    all_families,
    family_of,
    load_families,
    module_prefixes,
    tower_features,
    vision_tower_names,
)
from vlrl.models.introspect import inner_model
from vlrl.models.presets import FAMILY_PRESETS
from vlrl.registry import Registry, RegistryError

pytestmark = pytest.mark.usefixtures("one_thread")


def test_every_preset_is_declared_by_the_family_of_its_model_type():
    families = all_families()
    assert [f.order for f in families] == sorted(f.order for f in families)
    assert list(PRESETS) == [name for f in families for name in f.presets]  # listed family by family
    for name, spec in PRESETS.items():
        family = family_of(spec.family)
        assert name in family.presets and spec.family in family.model_types
        assert FAMILIES.get(spec.family) is family
    assert family_of("llama") is None  # no family module claims it: the family layer alone serves it
    # one vision preset per vision model type runs the family tests; the text family has none there
    assert len(FAMILY_PRESETS) == len({s.family for s in PRESETS.values() if family_of(s.family).vision_tower})
    assert "tiny-qwen2" not in FAMILY_PRESETS and "tiny-qwen2-vl-20m" not in FAMILY_PRESETS


@pytest.mark.parametrize("name", FAMILY_PRESETS)
def test_a_family_declares_where_its_model_keeps_its_parts(name):
    """The family's tower attribute is the model's vision tower, and each of its module groups (projector,
    vision, language model) names parameters of the model."""
    policy = load_policy(name)
    family = family_of(policy.model.config.model_type)
    assert vision_tower(policy.model) is getattr(inner_model(policy.model), family.vision_tower)
    groups = policy.adapter.module_groups
    assert set(groups) == {"projector", "vision", "llm"}
    for group, prefixes in groups.items():
        assert set(prefixes) <= set(family.module_prefixes[group])
        assert any(n.startswith(prefixes) for n, _ in policy.model.named_parameters()), group


@pytest.mark.parametrize("name", FAMILY_PRESETS)
def test_a_familys_own_arithmetic_counts_the_image_tokens_of_its_prompt(name):
    """What `vlrl check` holds the processor to: the family's `tower_features` (from the *model* config) equals
    the vision tokens the processor expanded two images of different sizes into."""
    policy = load_policy(name)
    config = policy.model.config
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "How many?"}]}]
    encoded = policy.adapter.encode_prompt(messages, [Image.new("RGB", (112, 112)), Image.new("RGB", (140, 84))])
    tokens = encoded.input_ids.count(policy.adapter.image_token_id)
    own = family_of(config.model_type).tower_features(config, encoded.vision, processor_merge_size=None)
    assert own is not None and own[0] == tokens > 0
    assert tower_features(config, encoded.vision)[0] == tokens


def test_a_model_type_no_family_claims_is_served_by_every_familys_knowledge():
    """A checkpoint whose model type has no module (say a fine-tune registered under its own name) but a known
    layout: its tower, module groups and feature count come from the families' declarations."""
    policy = load_policy("tiny-qwen2-vl")
    config = copy.deepcopy(policy.model.config)
    config.model_type = "my_qwen2_vl_finetune"
    assert family_of(config.model_type) is None
    assert vision_tower_names(config.model_type) == ("visual", "vision_tower", "vision_model")
    union = module_prefixes(config.model_type)
    assert {"model.visual.merger.", "model.connector."} <= set(union["projector"])
    assert {"model.language_model.", "model.text_model.", "lm_head."} <= set(union["llm"])
    encoded = policy.adapter.encode_prompt([{"role": "user", "content": [{"type": "image"}]}],
                                           [Image.new("RGB", (112, 112))])
    counted, how = tower_features(config, encoded.vision)
    assert counted == encoded.input_ids.count(policy.adapter.image_token_id) == 16 and "spatial_merge_size 2" in how


def _family_module(folder, name: str, model_type: str, order: int, preset: str) -> None:
    (folder / f"{name}.py").write_text(textwrap.dedent(f"""
        from vlrl.models.families import Family, PresetSpec
        from vlrl.models.families.qwen2_vl import MARKUP

        FAMILY = Family(model_types=({model_type!r},), order={order},
                        presets={{{preset!r}: PresetSpec({model_type!r}, MARKUP, lambda ids: (None, None, {{}}))}})
    """))


def test_a_new_family_is_one_new_module(tmp_path, monkeypatch):
    package = tmp_path / "my_families"
    package.mkdir()
    (package / "__init__.py").write_text("")
    _family_module(package, "zeta", "zeta_lm", 20, "tiny-zeta")
    _family_module(package, "alpha", "alpha_lm", 30, "tiny-alpha")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = Registry("model family")
    found = load_families("my_families", [str(package)], registry)
    assert [f.model_types for f in found] == [("zeta_lm",), ("alpha_lm",)]  # by order, not by file name
    assert registry.get("alpha_lm") is found[1] and list(found[1].presets) == ["tiny-alpha"]


@pytest.mark.parametrize("clash", ["model_type", "preset"])
def test_two_modules_claiming_one_model_type_or_preset_are_refused(tmp_path, monkeypatch, clash):
    package = tmp_path / f"clashing_{clash}"
    package.mkdir()
    (package / "__init__.py").write_text("")
    _family_module(package, "one", "one_lm", 10, "tiny-one")
    _family_module(package, "two", "one_lm" if clash == "model_type" else "two_lm", 20,
                   "tiny-one" if clash == "preset" else "tiny-two")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = Registry("model family")
    with pytest.raises(RegistryError, match=f"claimed by two family modules: clashing_{clash}.one and "
                                            f"clashing_{clash}.two"):
        load_families(f"clashing_{clash}", [str(package)], registry)
    assert registry.names() == []  # nothing registered from a refused set


def test_a_module_without_a_family_is_refused(tmp_path, monkeypatch):
    package = tmp_path / "no_family"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "helpers.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RegistryError, match="no_family.helpers: a family module defines FAMILY"):
        load_families("no_family", [str(package)], Registry("model family"))
