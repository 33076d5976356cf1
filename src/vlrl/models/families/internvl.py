"""InternVL 3 / 3.5 (``internvl``, transformers' -HF layout): 1-D positions; an image is cut into tiles plus a
thumbnail, each tile's patches pixel-shuffled (``downsample_ratio``) into a fixed run of tokens; ChatML, with the
placeholder ``<IMG_CONTEXT>`` expanding to ``<img><IMG_CONTEXT>×N</img>``.

| preset | parameters |
| --- | --- |
| ``tiny-internvl`` | 0.24M |
"""

from __future__ import annotations

from typing import Any

from vlrl.models.families import TEXT_S, Family, PresetSpec, patches_per_side, rope, text_config
from vlrl.models.markup import Markup, chatml

MARKUP = Markup(
    ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "<video>"),
    chatml("<IMG_CONTEXT>\n", "<video>\n"), "<|im_end|>", "<|endoftext|>",
    named={"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
           "video_token": "<video>"},
)


def tile_features(config: Any, vision, *, processor_merge_size: int | None = None) -> tuple[int, str] | None:
    """tiles × (image_size / patch_size)² × downsample_ratio²."""
    side = patches_per_side(config.vision_config)
    if not getattr(config, "downsample_ratio", None) or not side:
        return None
    per_tile = int(side**2 * config.downsample_ratio**2)
    return int(vision.pixel_values.shape[0]) * per_tile, f"{per_tile} tokens per tile (downsample_ratio {config.downsample_ratio})"


def _build(ids):
    from transformers import GotOcr2ImageProcessorPil, InternVLConfig

    # 56px tiles of 14px patches: 16 patches, pixel-shuffled by 0.5 → 4 tokens per tile; a 112px image is cut
    # into 2x2 tiles + a thumbnail = 20 tokens
    text = dict(text_config(ids, TEXT_S, "<|im_end|>", "<|endoftext|>", rope_parameters=rope()), model_type="qwen2")
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=56,
                  patch_size=14, use_mean_pooling=False)
    config = InternVLConfig(text_config=text, vision_config=vision, image_token_id=ids["<IMG_CONTEXT>"],
                            image_seq_length=4, downsample_ratio=0.5, tie_word_embeddings=False)
    pixels = GotOcr2ImageProcessorPil(size={"height": 56, "width": 56}, crop_to_patches=True, min_patches=1,
                                      max_patches=4)
    return config, pixels, {"image_seq_length": 4}


FAMILY = Family(
    model_types=("internvl",), order=60, vision_tower="vision_tower", tower_features=tile_features,
    # model.mlp1.: the projector's name in InternVL's own (remote) modelling code
    module_prefixes={"projector": ("model.multi_modal_projector.", "model.mlp1."), "vision": ("model.vision_tower.",),
                     "llm": ("model.language_model.", "lm_head.")},
    presets={"tiny-internvl": PresetSpec("internvl", MARKUP, _build)},
)
