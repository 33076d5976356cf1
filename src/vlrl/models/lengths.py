"""Token lengths of samples as training encodes them, without decoding a single pixel.

Text: the chat template rendered and tokenized by the model's own tokenizer. Vision: each image's size is
read from its file header, and its markup is what the family's processor expands a blank image of that size
into (an image's markup depends only on its size: Qwen2-VL's ``get_number_of_image_patches(h, w) / merge_size²``
after its smart resize into [min_pixels, max_pixels], InternVL's and SmolVLM's tile grids, LLaVA-OneVision's
anyres count, Gemma 3's fixed run), cached per size (`VisionAdapter.count_prompt_tokens`). The result equals
``len(prompt_ids) + len(target_ids)`` of `encode_sft` (tests/models/test_lengths.py and, for every family,
tests/models/test_families.py check it), so a packing plan made from these lengths fits when training encodes
the same samples.
"""

from __future__ import annotations

from vlrl.data import Sample
from vlrl.data.sample import image_size
from vlrl.models.policy import Policy


class TokenCounter:
    """``counter(sample) -> (prompt_tokens, total_tokens)``; total = prompt + response + EOS (prompt only when
    the sample has no reference response). Picklable for worker processes only via fork."""

    def __init__(self, policy: Policy) -> None:
        self.adapter = policy.adapter

    def __call__(self, sample: Sample) -> tuple[int, int]:
        sizes = [image_size(src) for src in sample.images]
        prompt = self.adapter.count_prompt_tokens(sample.messages, sizes)
        if sample.response is None:
            return prompt, prompt
        return prompt, prompt + len(self.adapter.encode_text(sample.response)) + 1
