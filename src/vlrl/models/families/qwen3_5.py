"""Qwen3.5 (``qwen3_5``) and Qwen3.5-MoE (``qwen3_5_moe``): Qwen3-VL's vision tower; a decoder of Gated DeltaNet
(linear attention, a recurrent state) and full-attention layers — so padding-free rows hold one sequence each
(`vlrl.models.introspect.one_sequence_per_row`); Qwen's tokens with a Qwen3-style template (thinking control).

| preset | parameters |
| --- | --- |
| ``tiny-qwen3.5`` | 0.31M |
| ``tiny-qwen3.5-moe`` | 0.32M |
"""

from __future__ import annotations

from vlrl.models.families import TEXT_S, Family, PresetSpec, rope, text_config
from vlrl.models.families.qwen2_vl import (
    IMAGE_MARKUP,
    PARTS,
    SPECIAL_TOKENS,
    VIDEO_MARKUP,
    grid_features,
    qwen_pixels,
    qwen_token_ids,
)
from vlrl.models.families.qwen3_vl import VISION
from vlrl.models.markup import Markup, chatml

# Qwen's tokens, a Qwen3-style template: enable_thinking=False closes an empty think block.
MARKUP = Markup(SPECIAL_TOKENS, chatml(IMAGE_MARKUP, VIDEO_MARKUP, thinking=True), "<|im_end|>", "<|endoftext|>")


def _preset(moe: bool):
    def build(ids):
        from transformers import Qwen3_5Config, Qwen3_5MoeConfig

        # layers: linear attention (Gated DeltaNet), then full attention (the real 3:1 pattern, shortened);
        # full attention rotates 1/4 of head_dim 32 = 8 dims: M-RoPE sections sum to 4.
        text = text_config(ids, TEXT_S, "<|im_end|>", "<|endoftext|>", head_dim=32,
                           layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
                           linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                           linear_num_value_heads=4,
                           rope_parameters=rope(mrope_section=[2, 1, 1], mrope_interleaved=True,
                                                partial_rotary_factor=0.25))
        if moe:
            text.pop("intermediate_size")
            text.update(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
        config_cls = Qwen3_5MoeConfig if moe else Qwen3_5Config
        return config_cls(text_config=text, vision_config=dict(VISION), **qwen_token_ids(ids)), qwen_pixels(16), {}
    return build


FAMILY = Family(
    model_types=("qwen3_5", "qwen3_5_moe"), order=40, vision_tower="visual", module_prefixes=PARTS,
    tower_features=grid_features, pixel_bounds=(65536, 16777216),  # as Qwen3-VL's
    presets={
        "tiny-qwen3.5": PresetSpec("qwen3_5", MARKUP, _preset(moe=False)),
        "tiny-qwen3.5-moe": PresetSpec("qwen3_5_moe", MARKUP, _preset(moe=True)),
    },
)
