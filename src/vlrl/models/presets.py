"""Tiny offline presets: real transformers architectures built from their config classes, no download.

Each preset is a real family at toy size with random weights, a BPE tokenizer trained locally on the task
vocabulary carrying the family's vision markup and a chat template in its style (`vlrl.models.tokenizer.MARKUPS`),
the family's own PIL image processor (no torchvision) and its own transformers processor class. `save_pretrained`
output loads back through plain transformers (`AutoModelForImageTextToText` / `AutoModelForCausalLM`), and a saved
directory loads back into vlrl through exactly the code a real checkpoint of the family goes through.

| preset | family (model_type) | parameters |
| --- | --- | --- |
| ``tiny-qwen2-vl`` | Qwen2-VL (``qwen2_vl``) | 1.06M |
| ``tiny-qwen2-vl-20m`` | Qwen2-VL (``qwen2_vl``) | 16.2M |
| ``tiny-qwen2.5-vl`` | Qwen2.5-VL (``qwen2_5_vl``) | 1.08M |
| ``tiny-qwen3-vl`` | Qwen3-VL (``qwen3_vl``), DeepStack | 0.33M |
| ``tiny-qwen3-vl-moe`` | Qwen3-VL-MoE (``qwen3_vl_moe``) | 0.33M |
| ``tiny-qwen3.5`` | Qwen3.5 (``qwen3_5``), Gated DeltaNet + full attention | 0.31M |
| ``tiny-qwen3.5-moe`` | Qwen3.5-MoE (``qwen3_5_moe``) | 0.32M |
| ``tiny-glm4v`` | GLM-4.1V / 4.5V / 4.6V (``glm4v``) | 0.27M |
| ``tiny-internvl`` | InternVL 3 / 3.5 (``internvl``), tiles | 0.24M |
| ``tiny-gemma3`` | Gemma 3 (``gemma3``) | 0.17M |
| ``tiny-llava-onevision`` | LLaVA-OneVision (``llava_onevision``), anyres | 0.23M |
| ``tiny-smolvlm`` | SmolVLM / Idefics3 (``smolvlm``), tiles | 0.24M |
| ``tiny-qwen2`` | Qwen2 (text only) | 0.82M |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

# Text / vision sizes of each preset. head_dim = hidden / heads; M-RoPE sections must sum to head_dim / 2.
_TEXT_1M = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
_TEXT_20M = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=2)
# The new families' presets are smaller still (they exist to exercise every path, fast): 2 layers of width 64.
_TEXT_S = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)

IMAGE_SIDE = 112  # the shapes images; 112x112 with 14px patches and 2x2 merge = 16 vision tokens


@dataclass(frozen=True)
class PresetSpec:
    """One tiny preset.

    Attributes:
        family: the transformers ``model_type``.
        markup: the tokenizer markup (`vlrl.models.tokenizer.MARKUPS`).
        build: ``build(ids) -> (config, image_processor, processor_settings)``; ``ids`` maps token strings to ids.
        vocab_size: BPE vocabulary size before the added tokens.
    """

    family: str
    markup: str
    build: Callable[[dict[str, int]], tuple[Any, Any, dict[str, Any]]]
    vocab_size: int = 1024
    post_init: Callable[[torch.nn.Module], None] | None = None


def _draw_projection(model: torch.nn.Module) -> None:
    """Gemma 3 initialises its image projection to zeros (no image signal, no gradient into the tower until it
    moves); a random preset draws it like every other weight, so the tiny model sees its images from step 0."""
    weight = model.model.multi_modal_projector.mm_input_projection_weight
    torch.nn.init.normal_(weight, std=model.config.initializer_range)


def _rope(**extra) -> dict:
    return {"rope_type": "default", "rope_theta": 10000.0, **extra}


def _text(ids: dict[str, int], sizes: dict, eos: str, pad: str, **extra) -> dict:
    return dict(sizes, vocab_size=ids["__vocab__"], max_position_embeddings=2048, rms_norm_eps=1e-6,
                bos_token_id=None, eos_token_id=ids[eos], pad_token_id=ids[pad], **extra)


def _qwen_pixels(patch: int) -> Any:
    from transformers import Qwen2VLImageProcessorPil

    side = 2 * patch  # one merged token = 2x2 patches
    return Qwen2VLImageProcessorPil(min_pixels=2 * side * 2 * side, max_pixels=(IMAGE_SIDE // side * side) ** 2,
                                    patch_size=patch, merge_size=2, temporal_patch_size=2)


def _qwen_ids(ids: dict[str, int]) -> dict:
    return dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                tie_word_embeddings=False)


def _qwen2_vl(sizes: dict, vision: dict, mrope: tuple[int, int, int]):
    def build(ids):
        from transformers import Qwen2VLConfig

        text = _text(ids, sizes, "<|im_end|>", "<|endoftext|>", rope_parameters=_rope(mrope_section=list(mrope)))
        vision_config = dict(vision, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                             hidden_size=sizes["hidden_size"])  # Qwen2-VL: the merger's output width
        return Qwen2VLConfig(text_config=text, vision_config=vision_config, **_qwen_ids(ids)), _qwen_pixels(14), {}
    return build


def _qwen2_5_vl(ids):
    from transformers import Qwen2_5_VLConfig

    text = _text(ids, _TEXT_1M, "<|im_end|>", "<|endoftext|>", rope_parameters=_rope(mrope_section=[4, 6, 6]))
    vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, window_size=56, fullatt_block_indexes=[1],
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=_TEXT_1M["hidden_size"])
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **_qwen_ids(ids)), _qwen_pixels(14), {}


# Qwen3-VL / Qwen3.5 vision tower: 16px patches, learned position embeddings on an 8x8 grid (interpolated).
_QWEN3_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
                     temporal_patch_size=2, out_hidden_size=_TEXT_S["hidden_size"], num_position_embeddings=64)


def _qwen3_vl(moe: bool):
    def build(ids):
        from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

        # head_dim 16: M-RoPE sections sum to 8, interleaved (t, h, w) as in the real checkpoints
        text = _text(ids, _TEXT_S, "<|im_end|>", "<|endoftext|>", head_dim=16,
                     rope_parameters=_rope(mrope_section=[2, 3, 3], mrope_interleaved=True))
        if moe:
            text.update(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1)
        vision = dict(_QWEN3_VISION, deepstack_visual_indexes=[0, 1])  # DeepStack: features of both blocks
        config_cls = Qwen3VLMoeConfig if moe else Qwen3VLConfig
        return config_cls(text_config=text, vision_config=vision, **_qwen_ids(ids)), _qwen_pixels(16), {}
    return build


def _qwen3_5(moe: bool):
    def build(ids):
        from transformers import Qwen3_5Config, Qwen3_5MoeConfig

        # layers: linear attention (Gated DeltaNet), then full attention (the real 3:1 pattern, shortened);
        # full attention rotates 1/4 of head_dim 32 = 8 dims: M-RoPE sections sum to 4.
        text = _text(ids, _TEXT_S, "<|im_end|>", "<|endoftext|>", head_dim=32,
                     layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
                     linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                     rope_parameters=_rope(mrope_section=[2, 1, 1], mrope_interleaved=True, partial_rotary_factor=0.25))
        if moe:
            text.pop("intermediate_size")
            text.update(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
        config_cls = Qwen3_5MoeConfig if moe else Qwen3_5Config
        return config_cls(text_config=text, vision_config=dict(_QWEN3_VISION), **_qwen_ids(ids)), _qwen_pixels(16), {}
    return build


def _glm4v(ids):
    from transformers import Glm4vConfig, Glm4vImageProcessorPil

    # GLM-4.1V: half of head_dim 16 is rotated (partial_rotary_factor 0.5): M-RoPE sections sum to 4
    text = _text(ids, _TEXT_S, "<|user|>", "<|endoftext|>",
                 rope_parameters=_rope(mrope_section=[2, 1, 1], partial_rotary_factor=0.5))
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, image_size=56, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=_TEXT_S["hidden_size"])
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


def _internvl(ids):
    from transformers import GotOcr2ImageProcessorPil, InternVLConfig

    # 56px tiles of 14px patches: 16 patches, pixel-shuffled by 0.5 → 4 tokens per tile; a 112px image is cut
    # into 2x2 tiles + a thumbnail = 20 tokens
    text = dict(_text(ids, _TEXT_S, "<|im_end|>", "<|endoftext|>", rope_parameters=_rope()), model_type="qwen2")
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=56,
                  patch_size=14, use_mean_pooling=False)
    config = InternVLConfig(text_config=text, vision_config=vision, image_token_id=ids["<IMG_CONTEXT>"],
                            image_seq_length=4, downsample_ratio=0.5, tie_word_embeddings=False)
    pixels = GotOcr2ImageProcessorPil(size={"height": 56, "width": 56}, crop_to_patches=True, min_patches=1,
                                      max_patches=4)
    return config, pixels, {"image_seq_length": 4}


def _gemma3(ids):
    from transformers import Gemma3Config, Gemma3ImageProcessorPil

    # SigLIP on 56px images of 14px patches (16 patches), average-pooled to mm_tokens_per_image = 4 tokens
    text = _text(ids, _TEXT_S, "<end_of_turn>", "<pad>", head_dim=16, query_pre_attn_scalar=16, sliding_window=64,
                 layer_types=["sliding_attention", "full_attention"],
                 rope_parameters={"sliding_attention": _rope(), "full_attention": _rope()})
    text["bos_token_id"] = ids["<bos>"]
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=56,
                  patch_size=14, vision_use_head=False)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
                          image_token_index=ids["<image_soft_token>"], tie_word_embeddings=True)
    pixels = Gemma3ImageProcessorPil(size={"height": 56, "width": 56}, do_pan_and_scan=False)
    return config, pixels, {"image_seq_length": 4}


def _llava_onevision(ids):
    from transformers import LlavaOnevisionConfig, LlavaOnevisionImageProcessorPil

    # SigLIP on 28px crops of 14px patches (2x2 patches per crop); anyres grid pinpoints up to 2x2 crops
    pinpoints = [[28, 28], [28, 56], [56, 28], [56, 56]]
    text = dict(_text(ids, _TEXT_S, "<|im_end|>", "<|endoftext|>", rope_parameters=_rope()), model_type="qwen2")
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=28, patch_size=14, vision_use_head=False)
    config = LlavaOnevisionConfig(text_config=text, vision_config=vision, image_token_index=ids["<image>"],
                                  video_token_index=ids["<video>"], image_grid_pinpoints=pinpoints,
                                  vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_9",
                                  tie_word_embeddings=False)
    pixels = LlavaOnevisionImageProcessorPil(size={"height": 28, "width": 28}, image_grid_pinpoints=pinpoints)
    return config, pixels, {"num_image_tokens": 4, "vision_feature_select_strategy": "full",
                            "vision_aspect_ratio": "anyres_max_9"}


def _smolvlm(ids):
    from transformers import SmolVLMConfig, SmolVLMImageProcessorPil

    # 32px tiles of 16px patches (4 patches), pixel-shuffled by scale factor 2 → 1 token per tile; a 112px image
    # is resized to 64px, cut into 2x2 tiles + a global image
    text = dict(_text(ids, _TEXT_S, "<end_of_utterance>", "<|endoftext|>", rope_parameters=_rope()), model_type="llama")
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                  patch_size=16)
    config = SmolVLMConfig(text_config=text, vision_config=vision, image_token_id=ids["<image>"], scale_factor=2,
                           tie_word_embeddings=False)
    pixels = SmolVLMImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32},
                                      do_image_splitting=True)
    return config, pixels, {"image_seq_len": 1}


def _qwen2(ids):
    from transformers import Qwen2Config

    text = _text(ids, _TEXT_1M, "<|im_end|>", "<|endoftext|>", rope_parameters=_rope())
    return Qwen2Config(**text, tie_word_embeddings=False), None, {}


PRESETS: dict[str, PresetSpec] = {
    "tiny-qwen2-vl": PresetSpec("qwen2_vl", "qwen", _qwen2_vl(_TEXT_1M, dict(depth=2, embed_dim=64, num_heads=2, mlp_ratio=2),
                                                              (4, 6, 6))),
    "tiny-qwen2-vl-20m": PresetSpec("qwen2_vl", "qwen", _qwen2_vl(_TEXT_20M, dict(depth=4, embed_dim=192, num_heads=3,
                                                                                  mlp_ratio=4), (8, 12, 12))),
    "tiny-qwen2.5-vl": PresetSpec("qwen2_5_vl", "qwen", _qwen2_5_vl),
    "tiny-qwen3-vl": PresetSpec("qwen3_vl", "qwen", _qwen3_vl(moe=False)),
    "tiny-qwen3-vl-moe": PresetSpec("qwen3_vl_moe", "qwen", _qwen3_vl(moe=True)),
    "tiny-qwen3.5": PresetSpec("qwen3_5", "qwen3_5", _qwen3_5(moe=False)),
    "tiny-qwen3.5-moe": PresetSpec("qwen3_5_moe", "qwen3_5", _qwen3_5(moe=True)),
    "tiny-glm4v": PresetSpec("glm4v", "glm4v", _glm4v),
    "tiny-internvl": PresetSpec("internvl", "internvl", _internvl),
    "tiny-gemma3": PresetSpec("gemma3", "gemma3", _gemma3, post_init=_draw_projection),
    "tiny-llava-onevision": PresetSpec("llava_onevision", "llava_onevision", _llava_onevision),
    "tiny-smolvlm": PresetSpec("smolvlm", "smolvlm", _smolvlm),
    "tiny-qwen2": PresetSpec("qwen2", "qwen", _qwen2),
}
# Vision-language presets of the families added after Qwen2-VL / Qwen2.5-VL (one per family, smallest size).
FAMILY_PRESETS = ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-qwen3-vl-moe", "tiny-qwen3.5",
                  "tiny-qwen3.5-moe", "tiny-glm4v", "tiny-internvl", "tiny-gemma3", "tiny-llava-onevision",
                  "tiny-smolvlm"]


def tokenizer_corpus() -> list[str]:
    """Text the preset tokenizers are trained on: every task suite's prompts and responses, all templates."""
    from vlrl.data.tasks import TEMPLATES, embodied, generate
    from vlrl.data.tasks.shapes import TASKS as SHAPE_TASKS

    corpus = ["system", "user", "assistant", "You are a helpful assistant."]
    for template in TEMPLATES:
        for suite, tasks in (("shapes", SHAPE_TASKS), ("arith", None)):
            kwargs = {"image_size": 32} if suite == "shapes" else {}  # only the text matters here: small images
            for sample in generate(suite, 400, split="tokenizer", tasks=tasks, template=template, **kwargs):
                corpus.append(sample.prompt_text().replace("<image>", ""))
                corpus.append(sample.response or "")
    corpus += [f"[{a}, {b}, {a + 20}, {b + 20}]" for a in range(0, 112, 3) for b in range(0, 112, 7)]
    corpus += embodied.text_corpus(300)  # JSON action plans
    return corpus


