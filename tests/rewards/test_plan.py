import json
from types import SimpleNamespace

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
    (STEPS + STEPS, 2 / 7),  # the full prefix, then 3 wrong steps past the gold's end: K = 6, 3·4 / (6·7)
    (STEPS + STEPS[:1], 3 / 5),  # one step too many: K = 4, 3·4 / (4·5) = k / (k + 2)
])
def test_plan_prefix_by_hand(predicted, expected):
    out = get_reward("plan_prefix")(_response({**FULL, "executable_plan": predicted}), {"executable_plan": STEPS})
    assert out.overall == pytest.approx(expected)


def test_plan_prefix_does_not_pay_for_a_long_plan_behind_a_matching_first_step():
    """Issue 22: a 4,000-step plan whose first step matches a one-step gold plan scored 1.0. Now K = 4000:
    R = 1·2 / (4000·4001) = 1.25e-7."""
    gold = STEPS[:1]
    long_plan = STEPS[:1] + [STEPS[1]] * 3999
    out = get_reward("plan_prefix")(_response({**FULL, "executable_plan": long_plan}), gold)
    assert out.overall == pytest.approx(2 / (4000 * 4001)) and out.parts == {"accuracy": 0.0, "prefix": 1 / 4000}
    assert get_reward("plan_prefix")(_response({**FULL, "executable_plan": gold}), gold).overall == 1.0


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


# ----------------------------------------------------------------------------------------------- locate_plan
STEP_TEXT = '{"action_id": 3, "action_name": "find apple"}, {"action_id": 7, "action_name": "pick up apple"}'


def _values(text, located):
    return [(text[s.id_span[0]:s.id_span[1]], text[s.name_span[0]:s.name_span[1]]) for s in located.steps]


@pytest.mark.parametrize("text", [
    '{"visual_state_description": "a", "executable_plan": [' + STEP_TEXT + ']}',  # plain JSON
    'Plan:\n```json\n{"executable_plan": [' + STEP_TEXT + ']}\n```\nDone.<|im_end|>',  # fenced, prose, special token
    'I think {"language_plan": "x", "executable_plan": [' + STEP_TEXT + ']} is it<|endoftext|>',  # prose around
    '[' + STEP_TEXT + ']',  # a bare list
    '{"executable_plan" :\n [ ' + STEP_TEXT.replace(", ", " ,\n ") + ' ] }',  # odd whitespace
])
def test_locate_plan_finds_every_step_and_its_value_spans(text):
    located = get_located(text)
    assert located.complete
    assert _values(text, located) == [("3", "find apple"), ("7", "pick up apple")]
    assert [s.action_id for s in located.steps] == [3, 7]


def get_located(text):
    from vlrl.rewards.plan import locate_plan

    located = locate_plan(text)
    assert located is not None
    return located


def test_locate_plan_keeps_the_steps_before_a_cut_or_a_malformed_step():
    cut = '{"visual_state_description": "a", "executable_plan": [' + STEP_TEXT + ', {"action_id": 9, "action_na'
    located = get_located(cut)
    assert not located.complete and [s.action_id for s in located.steps] == [3, 7]
    broken = '{"executable_plan": [' + STEP_TEXT + ', {"action_id": 9, "action_name": put down}, {"action_id": 1}]}'
    located = get_located(broken)
    assert not located.complete and [s.action_id for s in located.steps] == [3, 7]  # the rest is unreadable
    # a JSON error outside the plan (here an unquoted value before it) does not matter
    sloppy = '{"visual_state_description": fridge closed, "executable_plan": [' + STEP_TEXT + ']}'
    assert [s.action_name for s in get_located(sloppy).steps] == ["find apple", "pick up apple"]
    # escaped characters in a name: the span covers the raw text between the quotes
    escaped = '[{"action_id": 2, "action_name": "say \\"hi\\""}]'
    step = get_located(escaped).steps[0]
    assert step.action_name == 'say "hi"' and escaped[step.name_span[0]:step.name_span[1]] == 'say \\"hi\\"'


