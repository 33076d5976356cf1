"""A model from its ``config.json`` alone — no weights, no tokenizer — for `vlrl plan` and the GPU check.

A user plans a real model before downloading it (``vlrl plan CONFIG model.path=…/config.json``), and the GPU check
(`benchmarks/gpu_check.py`) builds a real-size model with random weights: neither has the real tokenizer or
processor files, and this machine reaches no hub. What stands in for them:

- **the tokenizer** of the family's tiny preset (`vlrl.models.families`: a BPE trained locally, with the family's
  chat template and vision markup). Only the token *ids* of the markup differ from the real tokenizer's, so the
  config's special ids (``image_token_id``, ``vision_start_token_id``, EOS, …) are re-pointed at the stand-in's; the
  vocabulary size — what the embedding, the LM head and the logits cost — stays the config's. A prompt's *text*
  tokenises into a slightly different count than with the real tokenizer (vision tokens, which dominate VLM
  prompts, are the same);
- **the image processor** of the family (Qwen-style: ``Qwen2VLImageProcessorPil``) with the config's patch size,
  spatial merge and temporal patch, and the real checkpoints' default pixel bounds (the family's `pixel_bounds`), so an image
  becomes the number of vision tokens the real processor gives it.

`is_config_only` says whether a ``model.path`` is such a config; `stand_in_policy` builds the `Policy` (on the meta
device for planning; with random weights on any device for the GPU check).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def config_file(path: str | Path) -> Path | None:
    """The ``config.json`` of ``path`` when it is a config alone: a ``.json`` file, or a directory holding a
    ``config.json`` and no tokenizer; None otherwise (a full model directory, a preset, a hub id)."""
    local = Path(path)
    if local.is_file() and local.suffix == ".json":
        return local
    if local.is_dir() and (local / "config.json").is_file() and not any((local / f).exists() for f in _TOKENIZER_FILES):
        return local / "config.json"
    return None


def is_config_only(path: str | Path) -> bool:
    return config_file(path) is not None


def load_config(path: str | Path) -> Any:
    """The transformers config of a ``config.json`` (or of a directory holding one)."""
    from transformers import AutoConfig

    file = config_file(path) or Path(path) / "config.json"
    raw = json.loads(file.read_text())
    if "model_type" not in raw:
        raise ValueError(f"{file}: no model_type, so transformers cannot tell which config class it is")
    return AutoConfig.for_model(**raw)


def stand_in_preset(model_type: str) -> str:
    """The tiny preset whose tokenizer (and chat template) stands in for a ``model_type``'s: its family's first
    preset of that model type."""
    from vlrl.models.families import family_of
    from vlrl.models.presets import PRESETS

    family = family_of(model_type)
    for name, spec in family.presets.items() if family is not None else ():
        if spec.family == model_type:
            return name
    families = sorted({spec.family for spec in PRESETS.values()})
    raise ValueError(f"model type {model_type!r}: no stand-in tokenizer (a config alone works for the families of the "
                     f"tiny presets: {', '.join(families)}); give a directory with the model's tokenizer files instead")


def stand_in_policy(path: str | Path, *, device: str | torch.device = "meta", dtype: torch.dtype = torch.float32,
                    seed: int = 0, overrides: dict[str, Any] | None = None,
                    vision_overrides: dict[str, Any] | None = None):
    """A `Policy` of the config at ``path`` with the stand-in tokenizer and image processor (module docstring):
    on the ``meta`` device (shapes only: `vlrl plan`) or with random weights (seeded) on ``device``.
    ``overrides`` / ``vision_overrides``: text- / vision-config fields to change first (e.g. ``num_hidden_layers``
    / ``depth`` for a shortened model)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from vlrl.models.policy import Policy
    from vlrl.models.presets import PRESETS, preset_tokenizer
    from vlrl.models.processor import build_processor

    config = load_config(path)
    text = config.get_text_config()
    for key, value in (overrides or {}).items():
        setattr(text, key, value)
    if overrides and "num_hidden_layers" in overrides and isinstance(getattr(text, "layer_types", None), list):
        text.layer_types = text.layer_types[: overrides["num_hidden_layers"]]  # one type per layer, or no reload
    for key, value in (vision_overrides or {}).items():
        setattr(config.vision_config, key, value)
    preset = stand_in_preset(config.model_type)
    tokenizer = preset_tokenizer(preset)
    ids = dict(tokenizer.get_vocab())
    ids["__vocab__"] = len(tokenizer)
    preset_config, image_processor, settings = PRESETS[preset].build(ids)  # the preset's processor and settings
    _repoint_special_ids(config, preset_config)
    is_vision = hasattr(config, "vision_config")
    if is_vision:
        _fit_image_processor(image_processor, config)
    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if is_vision else AutoModelForCausalLM
    with torch.device(device):
        model = auto.from_config(config, dtype=dtype)
    model.eval()
    model.generation_config.eos_token_id = text.eos_token_id
    model.generation_config.pad_token_id = text.pad_token_id
    processor = build_processor(config, tokenizer, image_processor, **settings) if is_vision else None
    return Policy.from_parts(model, tokenizer, image_processor, source=str(path), processor=processor)


def _repoint_special_ids(config: Any, preset_config: Any) -> None:
    """Point the config's special-token ids (``*_token_id``, ``*_token_index``; top level and text config) at the
    stand-in tokenizer's: the preset config's value of the same field, None where the preset has none."""
    preset_parts = (preset_config, preset_config.get_text_config())
    for part in {id(c): c for c in (config, config.get_text_config())}.values():
        for key, value in list(vars(part).items()):
            if value is None or not key.endswith(("_token_id", "_token_index")):
                continue
            setattr(part, key, next((getattr(p, key) for p in preset_parts if getattr(p, key, None) is not None), None))


def _fit_image_processor(image_processor: Any, config: Any) -> None:
    """Give the stand-in image processor the config's patch geometry and the real checkpoints' pixel bounds."""
    from vlrl.models.families import family_of
    from vlrl.models.policy import set_pixel_bounds

    vision = config.vision_config
    for attribute, field in (("patch_size", "patch_size"), ("merge_size", "spatial_merge_size"),
                             ("temporal_patch_size", "temporal_patch_size")):
        value = getattr(vision, field, None)
        if value is not None and hasattr(image_processor, attribute):
            setattr(image_processor, attribute, value)
    family = family_of(config.model_type)
    if family is not None and family.pixel_bounds is not None:
        set_pixel_bounds(image_processor, *family.pixel_bounds)
