import json

import pytest

from vlrl.rewards import compose, get_reward

STEPS = [{"action_id": 3, "action_name": "find apple"}, {"action_id": 7, "action_name": "pick up apple"},
         {"action_id": 9, "action_name": "put down apple"}]
FULL = {"visual_state_description": "a table", "reasoning_and_reflection": "r", "language_plan": "p",
        "executable_plan": STEPS}


def _response(plan):
    return "Here is my plan:\n```json\n" + json.dumps(plan) + "\n```<|im_end|>"


def test_json_plan_format():
    fmt = get_reward("json_plan")
    assert fmt(_response(FULL)).overall == 1.0
    missing = {k: v for k, v in FULL.items() if k != "language_plan"}
    out = fmt(_response(missing))
    assert out.overall == 0.0 and out.parts == {"parse_ok": 1.0, "fields_ok": 0.0, "actions_ok": 1.0}
    bad_step = {**FULL, "executable_plan": [{"action_id": "3", "action_name": "find apple"}]}
    assert fmt(_response(bad_step)).overall == 0.0  # action_id must be an integer
    assert fmt("not json at all").parts["parse_ok"] == 0.0
    actions = {3: "find apple", 7: "pick up apple", 9: "put down apple"}
    assert fmt(_response(FULL), actions=actions).overall == 1.0
    wrong_name = {**FULL, "executable_plan": [{"action_id": 3, "action_name": "pick up apple"}]}
    assert fmt(_response(wrong_name), actions=actions).overall == 0.0


@pytest.mark.parametrize("predicted,expected", [
    (STEPS, 1.0),  # n = 3: 3·4 / (3·4)
    (STEPS[:2] + [{"action_id": 1, "action_name": "x"}], 0.5),  # n = 2: 2·3 / 12
    ([STEPS[0], STEPS[2], STEPS[1]], 1 / 6),  # n = 1: 1·2 / 12
    ([STEPS[1]] + STEPS, 0.0),  # wrong first step ends the credit
    (STEPS + STEPS, 1.0),  # the full prefix, plus extra steps
])
def test_plan_prefix_by_hand(predicted, expected):
    out = get_reward("plan_prefix")(_response({**FULL, "executable_plan": predicted}), {"executable_plan": STEPS})
    assert out.overall == pytest.approx(expected)


def test_plan_prefix_accuracy_and_answer_forms():
    prefix = get_reward("plan_prefix")
    assert prefix(_response(STEPS), STEPS).parts == {"accuracy": 1.0, "prefix": 1.0}  # bare list
    assert prefix(_response(STEPS + STEPS), STEPS).parts["accuracy"] == 0.0  # extra steps: not the plan
    wrapped = {"action": "x", "input_text": json.dumps({"executable_plan": STEPS})}  # the seed's ground truth
    assert prefix(_response(FULL), json.dumps(wrapped)).overall == 1.0
    by_name = [dict(s, action_id=0) for s in STEPS]
    assert prefix(_response(by_name), STEPS, match_key="action_name").overall == 1.0
    with pytest.raises(ValueError, match="no executable plan"):
        prefix(_response(FULL), "nothing")


def test_embodied_seed_composition():
    # overall = 0.8 · R(2; 3) + 0.2 · format = 0.8 · 0.5 + 0.2 · 1
    plan = {**FULL, "executable_plan": STEPS[:2]}
    out = compose(_response(plan), STEPS, {"plan_prefix": 0.8, "json_plan": 0.2}, {})
    assert out.overall == pytest.approx(0.6)