def test_locate_plan_without_a_plan():
    from vlrl.rewards.plan import locate_plan

    assert locate_plan("no plan here") is None
    assert locate_plan('{"executable_plan": "none"}') is None
    empty = locate_plan('{"executable_plan": []}')
    assert empty is not None and empty.steps == [] and empty.complete
    # the last plan holding steps wins (a model that restates its plan)
    text = '{"executable_plan": [{"action_id": 1, "action_name": "a"}]} again: {"executable_plan": [' + STEP_TEXT + ']}'
    assert [s.action_id for s in locate_plan(text).steps] == [3, 7]


def test_plan_prefix_reads_a_cut_off_plan():
    # extract_json fails on the cut text; the located complete steps still earn their prefix: n = 2 of k = 3
    cut = '{"executable_plan": [' + json.dumps(STEPS[0]) + ", " + json.dumps(STEPS[1]) + ', {"action_id": 9, "act'
    assert get_reward("plan_prefix")(cut, STEPS).overall == pytest.approx(0.5)
    assert get_reward("json_plan")(cut).overall == 0.0  # but its format is wrong


# ----------------------------------------------------------------------------------------------- execution, judge
def _embodied(task, **options):
    from vlrl.data import generate

    return next(s for s in generate("embodied", 20, seed=5, history_prob=0.0, **options) if s.task == f"embodied/{task}")


def test_plan_success_executes_the_plan():
    sample = _embodied("heat")
    success = get_reward("plan_success")
    out = success(sample.response, sample.answer, **sample.metadata)
    assert out.overall == 1.0 and out.parts == {"parsed": 1.0, "accuracy": 1.0, "valid_frac": 1.0, "step_acc": 1.0}
    # without switching the microwave on and off every step is still valid, but nothing is heated
    plan = [s for s in sample.answer if not s["action_name"].startswith("turn o")]
    out = success(json.dumps({"executable_plan": plan}), sample.answer, **sample.metadata)
    assert out.overall == 0.0 and out.parts["valid_frac"] == 1.0
    # starting with "pick up" (not at the object yet) fails on the first step
    out = success(json.dumps([sample.answer[1], sample.answer[0]]), sample.answer, **sample.metadata)
    assert out.parts["valid_frac"] == 0.0 and out.parts["step_acc"] == 0.0
    assert success("garbage", sample.answer, **sample.metadata).parts == {"parsed": 0.0, "accuracy": 0.0,
                                                                           "valid_frac": 0.0, "step_acc": 0.0}
    with pytest.raises(ValueError, match="metadata.scene"):
        success(sample.response, sample.answer)


def test_plan_judge_template_through_the_engine_protocol():
    from vlrl.rewards import RewardExecutor, RewardItem
    from vlrl.rewards.plan import PLAN_JUDGE_TEMPLATE
    from vlrl.rollout.judge import JudgeReward

    from .fakes import FakeJudgeEngine

    class PlanJudge(FakeJudgeEngine):  # says True when the predicted plan names the same actions
        def generate(self, requests, sampling):
            out = []
            for r in requests:
                prompt = r.sample.messages[0]["content"]
                self.prompts.append(prompt)
                gold = prompt.split("Sentence 1: ")[1].split("\nSentence 2: ")[0]
                pred = prompt.split("Sentence 2: ")[1].split("\nYou are judging")[0]
                names = [s["action_name"] for s in STEPS]
                verdict = all(n in pred for n in names) and all(n in gold for n in names)
                out.append(SimpleNamespace(response_text=str(verdict), behaviour_logp=[0.0]))
            return out

    engine = PlanJudge()
    judge = JudgeReward(engine, template=PLAN_JUDGE_TEMPLATE)
    weights = {"critic": 0.8, "json_plan": 0.2}
    items = [RewardItem(_response(FULL), STEPS, weights), RewardItem(_response({**FULL, "executable_plan": STEPS[:1]}), STEPS, weights)]
    with RewardExecutor(workers=1, judge=judge) as executor:
        outputs, report = executor.score(items)
    assert [o.overall for o in outputs] == pytest.approx([1.0, 0.2])  # 0.8 · verdict + 0.2 · format
    assert "FUNCTIONAL EQUIVALENCE" in engine.prompts[0] and "Only output: True or False" in engine.prompts[0]
    assert not report.failures
