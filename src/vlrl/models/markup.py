"""A model family's tokenizer markup: its special tokens and a chat template in its style.

The tiny presets train their tokenizer locally (`vlrl.models.tokenizer.train_tokenizer`); each family's
tokenizer carries that family's vision markup (the tokens its processor expands and its model looks for) and a
chat template in that family's style, so the code the tiny presets exercise is the code a real checkpoint of the
family runs. Each family module (`vlrl.models.families`) declares its `Markup`; the Jinja pieces below are what
several families' templates share.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, eq=False)  # eq=False: hashed by identity (the trained tokenizer is cached per markup)
class Markup:
    """A family's tokens and chat template.

    Attributes:
        special: special tokens (never split, skipped when decoding), in vocabulary order.
        template: the chat template (jinja).
        eos / pad / bos: the tokenizer's eos (the template's end-of-turn marker), pad and bos tokens.
        named: named special tokens the family's processor reads from the tokenizer (``tokenizer.image_token``, ...).
        legacy_layout: the special tokens (but the first) are registered as ``additional_special_tokens`` — the
            layout of the first presets (Qwen's), kept: changing it would change their token ids.
    """

    special: tuple[str, ...]
    template: str
    eos: str
    pad: str
    bos: str | None = None
    named: dict[str, str] = field(default_factory=dict)
    legacy_layout: bool = False


def chat_content(image: str, video: str = "") -> str:
    """Jinja for a message's content: a string, or parts of type text / image (/ video) in order."""
    video_branch = f"{{% elif part['type'] == 'video' %}}{video}" if video else ""
    return (
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        f"{{% if part['type'] == 'image' %}}{image}{video_branch}"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}"
    )


def chatml(image: str, video: str = "", *, thinking: bool = False) -> str:
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
        "<|im_start|>{{ message['role'] }}\n" + chat_content(image, video) + "<|im_end|>\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}" + prompt + "{% endif %}"
    )
