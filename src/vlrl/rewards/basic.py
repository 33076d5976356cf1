"""Verifiers for the built-in tasks: numbers, multiple choice, boxes, OCR text, and output format.

Every verifier reads the answer with `extract_answer` (last ``<answer>…</answer>``, else last
``\\boxed{…}``, else the whole response) unless it says otherwise. Hedging — several candidate answers
where one is asked — earns nothing.
"""

from __future__ import annotations

import math
import re
from typing import Any

from rapidfuzz.distance import Levenshtein

from vlrl.rewards.base import RewardOutput, register_reward
from vlrl.rewards.extract import extract_answer, strip_special

_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")


def _correct(ok: bool) -> RewardOutput:
    value = 1.0 if ok else 0.0
    return RewardOutput(overall=value, parts={"accuracy": value})


@register_reward("number")
def number(response: str, answer: Any, *, tolerance: float = 0.0, **meta: Any) -> RewardOutput:
    """1 if the answer holds exactly one number and it equals ``answer`` (within ``tolerance``), else 0.

    LLaVA-OV-1.5 ``reward/number.py``: numeric token equivalence of the extracted answer. Unlike the seed,
    which takes the last number, an answer listing several numbers is a hedge and scores 0.
    """
    found = _NUMBER.findall(extract_answer(response).replace(",", ""))
    if len(found) != 1:
        return _correct(False)
    try:
        predicted, target = float(found[0]), float(str(answer).replace(",", ""))
    except ValueError:
        return _correct(False)
    return _correct(math.isfinite(predicted) and abs(predicted - target) <= tolerance)


_LETTER = re.compile(r"^\(?([A-Za-z])\)?[.:)]?(?:\s+(.*))?$", re.DOTALL)


@register_reward("multiple_choice")
def multiple_choice(response: str, answer: Any, *, options: dict[str, str] | None = None, **meta: Any) -> RewardOutput:
    """1 if the chosen option equals ``answer`` (a letter), else 0.

    LLaVA-OV-1.5 ``reward/multiple_choice.py``: the extracted answer stripped of ``.()``, its letter
    compared upper-cased. Also accepted: the option's text when ``options`` maps letters to texts
    (``"green"`` for ``B. green``). A letter followed by a different option's text, or several letters,
    scores 0.
    """
    text = extract_answer(response).strip().strip(".").strip()
    target = str(answer).strip().upper()
    by_text = {v.strip().lower(): k.upper() for k, v in (options or {}).items()}
    if text.lower() in by_text:
        return _correct(by_text[text.lower()] == target)
    match = _LETTER.match(text)
    if not match:
        return _correct(False)
    letter, rest = match.group(1).upper(), (match.group(2) or "").strip().strip(".").lower()
    if rest and options and by_text.get(rest) != letter:
        return _correct(False)  # "A. blue" when A is red: inconsistent
    if rest and not options:
        return _correct(False)
    return _correct(letter == target)


_BOX = re.compile(r"\[?\(?\s*([-+]?\d*\.?\d+)\s*,\s*([-+]?\d*\.?\d+)\s*,\s*([-+]?\d*\.?\d+)\s*,\s*([-+]?\d*\.?\d+)\s*\]?\)?")


def parse_box(text: str) -> list[float] | None:
    """The first ``[x1, y1, x2, y2]`` (brackets optional) in ``text``, as floats, or None."""
    match = _BOX.search(text)
    return [float(v) for v in match.groups()] if match else None


def box_iou(a: list[float], b: list[float]) -> float:
    """IoU = Intersection / (Area₁ + Area₂ − Intersection) of two xyxy boxes (0 for degenerate boxes)."""
    if a[2] <= a[0] or a[3] <= a[1] or b[2] <= b[0] or b[3] <= b[1]:
        return 0.0
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


@register_reward("bbox_iou")
def bbox_iou(response: str, answer: Any, **meta: Any) -> RewardOutput:
    """IoU of the first predicted box with the ground-truth box ``answer`` (xyxy), in [0, 1].

    LLaVA-OV-1.5 ``reward/bbox.py``. ``accuracy`` is IoU ≥ 0.5 (the usual Acc@0.5). Only the first box
    counts, so listing many boxes does not help.
    """
    target = answer if isinstance(answer, (list, tuple)) else parse_box(str(answer))
    predicted = parse_box(extract_answer(response))
    if predicted is None or target is None or len(target) != 4:
        return RewardOutput(overall=0.0, parts={"accuracy": 0.0})
    iou = box_iou(predicted, [float(v) for v in target])
    return RewardOutput(overall=iou, parts={"accuracy": float(iou >= 0.5)})


@register_reward("ocr")
def ocr(response: str, answer: Any, **meta: Any) -> RewardOutput:
    """Similarity = 1 − Levenshtein(gt, pred) / max(len(gt), len(pred)), set to 0 below 0.5.

    LLaVA-OV-1.5 ``reward/ocr.py``; compared case-insensitively with whitespace collapsed. ``accuracy``
    is an exact match.
    """
    predicted = " ".join(extract_answer(response).lower().split())
    target = " ".join(str(answer).lower().split())
    if not predicted and not target:
        return _correct(True)
    similarity = 1.0 - Levenshtein.distance(predicted, target) / max(len(predicted), len(target))
    return RewardOutput(overall=similarity if similarity >= 0.5 else 0.0, parts={"accuracy": float(predicted == target)})


_THINK_ANSWER = re.compile(r"^\s*<think>(?:(?!<think>|</think>).)*</think>\s*<answer>(?:(?!<answer>|</answer>).)*</answer>\s*$", re.DOTALL)
_ANSWER_ONLY = re.compile(r"^\s*<answer>(?:(?!<answer>|</answer>).)*</answer>\s*$", re.DOTALL)


@register_reward("format")
def think_answer_format(response: str, answer: Any = None, **meta: Any) -> float:
    """1 if the response is exactly one ``<think>…</think>`` followed by one ``<answer>…</answer>``, else 0."""
    return 1.0 if _THINK_ANSWER.match(strip_special(response)) else 0.0


@register_reward("answer_format")
def answer_format(response: str, answer: Any = None, **meta: Any) -> float:
    """1 if the response is exactly one ``<answer>…</answer>`` block and nothing else, else 0."""
    return 1.0 if _ANSWER_ONLY.match(strip_special(response)) else 0.0
