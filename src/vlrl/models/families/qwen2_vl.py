"""Qwen2-VL (``qwen2_vl``): M-RoPE positions, 14-px patches merged 2 × 2 into one vision token.

Its tokens and ChatML template are the Qwen markup the other Qwen families reuse (`MARKUP`), as are its image
processor (`qwen_pixels`), its vision token ids (`qwen_token_ids`) and its feature count (`grid_features`).

| preset | parameters |
| --- | --- |
| ``tiny-qwen2-vl`` | 1.06M |
| ``tiny-qwen2-vl-20m`` | 16.2M |
"""

from __future__ import annotations

from typing import Any

from vlrl.models.families import IMAGE_SIDE, TEXT_1M, TEXT_20M, Family, PresetSpec, rope, text_config
from vlrl.models.markup import Markup, chatml

# Qwen2/Qwen2-VL special tokens (same spelling, so code written for real Qwen models works unchanged).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                  "<|video_pad|>")
IMAGE_MARKUP = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_MARKUP = "<|vision_start|><|video_pad|><|vision_end|>"
# Qwen2-VL, Qwen2.5-VL, Qwen3-VL (+MoE) and Qwen2: the same tokens; the image placeholder is <|image_pad|>.
MARKUP = Markup(SPECIAL_TOKENS, chatml(IMAGE_MARKUP, VIDEO_MARKUP), "<|im_end|>", "<|endoftext|>", legacy_layout=True)

# Where the Qwen-style families keep their parts.
PARTS = {"projector": ("model.visual.merger.",), "vision": ("model.visual.",), "llm": ("model.language_model.", "lm_head.")}


def qwen_pixels(patch: int) -> Any:
    """Qwen's PIL image processor for ``patch``-px patches merged 2 × 2, bounded so a 112-px image stays whole."""
    from transformers import Qwen2VLImageProcessorPil

    side = 2 * patch  # one merged token = 2x2 patches
    return Qwen2VLImageProcessorPil(min_pixels=2 * side * 2 * side, max_pixels=(IMAGE_SIDE // side * side) ** 2,
                                    patch_size=patch, merge_size=2, temporal_patch_size=2)


def qwen_token_ids(ids: dict[str, int]) -> dict:
    """The config's vision token ids in the tokenizer (and untied embeddings)."""
    return dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                tie_word_embeddings=False)


def grid_features(config: Any, vision, *, processor_merge_size: int | None = None) -> tuple[int, str] | None:
    """M-RoPE families (Qwen2-VL ... Qwen3.5, GLM-4.xV): Σ prod(grid_thw) / spatial_merge_size²."""
    merge = getattr(config.vision_config, "spatial_merge_size", None)
    grids = vision.image_grid_thw
    if grids is None or not merge:
        return None
    return (sum(int(g.prod()) // merge**2 for g in grids),
            f"image processor merge_size {processor_merge_size if processor_merge_size is not None else '?'}, "
            f"model vision_config.spatial_merge_size {merge}")


def _preset(sizes: dict, vision: dict, mrope: tuple[int, int, int]):
    def build(ids):
        from transformers import Qwen2VLConfig

        text = text_config(ids, sizes, "<|im_end|>", "<|endoftext|>", rope_parameters=rope(mrope_section=list(mrope)))
        vision_config = dict(vision, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                             hidden_size=sizes["hidden_size"])  # Qwen2-VL: the merger's output width
        return Qwen2VLConfig(text_config=text, vision_config=vision_config, **qwen_token_ids(ids)), qwen_pixels(14), {}
    return build


FAMILY = Family(
    model_types=("qwen2_vl",), order=10, vision_tower="visual", module_prefixes=PARTS, tower_features=grid_features,
    pixel_bounds=(3136, 12845056),  # the real checkpoints' preprocessor_config.json: 56·56 … 28·28·1280
    presets={
        "tiny-qwen2-vl": PresetSpec("qwen2_vl", MARKUP, _preset(TEXT_1M, dict(depth=2, embed_dim=64, num_heads=2,
                                                                              mlp_ratio=2), (4, 6, 6))),
        "tiny-qwen2-vl-20m": PresetSpec("qwen2_vl", MARKUP, _preset(TEXT_20M, dict(depth=4, embed_dim=192, num_heads=3,
                                                                                  mlp_ratio=4), (8, 12, 12))),
    },
)
