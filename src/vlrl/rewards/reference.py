"""Can a sample ever score? Its reference answer, given to its own verifier as a perfect response.

A ground truth the verifier cannot read (``answer: "seven"`` with ``number``, a box with three numbers,
``"green"`` where ``multiple_choice`` wants a letter) makes every response score 0 — for ever, silently.
`unscorable_answer` finds those before training: each named verifier that judges correctness (it reports an
``accuracy`` part) and runs inline (bounded cost; pool and judge verifiers are not run here) scores the
sample's own reference response and the answer written as ``<answer>…</answer>``; if none of them counts as
correct, the sample can never be right.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from vlrl.rewards.base import as_output, get_reward, reward_weights, spec_of


def unscorable_answer(answer: Any, reward: str | Mapping[str, float], metadata: Mapping[str, Any],
                      response: str | None = None) -> str | None:
    """Why ``answer`` can never score as correct on its verifier(s), or None when it can (or cannot be told).

    Candidates: ``response`` (the sample's reference response, if any), ``<answer>{answer}</answer>`` and
    the bare answer (a non-string answer as JSON: a plan verifier reads the whole response), and for a list
    of accepted strings its first one. A verifier passes when
    one candidate has accuracy ≥ 0.5. User verifiers given as dotted paths are not run: their answer format
    is theirs to define."""
    candidates = _candidates(answer, response)
    for name in reward_weights(reward):
        if ":" in name or spec_of(name).mode != "inline":
            continue
        verifier = get_reward(name)
        best, reported = 0.0, False
        for candidate in candidates:
            try:
                output = as_output(verifier(candidate, answer, **metadata))
            except Exception as err:  # scoring would raise in training too (and fall back to 0)
                return f"verifier {name!r} raises on this sample ({type(err).__name__}: {err})"
            if output.accuracy is None:
                break  # a verifier of something else than correctness (format, length): nothing to check
            reported, best = True, max(best, output.accuracy)
        if reported and best < 0.5:
            return (f"answer {_short(answer)} can never score on verifier {name!r}: given as the response "
                    f"{_plain(answer)!r} it scores accuracy {best:g} ({_doc(verifier)})")
    return None


def _text(answer: Any) -> str:
    return answer if isinstance(answer, str) else json.dumps(answer)


def _plain(answer: Any) -> str:
    return f"<answer>{_text(answer)}</answer>"


def _candidates(answer: Any, response: str | None) -> list[str]:
    out = [_plain(answer), _text(answer)]  # bare: what verifiers reading JSON from the whole response want
    if isinstance(answer, (list, tuple)) and answer and isinstance(answer[0], str):
        out.append(f"<answer>{answer[0]}</answer>")
    if response is not None:
        out.insert(0, response)
    return out


def _short(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _doc(fn: Any) -> str:
    """The verifier's one-line description (its docstring's first line)."""
    lines = (getattr(fn, "__doc__", None) or "").strip().splitlines()
    return lines[0].rstrip(".").replace("``", "") if lines else "see its docstring"
