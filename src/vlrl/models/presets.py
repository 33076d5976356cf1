"""Tiny offline presets: real transformers architectures built from a config, no download.

Each preset is a real family (Qwen2-VL, Qwen2.5-VL, Qwen2) at toy size with random weights, a BPE
tokenizer trained locally on the task vocabulary and a real image processor. `save_pretrained` output
loads back through plain transformers (`AutoModelForImageTextToText` / `AutoModelForCausalLM`).

| preset | family | parameters |
| --- | --- | --- |
| ``tiny-qwen2-vl`` | Qwen2-VL | ~1.1M |
| ``tiny-qwen2-vl-20m`` | Qwen2-VL | ~17M |
| ``tiny-qwen2.5-vl`` | Qwen2.5-VL | ~1.2M |
| ``tiny-qwen2`` | Qwen2 (text only) | ~1.0M |
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Text / vision sizes of each preset. head_dim = hidden / heads; M-RoPE sections must sum to head_dim / 2.
_TEXT_1M = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
_TEXT_20M = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=2)


@dataclass(frozen=True)
class PresetSpec:
    family: str  # "qwen2_vl" | "qwen2_5_vl" | "qwen2"
    text: dict
    vision: dict | None
    mrope_section: tuple[int, int, int] | None
    vocab_size: int = 1024


PRESETS: dict[str, PresetSpec] = {
    "tiny-qwen2-vl": PresetSpec(
        "qwen2_vl", _TEXT_1M, dict(depth=2, embed_dim=64, num_heads=2, mlp_ratio=2), (4, 6, 6)
    ),
    "tiny-qwen2-vl-20m": PresetSpec(
        "qwen2_vl", _TEXT_20M, dict(depth=4, embed_dim=192, num_heads=3, mlp_ratio=4), (8, 12, 12)
    ),
    "tiny-qwen2.5-vl": PresetSpec(
        "qwen2_5_vl", _TEXT_1M,
        dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, window_size=56, fullatt_block_indexes=[1]),
        (4, 6, 6),
    ),
    "tiny-qwen2": PresetSpec("qwen2", _TEXT_1M, None, None),
}

IMAGE_SIDE = 112  # the shapes images; 112x112 with 14px patches and 2x2 merge = 16 vision tokens


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


def build_preset(name: str, *, seed: int = 0):
    """Build preset ``name`` with random weights (deterministic for ``seed``); returns a `Policy`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from vlrl.models.policy import Policy
    from vlrl.models.tokenizer import train_tokenizer

    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; presets: {sorted(PRESETS)}")
    spec = PRESETS[name]
    tokenizer = train_tokenizer(tokenizer_corpus(), vocab_size=spec.vocab_size)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>", "<|image_pad|>",
                                                            "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")}
    text = dict(
        spec.text, vocab_size=len(tokenizer), max_position_embeddings=2048, rms_norm_eps=1e-6,
        bos_token_id=None, eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    torch.manual_seed(seed)
    if spec.family == "qwen2":
        config = Qwen2Config(**text, tie_word_embeddings=False)
        model = Qwen2ForCausalLM(config)
        image_processor = None
    else:
        from transformers import Qwen2VLImageProcessorPil

        text["rope_parameters"]["mrope_section"] = list(spec.mrope_section)
        vision = dict(spec.vision, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
        common = dict(
            text_config=text, image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
            tie_word_embeddings=False,
        )
        if spec.family == "qwen2_vl":
            from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

            vision["hidden_size"] = spec.text["hidden_size"]  # Qwen2-VL: merger output width
            config = Qwen2VLConfig(vision_config=vision, **common)
            model = Qwen2VLForConditionalGeneration(config)
        else:
            from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

            vision["out_hidden_size"] = spec.text["hidden_size"]
            config = Qwen2_5_VLConfig(vision_config=vision, **common)
            model = Qwen2_5_VLForConditionalGeneration(config)
        image_processor = Qwen2VLImageProcessorPil(
            min_pixels=56 * 56, max_pixels=IMAGE_SIDE * IMAGE_SIDE, patch_size=14, merge_size=2, temporal_patch_size=2
        )
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    return Policy.from_parts(model, tokenizer, image_processor, source=f"preset:{name}")
