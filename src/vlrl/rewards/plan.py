"""Embodied action-plan rewards (the StepOPSD / 2505.22050 seed): JSON plan format and prefix accuracy.

The model writes one JSON object (``Output ONLY a valid JSON object``) with the fields
``visual_state_description``, ``reasoning_and_reflection``, ``language_plan`` and ``executable_plan``,
the last a list of steps ``{"action_id": 133, "action_name": "find a apple"}``. The JSON may sit in a
fenced block, inside prose, or be followed by special tokens (see `extract_json`); a bare list is read
as the executable plan. The seed composes ``overall = 0.8 · accuracy + 0.2 · format``:
``{"plan_prefix": 0.8, "json_plan": 0.2}``.

`locate_plan` reads the plan step by step with the character span of every ``action_id`` and
``action_name`` value, also from output cut off mid-plan (the complete steps before the cut) — what
step-level credit (`vlrl.algos.step_credit`) writes onto tokens. `plan_success` executes a plan in the
`embodied` suite's kitchen (`vlrl.rewards.kitchen.World`); `PLAN_JUDGE_TEMPLATE` is the seed's
verify-model prompt for the ``critic`` judge reward.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vlrl.rewards.base import RewardOutput, register_reward
from vlrl.rewards.extract import WINDOW, extract_json
from vlrl.rewards.kitchen import execute_plan

PLAN_FIELDS = ("visual_state_description", "reasoning_and_reflection", "language_plan", "executable_plan")


def plan_steps(value: Any) -> list[dict] | None:
    """The executable plan held by ``value``: a list of steps, a dict with ``executable_plan``, or the
    seed's wrapped ground truth ``{"input_text": "<json with executable_plan>"}``; None if none.
    Text whose JSON does not parse (cut off, malformed outside the plan) falls back to `locate_plan`:
    the complete steps it holds."""
    if isinstance(value, str):
        text, value = value, extract_json(value)
        if value is None:
            located = locate_plan(text)
            return [step.as_dict() for step in located.steps] if located is not None and located.steps else None
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
    """Prefix reward R(n; K) = n(n + 1) / (K(K + 1)) ∈ [0, 1] (2505.22050): n = the number of leading
    predicted steps equal to the gold steps (compared by ``match_key``: ``action_id`` or ``action_name``),
    K = max(k, m) for a gold plan of k steps and a predicted plan of m steps. Later steps weigh more, and a
    wrong step ends the credit.

    K = max(k, m), not the paper's k: the gold plan ends after k steps, so a predicted step k + 1, k + 2, …
    is a wrong step — the gold plan padded with "stop" to m steps, which no predicted step matches. With
    K = k a plan whose first steps match could append any number of steps for free (4,000 steps after a
    one-step gold plan scored 1.0); now a plan one step too long scores k / (k + 2) and a 4,000-step plan
    ≈ 0. For m ≤ k it is the paper's formula.

    ``answer``: the gold plan in any form `plan_steps` reads. ``accuracy`` = 1 if the predicted plan
    equals the gold plan (same steps, same length). Parts: ``prefix`` = n / K.
    """
    if match_key not in ("action_id", "action_name"):
        raise ValueError(f"plan_prefix: match_key must be 'action_id' or 'action_name', got {match_key!r}")
    gold = plan_steps(answer if not isinstance(answer, str) else _json_or_text(answer))
    if not gold:
        raise ValueError(f"plan_prefix: the answer holds no executable plan: {answer!r:.120}")
    if any(match_key not in step for step in gold):
        raise ValueError(f"plan_prefix: every gold step needs {match_key!r}: {gold!r:.120}")
    predicted = plan_steps(response) or []
    n = 0
    for pred, ref in zip(predicted, gold, strict=False):
        if match_key not in pred or _key(pred, match_key) != _key(ref, match_key):
            break
        n += 1
    k, m = len(gold), len(predicted)
    K = max(k, m)
    exact = n == k and m == k
    return RewardOutput(overall=n * (n + 1) / (K * (K + 1)), parts={"accuracy": float(exact), "prefix": n / K})


def _key(step: Mapping, match_key: str) -> str:
    return str(step.get(match_key, "")).strip().lower()


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


# ----------------------------------------------------------------------------------------------- step spans
@dataclass(frozen=True)
class PlanStep:
    """One step of a located plan: the parsed values and the character spans ``[start, end)`` of the values
    in the text (a string's span excludes its quotes), None where the step lacks the field."""

    action_id: Any
    action_name: Any
    id_span: tuple[int, int] | None
    name_span: tuple[int, int] | None
    span: tuple[int, int]  # the whole ``{...}`` object

    def as_dict(self) -> dict[str, Any]:
        out = {}
        if self.id_span is not None:
            out["action_id"] = self.action_id
        if self.name_span is not None:
            out["action_name"] = self.action_name
        return out


@dataclass(frozen=True)
class LocatedPlan:
    """The executable plan found in a text. ``complete``: the list was closed by ``]``; otherwise the text
    was cut off or a step was malformed, and ``steps`` holds the well-formed steps before that point."""

    steps: list[PlanStep]
    complete: bool
    start: int  # index of the plan's ``[``


_DECODER = json.JSONDecoder()
_MAX_CANDIDATES = 8  # plan keys (or bare lists) tried per text, from the last one back: bounded work
_PLAN_KEY = '"executable_plan"'


def locate_plan(text: str) -> LocatedPlan | None:
    """The ``executable_plan`` list of a response with the character spans of its steps' values, or None.

    Reads ``"executable_plan": [ {...}, ... ]`` wherever it sits (a JSON object, a fenced block, prose
    around it, special tokens after it) or, without that key, a bare list of step objects. The last
    occurrence holding at least one step wins (the one `extract_json` would also read when the JSON is
    whole). Steps are parsed one at a time with `json.JSONDecoder.raw_decode`, so a text cut off mid-plan,
    or a malformed step, yields the well-formed steps before it (``complete=False``). Each candidate costs
    one linear pass; at most `_MAX_CANDIDATES` are tried on the last `WINDOW` characters.
    """
    offset = max(0, len(text) - WINDOW)
    window = text[offset:]
    starts = _key_list_starts(window) or _bare_list_starts(window)
    best: LocatedPlan | None = None
    for start in reversed(starts[-_MAX_CANDIDATES:]):
        located = _scan_steps(window, start)
        if best is None:
            best = located
        if located.steps:
            best = located
            break
    if best is None:
        return None
    if offset:
        best = LocatedPlan([_shift(step, offset) for step in best.steps], best.complete, best.start + offset)
    return best


def _key_list_starts(text: str) -> list[int]:
    """Indices of the ``[`` after every ``"executable_plan":``."""
    out, pos = [], 0
    while True:
        at = text.find(_PLAN_KEY, pos)
        if at < 0:
            return out
        j = _skip_ws(text, at + len(_PLAN_KEY))
        if j < len(text) and text[j] == ":":
            j = _skip_ws(text, j + 1)
            if j < len(text) and text[j] == "[":
                out.append(j)
        pos = at + len(_PLAN_KEY)


def _bare_list_starts(text: str) -> list[int]:
    """Indices of every ``[`` directly followed (after blanks) by ``{`` — a bare list of steps."""
    out, pos = [], 0
    while True:
        at = text.find("[", pos)
        if at < 0:
            return out
        j = _skip_ws(text, at + 1)
        if j < len(text) and text[j] == "{":
            out.append(at)
        pos = at + 1


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _scan_steps(text: str, start: int) -> LocatedPlan:
    steps: list[PlanStep] = []
    i = start + 1
    while True:
        i = _skip_ws(text, i)
        if i >= len(text):
            return LocatedPlan(steps, False, start)
        if text[i] == "]":
            return LocatedPlan(steps, True, start)
        if text[i] == ",":
            i += 1
            continue
        step = _scan_step(text, i) if text[i] == "{" else None
        if step is None:
            return LocatedPlan(steps, False, start)
        steps.append(step)
        i = step.span[1]


def _scan_step(text: str, start: int) -> PlanStep | None:
    """One ``{...}`` step object at ``start``: its members parsed one by one, with value spans."""
    values: dict[str, Any] = {}
    spans: dict[str, tuple[int, int]] = {}
    i = start + 1
    while True:
        i = _skip_ws(text, i)
        if i >= len(text):
            return None
        if text[i] == "}":
            break
        if text[i] == ",":
            i += 1
            continue
        if text[i] != '"':
            return None
        try:
            key, i = _DECODER.raw_decode(text, i)
            i = _skip_ws(text, i)
            if i >= len(text) or text[i] != ":":
                return None
            value_start = _skip_ws(text, i + 1)
            value, i = _DECODER.raw_decode(text, value_start)
        except (ValueError, RecursionError):
            return None
        values[key] = value
        quoted = isinstance(value, str)
        spans[key] = (value_start + quoted, i - quoted)
    if "action_id" not in spans and "action_name" not in spans:
        return None
    return PlanStep(values.get("action_id"), values.get("action_name"), spans.get("action_id"),
                    spans.get("action_name"), (start, i + 1))


def _shift(step: PlanStep, offset: int) -> PlanStep:
    def move(span):
        return None if span is None else (span[0] + offset, span[1] + offset)

    return PlanStep(step.action_id, step.action_name, move(step.id_span), move(step.name_span), move(step.span))


# ----------------------------------------------------------------------------------------------- execution
@register_reward("plan_success")
def plan_success(response: str, answer: Any = None, *, scene: Mapping[str, Any] | None = None,
                 history: Sequence[int] = (), **meta: Any) -> RewardOutput:
    """Execution success ∈ {0, 1}: the predicted plan's ``action_id`` steps, run after ``history`` in the
    `embodied` kitchen ``scene`` (`vlrl.rewards.kitchen.execute_plan`), are all valid and reach the goal.

    Parts: ``accuracy`` (= success), ``valid_frac`` (steps executed before the first invalid one / plan
    length), ``step_acc`` (gold positions i with the same ``action_id`` / gold length, when ``answer`` holds
    the gold plan), ``parsed`` (a plan was found).
    """
    if scene is None:
        raise ValueError("plan_success: needs the embodied scene in the sample's metadata (metadata.scene)")
    predicted = plan_steps(response) or []
    parts = {"parsed": float(bool(predicted))}
    result = execute_plan(scene, [step.get("action_id") for step in predicted], history=history)
    success = float(result.success and bool(predicted))
    parts.update(accuracy=success, valid_frac=result.valid_steps / len(predicted) if predicted else 0.0)
    gold = plan_steps(answer if not isinstance(answer, str) else _json_or_text(answer)) if answer is not None else None
    if gold:
        hits = sum(_key(p, "action_id") == _key(g, "action_id") for p, g in zip(predicted, gold, strict=False))
        parts["step_acc"] = hits / len(gold)
    return RewardOutput(overall=success, parts=parts)


PLAN_JUDGE_TEMPLATE = (
    "Sentence 1: {answer}\n"
    "Sentence 2: {response}\n"
    "You are judging whether a predicted embodied action trajectory (Sentence 2) matches the ground-truth "
    "trajectory (Sentence 1) at the intent level. Focus on FUNCTIONAL EQUIVALENCE. Compare mainly by "
    "action_name, not exact action_id. Be lenient about extra or missing find steps. Only output: True or False."
)
"""The embodied seed's verify-model prompt, for ``JudgeReward(engine, template=PLAN_JUDGE_TEMPLATE)`` and the
``critic`` reward (``{"critic": 0.8, "json_plan": 0.2}``, the seed's 0.8 · verify + 0.2 · format)."""
