"""Embodied action-plan rewards (the StepOPSD / 2505.22050 seed): JSON plan format and prefix accuracy.

The model writes one JSON object (``Output ONLY a valid JSON object``) with the fields
``visual_state_description``, ``reasoning_and_reflection``, ``language_plan`` and ``executable_plan``,
the last a list of steps ``{"action_id": 133, "action_name": "find a apple"}``. The JSON may sit in a
fenced block, inside prose, or be followed by special tokens (see `extract_json`); a bare list is read
as the executable plan. The seed composes ``overall = 0.8 · accuracy + 0.2 · format``:
``{"plan_prefix": 0.8, "json_plan": 0.2}``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from vlrl.rewards.base import RewardOutput, register_reward
from vlrl.rewards.extract import extract_json

PLAN_FIELDS = ("visual_state_description", "reasoning_and_reflection", "language_plan", "executable_plan")


def plan_steps(value: Any) -> list[dict] | None:
    """The executable plan held by ``value``: a list of steps, a dict with ``executable_plan``, or the
    seed's wrapped ground truth ``{"input_text": "<json with executable_plan>"}``; None if none."""
    if isinstance(value, str):
        value = extract_json(value)
    if isinstance(value, Mapping):
        if "executable_plan" in value:
            value = value["executable_plan"]
        elif isinstance(value.get("input_text"), str):
            return plan_steps(value["input_text"])
    if isinstance(value, list) and all(isinstance(step, Mapping) for step in value):
        return [dict(step) for step in value]
    return None


def _valid_step(step: Mapping, actions: Mapping[int, str] | Sequence[str] | None) -> bool:
    action_id, name = step.get("action_id"), step.get("action_name")
    if not isinstance(action_id, int) or isinstance(action_id, bool) or not isinstance(name, str):
        return False
    if actions is None:
        return True
    table = dict(enumerate(actions)) if isinstance(actions, (list, tuple)) else {int(k): v for k, v in actions.items()}
    return table.get(action_id) is not None and table[action_id].strip().lower() == name.strip().lower()


@register_reward("json_plan")
def json_plan(response: str, answer: Any = None, *, actions: Mapping[int, str] | Sequence[str] | None = None,
              required_fields: Sequence[str] = PLAN_FIELDS, **meta: Any) -> RewardOutput:
    """R_format ∈ {0, 1}: 1 if the response's JSON parses, holds every required field, and its
    ``executable_plan`` is a non-empty list of steps with an integer ``action_id`` and a string
    ``action_name`` — matching each other in ``actions`` (a list of names indexed by id, or an id→name
    mapping) when given. 2505.22050's format reward; the seed's ``format = 1.0 if JSON parse ok``.
    Parts: ``parse_ok``, ``fields_ok``, ``actions_ok``.
    """
    value = extract_json(response)
    parse_ok = isinstance(value, Mapping)
    fields_ok = parse_ok and all(f in value for f in required_fields)
    steps = plan_steps(value) if parse_ok else None
    actions_ok = bool(steps) and all(_valid_step(s, actions) for s in steps)
    overall = float(parse_ok and fields_ok and actions_ok)
    return RewardOutput(overall=overall, parts={"parse_ok": float(parse_ok), "fields_ok": float(fields_ok),
                                                "actions_ok": float(actions_ok)})


@register_reward("plan_prefix")
def plan_prefix(response: str, answer: Any, *, match_key: str = "action_id", **meta: Any) -> RewardOutput:
    """Prefix reward R(n; k) = n(n + 1) / (k(k + 1)) ∈ [0, 1] (2505.22050): n = the number of leading
    predicted steps equal to the gold steps (compared by ``match_key``: ``action_id`` or ``action_name``),
    k = the gold plan's length. Later steps weigh more, and a wrong step ends the credit.

    ``answer``: the gold plan in any form `plan_steps` reads. ``accuracy`` = 1 if the predicted plan
    equals the gold plan (same steps, same length). Parts: ``prefix`` = n / k.
    """
    if match_key not in ("action_id", "action_name"):
        raise ValueError(f"plan_prefix: match_key must be 'action_id' or 'action_name', got {match_key!r}")
    gold = plan_steps(answer if not isinstance(answer, str) else _json_or_text(answer))
    if not gold:
        raise ValueError(f"plan_prefix: the answer holds no executable plan: {answer!r:.120}")
    if any(match_key not in step for step in gold):
        raise ValueError(f"plan_prefix: every gold step needs {match_key!r}: {gold!r:.120}")
    predicted = plan_steps(extract_json(response)) or []
    n = 0
    for pred, ref in zip(predicted, gold, strict=False):
        if match_key not in pred or _key(pred, match_key) != _key(ref, match_key):
            break
        n += 1
    k = len(gold)
    exact = n == k and len(predicted) == k
    return RewardOutput(overall=n * (n + 1) / (k * (k + 1)), parts={"accuracy": float(exact), "prefix": n / k})


def _key(step: Mapping, match_key: str) -> str:
    return str(step.get(match_key, "")).strip().lower()


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text
