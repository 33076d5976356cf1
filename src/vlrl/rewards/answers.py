"""Short-answer verifiers: numbers, multiple choice, yes/no, strings, OCR text.

All read the answer with `final_answer` (``<answer>…</answer>``, else ``\\boxed{…}``, else the whole
response; several different final answers are a hedge and score 0). All are cheap and bounded-time, so
they run inline. Each returns ``RewardOutput(overall, {"accuracy": …})`` with ``overall`` in [0, 1].
"""

from __future__ import annotations

import math
import re
import string
from typing import Any

from rapidfuzz.distance import Levenshtein

from vlrl.rewards.base import RewardOutput, register_reward
from vlrl.rewards.extract import final_answer, numbers


def correct(ok: bool) -> RewardOutput:
    """``RewardOutput`` of a right/wrong check: overall = accuracy = 1.0 or 0.0."""
    value = 1.0 if ok else 0.0
    return RewardOutput(overall=value, parts={"accuracy": value})


@register_reward("number")
def number(response: str, answer: Any, *, tolerance: float = 0.0, **meta: Any) -> RewardOutput:
    """1 if the answer holds exactly one number and |number − answer| ≤ ``tolerance``, else 0.

    LLaVA-OV-1.5 ``reward/number.py``: numeric token equivalence of the extracted answer. Unlike the seed,
    which takes the last number, an answer listing several numbers (``3 or 4``, ``10**10**10``) is a hedge
    and scores 0. Accepted: ``7``, ``7.0``, ``1,000``, ``-2.5``, ``1e3``, ``7 apples``.
    """
    text = final_answer(response)
    found = numbers(text) if text is not None else []
    if len(found) != 1:
        return correct(False)
    try:
        predicted, target = float(found[0]), float(str(answer).replace(",", ""))
    except ValueError:
        return correct(False)
    return correct(math.isfinite(predicted) and abs(predicted - target) <= tolerance)


_LETTER = re.compile(r"\(?([A-Za-z])\)?[.:)]?(?:\s+(.*))?", re.DOTALL)
_PREFIX = re.compile(r"^(?:the\s+)?(?:final\s+)?(?:answer|option|choice)\s*(?:is|:)?\s*", re.IGNORECASE)


@register_reward("multiple_choice")
def multiple_choice(response: str, answer: Any, *, options: dict[str, str] | None = None, **meta: Any) -> RewardOutput:
    """1 if the chosen option equals ``answer`` (a letter), else 0.

    LLaVA-OV-1.5 ``reward/multiple_choice.py``: the extracted answer stripped of ``.()``, its letter
    compared upper-cased. Accepted: ``B``, ``(b).``, ``B. green``, ``Answer: B``, and the option's text
    (``green``) when ``options`` maps letters to texts. A letter followed by a different option's text,
    several letters (``A B C D``), or several boxes score 0.
    """
    text = final_answer(response)
    if text is None:
        return correct(False)
    text = _PREFIX.sub("", text.strip()).strip().strip(".").strip()
    target = str(answer).strip().upper()
    by_text = {str(v).strip().lower(): k.upper() for k, v in (options or {}).items()}
    if text.lower() in by_text:
        return correct(by_text[text.lower()] == target)
    match = _LETTER.fullmatch(text[:200])
    if not match:
        return correct(False)
    letter, rest = match.group(1).upper(), (match.group(2) or "").strip().strip(".").lower()
    if rest and (not options or by_text.get(rest) != letter):
        return correct(False)  # "A. blue" when A is red, or trailing text that names no option
    return correct(letter == target)


_POSITIVE = {"yes", "true", "correct", "right", "y"}
_NEGATIVE = {"no", "false", "incorrect", "wrong", "n"}


def _polarity(value: Any) -> bool | None:
    if isinstance(value, bool):
        return value
    word = str(value).strip().strip(string.punctuation).lower()
    return True if word in _POSITIVE | {"1"} else False if word in _NEGATIVE | {"0"} else None


@register_reward("bool")
def yes_no(response: str, answer: Any, **meta: Any) -> RewardOutput:
    """1 if the answer's polarity (yes/true vs no/false) equals ``answer``'s, else 0.

    LLaVA-OV-1.5 ``reward/bool.py``. ``answer``: a bool, ``yes``/``no``, ``true``/``false`` or ``1``/``0``.
    The extracted answer must start with a yes/no word, and every yes/no word in it must agree:
    ``Yes.`` and ``yes, it is`` count; ``yes or no`` and ``No, it is not true`` (mixed) score 0.
    """
    text = final_answer(response)
    target = _polarity(answer)
    if text is None or target is None:
        return correct(False)
    words = re.findall(r"[a-z]+", text[:2000].lower())
    polar = [w in _POSITIVE for w in words if w in _POSITIVE or w in _NEGATIVE]
    if not words or words[0] not in _POSITIVE | _NEGATIVE or len(set(polar)) != 1:
        return correct(False)
    return correct(polar[0] == target)


def normalise_text(text: str) -> str:
    """Lower-case, drop punctuation and the articles a/an/the, collapse whitespace (SQuAD-style)."""
    text = text.lower().translate(str.maketrans("", "", string.punctuation))
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


@register_reward("string_match")
def string_match(response: str, answer: Any, *, mode: str = "exact", max_extra_words: int = 3,
                 **meta: Any) -> RewardOutput:
    """1 if the normalised answer matches a normalised ground truth, else 0.

    LLaVA-OV-1.5 ``reward/string_matching.py``. ``answer``: a string or a list of accepted strings.
    Normalisation: `normalise_text`. ``mode="exact"``: equal. ``mode="contains"``: the ground truth occurs
    as whole words in an answer at most ``max_extra_words`` words longer (so listing every candidate does
    not pay).
    """
    if mode not in ("exact", "contains"):
        raise ValueError(f"string_match: mode must be 'exact' or 'contains', got {mode!r}")
    text = final_answer(response)
    if text is None:
        return correct(False)
    predicted = normalise_text(text[:10_000])
    targets = [normalise_text(str(a)) for a in (answer if isinstance(answer, (list, tuple)) else [answer])]
    for target in targets:
        if predicted == target:
            return correct(True)
        if mode == "contains" and target and f" {target} " in f" {predicted} " \
                and len(predicted.split()) <= len(target.split()) + max_extra_words:
            return correct(True)
    return correct(False)


@register_reward("ocr")
def ocr(response: str, answer: Any, **meta: Any) -> RewardOutput:
    """Similarity = 1 − Levenshtein(gt, pred) / max(len(gt), len(pred)), set to 0 below 0.5.

    LLaVA-OV-1.5 ``reward/ocr.py`` (``reward = 1 - min(values)`` over the accepted answers; a threshold
    at 0.5). ``answer``: a string or a list of accepted strings, compared case-insensitively with
    whitespace collapsed. ``accuracy`` is an exact match.
    """
    text = final_answer(response)
    if text is None:
        return RewardOutput(overall=0.0, parts={"accuracy": 0.0})
    predicted = " ".join(text.lower().split())
    best, exact = 0.0, False
    for target in answer if isinstance(answer, (list, tuple)) else [answer]:
        target = " ".join(str(target).lower().split())
        longest = max(len(predicted), len(target))
        similarity = 1.0 if longest == 0 else 1.0 - Levenshtein.distance(predicted, target) / longest
        best, exact = max(best, similarity), exact or predicted == target
    return RewardOutput(overall=best if best >= 0.5 else 0.0, parts={"accuracy": float(exact)})
