"""GLM-4.1V / 4.5V / 4.6V (``glm4v``): M-RoPE (half of head_dim rotated), Qwen-style 14-px patches merged 2 × 2;
its own markup: ``[gMASK]<sop>``, role tokens and no end-of-turn token (a turn ends where the next ``<|user|>``
begins, so ``<|user|>`` is the end-of-turn marker generation stops at); the image placeholder is ``<|image|>``.

| preset | parameters |
| --- | --- |
| ``tiny-glm4v`` | 0.27M |
"""

from __future__ import annotations

from vlrl.models.families import IMAGE_SIDE, TEXT_S, Family, PresetSpec, rope, text_config
from vlrl.models.families.qwen2_vl import PARTS, grid_features
from vlrl.models.markup import Markup, chat_content

MARKUP = Markup(
    ("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
     "<|begin_of_image|>", "<|end_of_image|>", "<|image|>", "<|begin_of_video|>", "<|end_of_video|>", "<|video|>"),
    "[gMASK]<sop>{% for message in messages %}<|{{ message['role'] }}|>\n"
    + chat_content("<|begin_of_image|><|image|><|end_of_image|>", "<|begin_of_video|><|video|><|end_of_video|>")
    + "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}",
    "<|user|>", "<|endoftext|>",
    named={"image_token": "<|image|>", "video_token": "<|video|>"},
)


def _build(ids):
    from transformers import Glm4vConfig, Glm4vImageProcessorPil

    # GLM-4.1V: half of head_dim 16 is rotated (partial_rotary_factor 0.5): M-RoPE sections sum to 4
    text = text_config(ids, TEXT_S, "<|user|>", "<|endoftext|>",
                       rope_parameters=rope(mrope_section=[2, 1, 1], partial_rotary_factor=0.5))
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, image_size=56, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=TEXT_S["hidden_size"])
    config = Glm4vConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|image|>"], video_token_id=ids["<|video|>"],
        image_start_token_id=ids["<|begin_of_image|>"], image_end_token_id=ids["<|end_of_image|>"],
        video_start_token_id=ids["<|begin_of_video|>"], video_end_token_id=ids["<|end_of_video|>"],
        tie_word_embeddings=False,
    )
    # GLM-4V bounds count the temporal patch too (2 frames per image): 2·112² keeps a 112px image at 8x8 patches
    pixels = Glm4vImageProcessorPil(size={"shortest_edge": 2 * 56 * 56, "longest_edge": 2 * IMAGE_SIDE * IMAGE_SIDE},
                                    patch_size=14, merge_size=2, temporal_patch_size=2)
    return config, pixels, {}


FAMILY = Family(
    model_types=("glm4v",), order=50, vision_tower="visual", module_prefixes=PARTS, tower_features=grid_features,
    presets={"tiny-glm4v": PresetSpec("glm4v", MARKUP, _build)},
)
