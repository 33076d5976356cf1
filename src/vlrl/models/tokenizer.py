"""A small byte-level BPE tokenizer trained locally, with a model family's special tokens and chat template.

The tiny presets need a tokenizer without a download. Byte-level BPE (as in Qwen2) encodes any text; it is
trained on the task vocabulary so that task words are single tokens and sequences stay short. Each family's
tokenizer carries that family's vision markup (the tokens its processor expands and its model looks for) and
a chat template in that family's style (`MARKUPS`), so the code the tiny presets exercise is the code a real
checkpoint of the family runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

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


def _content(image: str, video: str = "") -> str:
    """Jinja for a message's content: a string, or parts of type text / image (/ video) in order."""
    video_branch = f"{{% elif part['type'] == 'video' %}}{video}" if video else ""
    return (
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        f"{{% if part['type'] == 'image' %}}{image}{video_branch}"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}"
    )


def _chatml(image: str, video: str = "", *, thinking: bool = False) -> str:
    """ChatML (``<|im_start|>role ... <|im_end|>``) with a default system prompt, as Qwen's templates render it.
    ``thinking``: Qwen3 style — ``enable_thinking=False`` closes an empty think block in the generation prompt."""
    prompt = "<|im_start|>assistant\n"
    if thinking:
        prompt += "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    return (
        "{% for message in messages %}"
        "{% if loop.first and message['role'] != 'system' %}"
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "{% endif %}"
        "<|im_start|>{{ message['role'] }}\n" + _content(image, video) + "<|im_end|>\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}" + prompt + "{% endif %}"
    )


@dataclass(frozen=True)
class Markup:
    """A family's tokens and chat template.

    Attributes:
        special: special tokens (never split, skipped when decoding), in vocabulary order.
        named: named special tokens the family's processor reads from the tokenizer (``tokenizer.image_token``, ...).
        eos / pad / bos: the tokenizer's eos (the template's end-of-turn marker), pad and bos tokens.
        template: the chat template (jinja).
    """

    special: tuple[str, ...]
    template: str
    eos: str
    pad: str
    bos: str | None = None
    named: dict[str, str] = field(default_factory=dict)


_QWEN_VISION = "<|vision_start|><|image_pad|><|vision_end|>"
_QWEN_VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"

MARKUPS: dict[str, Markup] = {
    # Qwen2-VL, Qwen2.5-VL, Qwen3-VL (+MoE): the same vision tokens; the placeholder is <|image_pad|>.
    "qwen": Markup(tuple(SPECIAL_TOKENS), _chatml(_QWEN_VISION, _QWEN_VIDEO), "<|im_end|>", "<|endoftext|>"),
    # Qwen3.5 (+MoE): Qwen's tokens, a Qwen3-style template with thinking control.
    "qwen3_5": Markup(tuple(SPECIAL_TOKENS), _chatml(_QWEN_VISION, _QWEN_VIDEO, thinking=True), "<|im_end|>",
                      "<|endoftext|>"),
    # GLM-4.1V / 4.5V / 4.6V: [gMASK]<sop>, role tokens, no end-of-turn token (a turn ends where the next
    # <|user|> begins, so <|user|> is the end-of-turn marker generation stops at); image placeholder <|image|>.
    "glm4v": Markup(
        ("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
         "<|begin_of_image|>", "<|end_of_image|>", "<|image|>", "<|begin_of_video|>", "<|end_of_video|>", "<|video|>"),
        "[gMASK]<sop>{% for message in messages %}<|{{ message['role'] }}|>\n"
        + _content("<|begin_of_image|><|image|><|end_of_image|>", "<|begin_of_video|><|video|><|end_of_video|>")
        + "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}",
        "<|user|>", "<|endoftext|>",
        named={"image_token": "<|image|>", "video_token": "<|video|>"},
    ),
    # InternVL (-HF layout): ChatML; the template's placeholder <IMG_CONTEXT> expands to <img><IMG_CONTEXT>×N</img>.
    "internvl": Markup(
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "<video>"),
        _chatml("<IMG_CONTEXT>\n", "<video>\n"), "<|im_end|>", "<|endoftext|>",
        named={"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
               "video_token": "<video>"},
    ),
    # Gemma 3: <bos>, turns of user/model, the system prompt folded into the first user turn; the placeholder
    # <start_of_image> expands to "\n\n<start_of_image><image_soft_token>×N<end_of_image>\n\n".
    "gemma3": Markup(
        ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
         "<image_soft_token>"),
        "{{ bos_token }}{% set ns = namespace(system='') %}"
        "{% for message in messages %}"
        "{% if message['role'] == 'system' %}{% set ns.system = message['content'] if message['content'] is string "
        "else message['content'][0]['text'] %}"
        "{% else %}<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
        "{% if ns.system %}{{ ns.system }}\n\n{% set ns.system = '' %}{% endif %}"
        + _content("<start_of_image>") + "<end_of_turn>\n{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}",
        "<end_of_turn>", "<pad>", bos="<bos>",
        named={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"},
    ),
    # LLaVA-OneVision (Qwen2 LLM): ChatML; the placeholder <image> expands to the anyres feature count.
    "llava_onevision": Markup(
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>"),
        _chatml("<image>\n", "<video>\n"), "<|im_end|>", "<|endoftext|>",
        named={"image_token": "<image>", "video_token": "<video>"},
    ),
    # SmolVLM / Idefics3: "User:<image>...<end_of_utterance>\nAssistant:"; <image> expands to a grid of tiles
    # (<fake_token_around_image><row_r_col_c><image>×N ... <global-img><image>×N<fake_token_around_image>).
    "smolvlm": Markup(
        ("<|endoftext|>", "<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>",
         "<global-img>", "<video>", *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))),
        "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
        "{% if message['content'] is not string and message['content'][0]['type'] == 'image' %}:{% else %}: {% endif %}"
        + _content("<image>") + "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}",
        "<end_of_utterance>", "<|endoftext|>",
        named={"image_token": "<image>", "fake_image_token": "<fake_token_around_image>",
               "global_image_token": "<global-img>", "end_of_utterance_token": "<end_of_utterance>",
               "video_token": "<video>"},
    ),
}
# Backwards-compatible name: the Qwen template.
CHAT_TEMPLATE = MARKUPS["qwen"].template


def train_tokenizer(corpus: Iterable[str], vocab_size: int = 1024, *, markup: str = "qwen") -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``corpus`` and wrap it as a transformers fast tokenizer with family ``markup``."""
    if markup not in MARKUPS:
        raise KeyError(f"unknown tokenizer markup {markup!r}; markups: {sorted(MARKUPS)}")
    spec = MARKUPS[markup]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(spec.special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer)
    named_specials = {spec.eos, spec.pad, spec.bos}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=spec.eos,
        pad_token=spec.pad,
        bos_token=spec.bos,
        padding_side="left",
        chat_template=spec.template,
        model_max_length=4096,
        # the family's named tokens (``tokenizer.image_token`` …), as transformers' multimodal tokenizers declare them
        extra_special_tokens=dict(spec.named) if markup != "qwen" and spec.named else None,
    )
    if markup == "qwen":  # the original presets' layout (kept: changing it would change their token ids)
        tokenizer.add_special_tokens({"additional_special_tokens": list(spec.special[1:])})
    else:
        extra: dict | list = [t for t in spec.special if t not in named_specials and t not in spec.named.values()]
        tokenizer.add_special_tokens({"extra_special_tokens": extra})
    tokenizer.add_tokens(TAG_TOKENS)
    tokenizer.add_tokens(PLAN_TOKENS)
    return tokenizer
