"""SmolVLM / Idefics3 (``smolvlm``): an image resized and cut into tiles plus a global image, each tile's patches
pixel-shuffled (``scale_factor``) into a fixed run of tokens; 1-D positions. Markup:
``User:<image>...<end_of_utterance>\\nAssistant:``; ``<image>`` expands to a grid of tiles
(``<fake_token_around_image><row_r_col_c><image>×N ... <global-img><image>×N<fake_token_around_image>``).

| preset | parameters |
| --- | --- |
| ``tiny-smolvlm`` | 0.24M |
"""

from __future__ import annotations

from typing import Any

from vlrl.models.families import TEXT_S, Family, PresetSpec, patches_per_side, rope, text_config
from vlrl.models.markup import Markup, chat_content

MARKUP = Markup(
    ("<|endoftext|>", "<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>",
     "<global-img>", "<video>", *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))),
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is not string and message['content'][0]['type'] == 'image' %}:{% else %}: {% endif %}"
    + chat_content("<image>") + "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}",
    "<end_of_utterance>", "<|endoftext|>",
    named={"image_token": "<image>", "fake_image_token": "<fake_token_around_image>",
           "global_image_token": "<global-img>", "end_of_utterance_token": "<end_of_utterance>",
           "video_token": "<video>"},
)


def tile_features(config: Any, vision, *, processor_merge_size: int | None = None) -> tuple[int, str] | None:
    """non-empty tiles × (image_size / patch_size)² / scale_factor²."""
    side = patches_per_side(config.vision_config)
    if not getattr(config, "scale_factor", None) or not side:
        return None
    pixels = vision.pixel_values
    tiles = pixels.reshape(-1, *pixels.shape[-3:])
    real = int(((tiles == 0).flatten(1).sum(-1) != tiles[0].numel()).sum())
    per_tile = side**2 // config.scale_factor**2
    return real * per_tile, f"{per_tile} tokens per tile (scale_factor {config.scale_factor})"


def _build(ids):
    from transformers import SmolVLMConfig, SmolVLMImageProcessorPil

    # 32px tiles of 16px patches (4 patches), pixel-shuffled by scale factor 2 → 1 token per tile; a 112px image
    # is resized to 64px, cut into 2x2 tiles + a global image
    text = dict(text_config(ids, TEXT_S, "<end_of_utterance>", "<|endoftext|>", rope_parameters=rope()), model_type="llama")
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                  patch_size=16)
    config = SmolVLMConfig(text_config=text, vision_config=vision, image_token_id=ids["<image>"], scale_factor=2,
                           tie_word_embeddings=False)
    pixels = SmolVLMImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32},
                                      do_image_splitting=True)
    return config, pixels, {"image_seq_len": 1}


FAMILY = Family(
    model_types=("smolvlm",), order=90, vision_tower="vision_model", tower_features=tile_features,
    module_prefixes={"projector": ("model.connector.",), "vision": ("model.vision_model.",),
                     "llm": ("model.text_model.", "lm_head.")},
    presets={"tiny-smolvlm": PresetSpec("smolvlm", MARKUP, _build)},
)
