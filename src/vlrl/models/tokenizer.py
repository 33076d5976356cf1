"""A small byte-level BPE tokenizer trained locally, with Qwen's special tokens and chat template.

The tiny presets need a tokenizer without a download. Byte-level BPE (as in Qwen2) encodes any text; it is
trained on the task vocabulary so that task words are single tokens and sequences stay short.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# Qwen2/Qwen2-VL special tokens (same spelling, so code written for real Qwen models works unchanged).
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# Plain (non-special) added tokens: the answer/think tags of the RL prompt templates stay one token each.
TAG_TOKENS = ["<think>", "</think>", "<answer>", "</answer>"]
# Plain added tokens for the JSON scaffolding of the embodied plans (`vlrl.data.tasks.embodied`): the byte-level
# pre-tokenizer splits at every quote and underscore, so without them a plan step costs ~14 tokens instead of ~8.
PLAN_TOKENS = ['{"visual_state_description": "', '", "reasoning_and_reflection": "', '", "language_plan": "',
               '", "executable_plan": [', '{"action_id": ', ', "action_name": "', '"}']

# Qwen2-VL's chat template, trimmed to what vlrl uses: a default system prompt, text and image parts.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_tokenizer(corpus: Iterable[str], vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``corpus`` and wrap it as a transformers fast tokenizer."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    tokenizer.add_tokens(TAG_TOKENS)
    tokenizer.add_tokens(PLAN_TOKENS)
    return tokenizer
