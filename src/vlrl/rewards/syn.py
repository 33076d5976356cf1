"""Syn-GRPO's output template: reasoning, predicted diversity, new image description, answer (Syn-GRPO seed,
§3.3.2 "New image description" and Eq. 7), its parser, and its format reward ``syn_format``.

The template (one block of each, in this order)::

    <think>…</think><diversity>0.4</diversity><description>a striped blue background</description><answer>…</answer>

``<diversity>`` holds v_i ∈ [0, 1], the policy's estimate of how diverse its answers to this prompt are;
``<description>`` the text the data server synthesises a new image from. The accuracy verifiers read the
answer from ``<answer>`` as usual, so a sample's reward can be ``{"bbox_iou": 1.0, "syn_format": 1.0}`` and
the recipe adds R_diversity (`vlrl.algos.diversity`): r = R_acc + R_format + R_diversity (Eq. 7).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from vlrl.rewards.base import register_reward
from vlrl.rewards.extract import strip_special, tag_blocks

SYN_TAGS = ("think", "diversity", "description", "answer")
SYN_PROMPT = (
    "Think step by step inside <think></think>. Then predict how diverse your possible answers to this question "
    "are, as a number from 0 (always the same) to 1 (very different), inside <diversity></diversity>. Then describe "
    "a new background for this image that keeps the objects and makes the question harder, inside "
    "<description></description>. Put ONLY your final answer within <answer></answer>."
)
SYN_PROMPT_SHORT = (  # without the reasoning block, for small models and short budgets
    "Predict how diverse your possible answers are, from 0 to 1, inside <diversity></diversity>. Describe a new "
    "background for this image inside <description></description>. Put ONLY your final answer within <answer></answer>."
)
MAX_DESCRIPTION_CHARS = 1000  # longer descriptions are cut (the synthesis server rejects longer ones)


@dataclass(frozen=True)
class SynResponse:
    """The parts of a response in the Syn-GRPO template; None where a part is missing or unreadable."""

    think: str | None
    diversity: float | None  # v_i, in [0, 1]
    description: str | None  # stripped, non-empty, at most MAX_DESCRIPTION_CHARS characters
    answer: str | None
    well_formed: bool  # exactly one block of each tag, in template order, nothing outside them


def parse_syn_response(response: str, *, require_think: bool = True) -> SynResponse:
    """Read the four blocks of the template. A part is taken when its tag occurs exactly once; ``diversity``
    must be one number in [0, 1]; ``description`` must be non-empty. Linear time (`tag_blocks`)."""
    text = strip_special(response)
    parts = {tag: _single(text, tag) for tag in SYN_TAGS}
    diversity = _unit_number(parts["diversity"])
    description = (parts["description"] or "").strip()[:MAX_DESCRIPTION_CHARS] or None
    well_formed = (all(parts[tag] is not None for tag in SYN_TAGS if tag != "think" or require_think)
                   and diversity is not None and description is not None
                   and _in_order(text, [t for t in SYN_TAGS if parts[t] is not None]))
    return SynResponse(parts["think"], diversity, description, parts["answer"], well_formed)


@register_reward("syn_format")
def syn_format(response: str, answer: Any = None, *, require_think: bool = True, **meta: Any) -> float:
    """1 if the response follows the Syn-GRPO template exactly — ``<think>`` (unless ``require_think=False``),
    ``<diversity>`` holding one number in [0, 1], a non-empty ``<description>``, ``<answer>``, each once, in
    that order, nothing outside them — else 0 (R_format of Syn-GRPO Eq. 7)."""
    return 1.0 if parse_syn_response(response, require_think=require_think).well_formed else 0.0


def _single(text: str, tag: str) -> str | None:
    if text.count(f"<{tag}>") != 1 or text.count(f"</{tag}>") != 1:
        return None
    blocks = tag_blocks(text, tag)
    return blocks[0] if len(blocks) == 1 else None


def _unit_number(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        value = float(text.strip().rstrip("%")) / (100.0 if text.strip().endswith("%") else 1.0)
    except ValueError:
        return None
    return value if math.isfinite(value) and 0.0 <= value <= 1.0 else None


def _in_order(text: str, tags: list[str]) -> bool:
    """The blocks of ``tags`` follow each other in this order with only whitespace around and between them."""
    pos = 0
    for tag in tags:
        start = text.find(f"<{tag}>")
        if start < 0 or text[pos:start].strip():
            return False
        pos = text.find(f"</{tag}>", start) + len(f"</{tag}>")
    return not text[pos:].strip()
