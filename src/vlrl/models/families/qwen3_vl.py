"""Qwen3-VL (``qwen3_vl``) and Qwen3-VL-MoE (``qwen3_vl_moe``): Qwen's markup, 16-px patches, interleaved M-RoPE
and DeepStack (features of several vision blocks added to the first decoder layers: the shared-image path must
hand them over too, which the adapter's sharing check verifies).

| preset | parameters |
| --- | --- |
| ``tiny-qwen3-vl`` | 0.33M |
| ``tiny-qwen3-vl-moe`` | 0.33M |
"""

from __future__ import annotations

from vlrl.models.families import TEXT_S, Family, PresetSpec, rope, text_config
from vlrl.models.families.qwen2_vl import MARKUP, PARTS, grid_features, qwen_pixels, qwen_token_ids

# Qwen3-VL / Qwen3.5 vision tower: 16px patches, learned position embeddings on an 8x8 grid (interpolated).
VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
              temporal_patch_size=2, out_hidden_size=TEXT_S["hidden_size"], num_position_embeddings=64)


def _preset(moe: bool):
    def build(ids):
        from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

        # head_dim 16: M-RoPE sections sum to 8, interleaved (t, h, w) as in the real checkpoints
        text = text_config(ids, TEXT_S, "<|im_end|>", "<|endoftext|>", head_dim=16,
                           rope_parameters=rope(mrope_section=[2, 3, 3], mrope_interleaved=True))
        if moe:
            text.update(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1)
        vision = dict(VISION, deepstack_visual_indexes=[0, 1])  # DeepStack: features of both blocks
        config_cls = Qwen3VLMoeConfig if moe else Qwen3VLConfig
        return config_cls(text_config=text, vision_config=vision, **qwen_token_ids(ids)), qwen_pixels(16), {}
    return build


FAMILY = Family(
    model_types=("qwen3_vl", "qwen3_vl_moe"), order=30, vision_tower="visual", tower_features=grid_features,
    module_prefixes={**PARTS, "projector": ("model.visual.merger.", "model.visual.deepstack_merger_list.")},
    pixel_bounds=(65536, 16777216),  # the real checkpoints' preprocessor_config.json (16-px patches)
    presets={
        "tiny-qwen3-vl": PresetSpec("qwen3_vl", MARKUP, _preset(moe=False)),
        "tiny-qwen3-vl-moe": PresetSpec("qwen3_vl_moe", MARKUP, _preset(moe=True)),
    },
)
