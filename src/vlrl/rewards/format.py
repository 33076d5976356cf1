"""Format and length rewards: they score the shape of a response, not its correctness — and the answer forms
a sample may declare (`ANSWER_FORMATS`, `has_answer_form`), which strict scoring requires of every response.

A format reward alone is the classic hack target (a well-formed wrong answer), so use it as a small
weight next to an accuracy verifier (``{"math": 0.8, "cot_format": 0.2}``); none of these reports an
``accuracy`` part, so strict scoring leaves their scores as they are. All are linear-time string checks and run
inline.
"""

from __future__ import annotations

from typing import Any

from vlrl.rewards.base import register_reward
from vlrl.rewards.extract import boxed_contents, strip_special


def _one_block(text: str, tag: str, *, filled: bool = False) -> tuple[int, int] | None:
    """(start, end) of the single ``<tag>…</tag>`` in ``text``; None unless each tag occurs exactly once,
    opening before closing — and, with ``filled``, holding something other than whitespace."""
    open_tag, close_tag = f"<{tag}>", f"</{tag}>"
    if text.count(open_tag) != 1 or text.count(close_tag) != 1:
        return None
    start, end = text.find(open_tag), text.find(close_tag)
    if start >= end or (filled and not text[start + len(open_tag) : end].strip()):
        return None
    return start, end + len(close_tag)


@register_reward("format")
def think_answer_format(response: str, answer: Any = None, **meta: Any) -> float:
    """1 if the response is exactly one ``<think>…</think>`` followed by one non-empty ``<answer>…</answer>``
    and nothing else (trailing special tokens aside), else 0 — LLaVA-OV-1.5's stage-2 prompt template. An
    answer block of whitespace only is no answer and earns 0."""
    text = strip_special(response)
    think, ans = _one_block(text, "think"), _one_block(text, "answer", filled=True)
    if think is None or ans is None:
        return 0.0
    ok = think[0] == 0 and not text[think[1] : ans[0]].strip() and ans[1] == len(text)
    return 1.0 if ok else 0.0


@register_reward("answer_format")
def answer_format(response: str, answer: Any = None, **meta: Any) -> float:
    """1 if the response is exactly one non-empty ``<answer>…</answer>`` block and nothing else, else 0 —
    LLaVA-OV-1.5's stage-1 template ("Put ONLY your final answer within <answer></answer>"). A block of
    whitespace only (``<answer> </answer>``) is no answer and earns 0."""
    text = strip_special(response)
    block = _one_block(text, "answer", filled=True)
    return 1.0 if block == (0, len(text)) else 0.0


@register_reward("cot_format")
def cot_format(response: str, answer: Any = None, *, max_boxed_fraction: float = 0.2, **meta: Any) -> float:
    """1 if the response has exactly one ``<think>…</think>`` block, at least one ``\\boxed{}``, and the
    boxed content is at most 20 % of the response's length; else 0.

    LLaVA-OV-1.5 ``reward/format.py`` (cross-cutting format reward): Σ len(boxed contents) ≤
    ``max_boxed_fraction`` · len(response), so boxing the whole reasoning does not pay.
    """
    text = strip_special(response)
    boxes = boxed_contents(text)
    if _one_block(text, "think") is None or not boxes:
        return 0.0
    return 1.0 if sum(len(b) for b in boxes) <= max_boxed_fraction * len(text) else 0.0


@register_reward("overlong", low=-1.0, high=0.0)
def overlong(response: str, answer: Any = None, *, max_length: int, cache_length: int,
             response_length: int | None = None, unit: str = "tokens", **meta: Any) -> float:
    """DAPO soft overlong punishment (eq. 13), in [−1, 0]:

        R_length(y) = 0                               if |y| ≤ L_max − L_cache
                    = ((L_max − L_cache) − |y|) / L_cache   if L_max − L_cache < |y| ≤ L_max
                    = −1                              if L_max < |y|

    ``max_length`` = L_max, ``cache_length`` = L_cache (DAPO: 20,480 and 4,096 tokens). |y| is
    ``response_length`` (tokens; the batch scorer passes each trajectory's), or with ``unit="chars"``
    the response's character count. Add it to an accuracy reward: ``{"math": 1.0, "overlong": 1.0}``.
    """
    if unit == "chars":
        length = len(response)
    elif response_length is not None:
        length = int(response_length)
    else:
        raise ValueError("overlong: needs meta 'response_length' (tokens) or the option unit='chars'")
    if not 0 < cache_length <= max_length:
        raise ValueError(f"overlong: need 0 < cache_length ≤ max_length, got {cache_length} and {max_length}")
    if length <= max_length - cache_length:
        return 0.0
    if length <= max_length:
        return ((max_length - cache_length) - length) / cache_length
    return -1.0


# The forms a sample may declare its answer in (`vlrl.data.Sample.answer_format`; the names of the procedural
# suites' prompt templates, `vlrl.data.tasks.TEMPLATES`):
#   answer  exactly one non-empty <answer>…</answer> and nothing else (LLaVA-OV-1.5's stage-1 template);
#   think   the same, after at most one leading <think>…</think> (stage 2's; the `format` reward is the one that
#           requires the <think> block — add it to the reward to pay for thinking);
#   none    any text: only whether the response ended counts.
ANSWER_FORMATS = ("answer", "think", "none")


def has_answer_form(response: str, answer_format: str) -> bool:
    """Whether ``response`` (trailing special tokens aside) has the declared ``answer_format`` (`ANSWER_FORMATS`).
    ``<answer>3</answer>3</answer>`` has no form: a second close tag, text after the block."""
    if answer_format == "none":
        return True
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"unknown answer format {answer_format!r}; choose from {', '.join(ANSWER_FORMATS)}")
    text = strip_special(response)
    if answer_format == "think" and ("<think>" in text or "</think>" in text):
        think = _one_block(text, "think")
        if think is None or think[0] != 0:
            return False
        text = text[think[1] :].lstrip()
    return _one_block(text, "answer", filled=True) == (0, len(text))
