"""LLaVA-OneVision (``llava_onevision``, a Qwen2 LLM): a SigLIP tower on anyres crops (a grid chosen from
``image_grid_pinpoints`` plus the whole image), unpadded to the image's aspect ratio with a newline token per row;
1-D positions; ChatML, with the placeholder ``<image>`` expanding to the anyres feature count.

| preset | parameters |
| --- | --- |
| ``tiny-llava-onevision`` | 0.23M |
"""

from __future__ import annotations

from typing import Any

from vlrl.models.families import TEXT_S, Family, PresetSpec, patches_per_side, rope, text_config
from vlrl.models.markup import Markup, chatml

MARKUP = Markup(
    ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>"),
    chatml("<image>\n", "<video>\n"), "<|im_end|>", "<|endoftext|>",
    named={"image_token": "<image>", "video_token": "<video>"},
)


def anyres_features(config: Any, vision, *, processor_merge_size: int | None = None) -> tuple[int, str] | None:
    """The model's own ``pack_image_features`` (anyres grid, unpadding, newline tokens) run on zero features of
    width 1 (`vlrl.compat.llava_onevision_packed_features`)."""
    side = patches_per_side(config.vision_config)
    if not getattr(config, "image_grid_pinpoints", None) or not side or "image_sizes" not in vision.tensors:
        return None
    import torch
    from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches

    from vlrl.compat import llava_onevision_packed_features

    sizes = vision.tensors["image_sizes"]
    counts = vision.tensors.get("batch_num_images")
    patching = [True] * len(sizes) if counts is None else [int(n) == 1 for n in counts for _ in range(int(n))]
    crops = [image_size_to_num_patches(image_size=s, grid_pinpoints=config.image_grid_pinpoints,
                                       patch_size=config.vision_config.image_size) if p else 1
             for s, p in zip(sizes, patching, strict=True)]
    per_crop = side**2 - (1 if getattr(config, "vision_feature_select_strategy", "full") == "default" else 0)
    features = [torch.zeros(n, per_crop, 1) for n in crops]
    packed = llava_onevision_packed_features(config, features, sizes)
    return sum(int(f.shape[0]) for f in packed), "anyres grid (image_grid_pinpoints)"


def _build(ids):
    from transformers import LlavaOnevisionConfig, LlavaOnevisionImageProcessorPil

    # SigLIP on 28px crops of 14px patches (2x2 patches per crop); anyres grid pinpoints up to 2x2 crops
    pinpoints = [[28, 28], [28, 56], [56, 28], [56, 56]]
    text = dict(text_config(ids, TEXT_S, "<|im_end|>", "<|endoftext|>", rope_parameters=rope()), model_type="qwen2")
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=28, patch_size=14, vision_use_head=False)
    config = LlavaOnevisionConfig(text_config=text, vision_config=vision, image_token_index=ids["<image>"],
                                  video_token_index=ids["<video>"], image_grid_pinpoints=pinpoints,
                                  vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_9",
                                  tie_word_embeddings=False)
    pixels = LlavaOnevisionImageProcessorPil(size={"height": 28, "width": 28}, image_grid_pinpoints=pinpoints)
    return config, pixels, {"num_image_tokens": 4, "vision_feature_select_strategy": "full",
                            "vision_aspect_ratio": "anyres_max_9"}


FAMILY = Family(
    model_types=("llava_onevision",), order=80, vision_tower="vision_tower", tower_features=anyres_features,
    module_prefixes={"projector": ("model.multi_modal_projector.",), "vision": ("model.vision_tower.",),
                     "llm": ("model.language_model.", "lm_head.")},
    presets={"tiny-llava-onevision": PresetSpec("llava_onevision", MARKUP, _build)},
)