@lru_cache(maxsize=8)
def _trained_tokenizer(markup: str, vocab_size: int):
    from vlrl.models.tokenizer import train_tokenizer

    return train_tokenizer(tokenizer_corpus(), vocab_size=vocab_size, markup=markup)


def preset_tokenizer(name: str):
    """A fresh copy of preset ``name``'s tokenizer (trained once per process and markup, then copied)."""
    import copy

    spec = PRESETS[name]
    return copy.deepcopy(_trained_tokenizer(spec.markup, spec.vocab_size))


def build_preset(name: str, *, seed: int = 0):
    """Build preset ``name`` with random weights (deterministic for ``seed``); returns a `Policy`."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from vlrl.models.policy import Policy

    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; presets: {sorted(PRESETS)}")
    spec = PRESETS[name]
    tokenizer = preset_tokenizer(name)
    ids = dict(tokenizer.get_vocab())
    ids["__vocab__"] = len(tokenizer)
    config, image_processor, settings = spec.build(ids)
    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if image_processor is not None else AutoModelForCausalLM
    model = auto.from_config(config)
    if spec.post_init is not None:
        with torch.no_grad():
            spec.post_init(model)
    text = config.get_text_config()
    model.generation_config.eos_token_id = text.eos_token_id
    model.generation_config.pad_token_id = text.pad_token_id
    if image_processor is None:
        return Policy.from_parts(model, tokenizer, None, source=f"preset:{name}")
    from vlrl.models.processor import build_processor

    processor = build_processor(config, tokenizer, image_processor, **settings)
    return Policy.from_parts(model, tokenizer, image_processor, source=f"preset:{name}", processor=processor)
