"""Qwen2.5-VL (``qwen2_5_vl``): Qwen2-VL's markup, processor and M-RoPE; a windowed-attention vision tower.

| preset | parameters |
| --- | --- |
| ``tiny-qwen2.5-vl`` | 1.08M |
"""

from __future__ import annotations

from vlrl.models.families import TEXT_1M, Family, PresetSpec, rope, text_config
from vlrl.models.families.qwen2_vl import MARKUP, PARTS, grid_features, qwen_pixels, qwen_token_ids


def _build(ids):
    from transformers import Qwen2_5_VLConfig

    text = text_config(ids, TEXT_1M, "<|im_end|>", "<|endoftext|>", rope_parameters=rope(mrope_section=[4, 6, 6]))
    vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, window_size=56, fullatt_block_indexes=[1],
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=TEXT_1M["hidden_size"])
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **qwen_token_ids(ids)), qwen_pixels(14), {}


FAMILY = Family(
    model_types=("qwen2_5_vl",), order=20, vision_tower="visual", module_prefixes=PARTS, tower_features=grid_features,
    pixel_bounds=(3136, 12845056),  # as Qwen2-VL's: 56·56 … 28·28·1280 (14-px patches)
    presets={"tiny-qwen2.5-vl": PresetSpec("qwen2_5_vl", MARKUP, _build)},
)
