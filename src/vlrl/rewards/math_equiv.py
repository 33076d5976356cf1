"""The ``math`` verifier: mathematical equivalence with math-verify, and a SymPy fallback.

math-verify (Hugging Face) and SymPy can take unbounded time on hostile input (``10^{10^{10}}`` makes
SymPy build a ten-billion-digit integer), and math-verify's own timeout uses ``signal.alarm``, which only
works in a main thread. So its timeouts are switched off here and the verifier is registered with
``mode="pool"``: the batch scorer runs it in a worker process that is killed at the item's deadline.
Exponent towers are also caught before parsing (compared as text only).

math-verify, latex2sympy2 and SymPy come with ``pip install 'vlrl[rewards]'``; without them the verifier
raises `vlrl.rewards.deps.MissingDependencyError` naming that command (and ``vlrl check`` reports it).

SymPy's own string parser (``parse_expr``) calls ``eval`` and is never used on model output; the
fallback parses LaTeX with latex2sympy2 (a grammar, no eval).
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any

from vlrl.rewards.answers import correct
from vlrl.rewards.base import RewardOutput, register_reward
from vlrl.rewards.deps import ensure_dependencies, requires
from vlrl.rewards.extract import boxed_contents, final_answer, strip_special, tag_blocks

MAX_ANSWER_CHARS = 2000  # a longer final answer is compared as text only
_TOWER = re.compile(r"\^\s*\{?\s*[-+]?[\d.]+\s*\}?\s*\^|\*\*\s*\(?\s*[-+]?[\d.]+\s*\)?\s*\*\*")


class _NoTimeoutWarning(logging.Filter):
    """math-verify warns once that its timeout is off; here the pool's deadline replaces it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_NoTimeoutWarning())


@register_reward("math", mode="pool", deadline=5.0)
@requires("math_verify", "latex2sympy2_extended", "sympy", extra="rewards")
def math_equal(response: str, answer: Any, *, strict: bool = True, rel_tol: float = 1e-4, **meta: Any) -> RewardOutput:
    """1 if the final answer is mathematically equal to ``answer``, else 0.

    LLaVA-OV-1.5 ``reward/math.py``: ``verify(gold, parse(answer))`` with math-verify (string, LaTeX and
    expression extraction), and when that says no, a SymPy comparison (``is_equal``): both sides parsed
    from LaTeX, equal if ``simplify(a − b) = 0`` or, for numbers, |a − b| ≤ ``rel_tol`` · max(|a|, |b|).

    Accepted: the answer in ``<answer>…</answer>`` or ``\\boxed{…}`` (with ``strict=False`` also a final
    answer in plain prose). Equivalent forms agree: ``\\frac{1}{2}`` = ``0.5`` = ``50\\%``; intervals
    ``[1, 2)``; sets ``\\{1, 2\\}`` = ``\\{2, 1\\}``; ``x = 3`` = ``3``; units in ``\\text{}`` are dropped;
    choice letters (``B``). ``answer`` may be LaTeX or plain text. Several different boxes or a list of
    candidates (``3 or 4``) score 0. Needs the ``rewards`` extra (`MissingDependencyError` names the command).
    """
    ensure_dependencies(math_equal, "math")
    text = strip_special(response)
    candidate = final_answer(text)
    formatted = bool(tag_blocks(text, "answer") or boxed_contents(text))
    if candidate is None or not candidate or (strict and not formatted):
        return correct(False)
    gold = str(answer).strip()
    if len(candidate) > MAX_ANSWER_CHARS or _TOWER.search(candidate):
        return correct(_plain(candidate) == _plain(gold))
    return correct(_math_verify(gold, candidate if formatted else text, formatted) or _sympy_equal(gold, candidate, rel_tol))


def _plain(text: str) -> str:
    return "".join(text.split()).strip("$.").lower()


def _math_verify(gold: str, prediction: str, formatted: bool) -> bool:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    gold_parsed = _parse_gold(gold)
    if not gold_parsed:
        return False
    source = f"\\boxed{{{prediction.strip().strip('$')}}}" if formatted else prediction
    predicted = parse(source, extraction_config=[LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()],
                      parsing_timeout=None)
    return bool(predicted) and verify(gold_parsed, predicted, timeout_seconds=None)


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> list:
    """Ground truth parsed by math-verify: as LaTeX in ``$…$`` first, then as text (choice letters)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, StringExtractionConfig, parse

    latex = gold if "$" in gold or "\\boxed" in gold else f"${gold}$"
    parsed = parse(latex, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()], parsing_timeout=None)
    if not parsed:
        parsed = parse(gold, extraction_config=[StringExtractionConfig(), LatexExtractionConfig(), ExprExtractionConfig()],
                       parsing_timeout=None)
    return parsed


def _sympy_equal(gold: str, prediction: str, rel_tol: float) -> bool:
    """The seed's ``is_equal`` fallback: SymPy difference or numeric closeness of the two LaTeX forms."""
    import sympy
    from latex2sympy2_extended import latex2sympy

    try:
        a, b = latex2sympy(gold.strip("$")), latex2sympy(prediction.strip("$"))
        if not isinstance(a, sympy.Expr) or not isinstance(b, sympy.Expr):
            return False
        if not a.free_symbols and not b.free_symbols:
            x, y = complex(sympy.N(a, 30)), complex(sympy.N(b, 30))
            return abs(x - y) <= rel_tol * max(abs(x), abs(y), 1e-12)
        return sympy.simplify(a - b) == 0
    except Exception:  # unparsable or incomparable: not equal  # noqa: BLE001
        return False
