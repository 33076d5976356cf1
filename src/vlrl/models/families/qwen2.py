"""Qwen2 (``qwen2``), text only: any causal LM takes the same path (`vlrl.models.adapters.TextAdapter`: 1-D
positions from the attention mask); its preset carries the Qwen markup of Qwen2-VL.

| preset | parameters |
| --- | --- |
| ``tiny-qwen2`` | 0.82M |
"""

from __future__ import annotations

from vlrl.models.families import TEXT_1M, Family, PresetSpec, rope, text_config
from vlrl.models.families.qwen2_vl import MARKUP


def _build(ids):
    from transformers import Qwen2Config

    text = text_config(ids, TEXT_1M, "<|im_end|>", "<|endoftext|>", rope_parameters=rope())
    return Qwen2Config(**text, tie_word_embeddings=False), None, {}


FAMILY = Family(model_types=("qwen2",), order=1000, presets={"tiny-qwen2": PresetSpec("qwen2", MARKUP, _build)})
