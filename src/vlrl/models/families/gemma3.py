"""Gemma 3 (``gemma3``): a SigLIP tower average-pooled to a fixed ``mm_tokens_per_image``; 1-D positions;
bidirectional attention within an image (its forward takes ``token_type_ids``, so padding-free rows hold one
sequence each, `vlrl.models.introspect.one_sequence_per_row`); tied embeddings. Markup: ``<bos>``, turns of user /
model with the system prompt folded into the first user turn; the placeholder ``<start_of_image>`` expands to
``"\\n\\n<start_of_image><image_soft_token>×N<end_of_image>\\n\\n"``.

Quirk: transformers initialises its image projection to zeros (no image signal, no gradient into the tower until
it moves); the preset draws it like every other weight (`draw_projection`), so the tiny model sees its images
from step 0.

| preset | parameters |
| --- | --- |
| ``tiny-gemma3`` | 0.17M |
"""

from __future__ import annotations

from typing import Any

import torch

from vlrl.models.families import TEXT_S, Family, PresetSpec, rope, text_config
from vlrl.models.markup import Markup, chat_content

MARKUP = Markup(
    ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
     "<image_soft_token>"),
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.system = message['content'] if message['content'] is string "
    "else message['content'][0]['text'] %}"
    "{% else %}<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if ns.system %}{{ ns.system }}\n\n{% set ns.system = '' %}{% endif %}"
    + chat_content("<start_of_image>") + "<end_of_turn>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}",
    "<end_of_turn>", "<pad>", bos="<bos>",
    named={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"},
)


def pooled_features(config: Any, vision, *, processor_merge_size: int | None = None) -> tuple[int, str] | None:
    """images (crops included) × mm_tokens_per_image."""
    if not getattr(config, "mm_tokens_per_image", None):
        return None
    return int(vision.pixel_values.shape[0]) * config.mm_tokens_per_image, f"mm_tokens_per_image {config.mm_tokens_per_image}"


def draw_projection(model: torch.nn.Module) -> None:
    """Draw the image projection (zeros in transformers' initialisation) like every other weight."""
    weight = model.model.multi_modal_projector.mm_input_projection_weight
    torch.nn.init.normal_(weight, std=model.config.initializer_range)


def _build(ids):
    from transformers import Gemma3Config, Gemma3ImageProcessorPil

    # SigLIP on 56px images of 14px patches (16 patches), average-pooled to mm_tokens_per_image = 4 tokens
    text = text_config(ids, TEXT_S, "<end_of_turn>", "<pad>", head_dim=16, query_pre_attn_scalar=16, sliding_window=64,
                       layer_types=["sliding_attention", "full_attention"],
                       rope_parameters={"sliding_attention": rope(), "full_attention": rope()})
    text["bos_token_id"] = ids["<bos>"]
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=56,
                  patch_size=14, vision_use_head=False)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
                          image_token_index=ids["<image_soft_token>"], tie_word_embeddings=True)
    pixels = Gemma3ImageProcessorPil(size={"height": 56, "width": 56}, do_pan_and_scan=False)
    return config, pixels, {"image_seq_length": 4}


FAMILY = Family(
    model_types=("gemma3",), order=70, vision_tower="vision_tower", tower_features=pooled_features,
    module_prefixes={"projector": ("model.multi_modal_projector.",), "vision": ("model.vision_tower.",),
                     "llm": ("model.language_model.", "lm_head.")},
    presets={"tiny-gemma3": PresetSpec("gemma3", MARKUP, _build, post_init=draw_projection)},
)
