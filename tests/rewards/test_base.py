import json
import math

import pytest

from vlrl.registry import RegistryError
from vlrl.rewards import REWARDS, RewardOutput, RewardSpec, compose, register_reward, spec_of
from vlrl.rewards.probes import CODE_TESTS, OPTIONS, PLAN, REF_HTML, REF_SVG
from vlrl.rollout.judge import JudgeReward

from .fakes import FakeJudgeEngine

# One valid (response, answer, meta) per registered verifier: the contract test covers every entry, so
# registering a new verifier without adding it here fails loudly.
CONTRACT = {
    "none": ("anything", None, {}),  # no verifier (OPD alone): 0 always, its range [0, 0]
    "number": ("<answer>3</answer>", "3", {}),
    "multiple_choice": ("<answer>B</answer>", "B", {"options": OPTIONS}),
    "bool": ("<answer>yes</answer>", "yes", {}),
    "string_match": ("<answer>paris</answer>", "Paris", {}),
    "ocr": ("<answer>hello</answer>", "hello", {}),
    "math": ("\\boxed{\\frac{1}{2}}", "0.5", {}),
    "bbox_iou": ("<answer>[0, 0, 10, 10]</answer>", [0, 0, 10, 10], {}),
    "ovd_map": ('[{"bbox_2d": [0, 0, 10, 10], "label": "cat"}]', [{"bbox_2d": [0, 0, 10, 10], "label": "cat"}], {}),
    "html": (REF_HTML, REF_HTML, {}),
    "svg": (REF_SVG, REF_SVG, {}),
    "code": ("```python\na, b = map(int, input().split())\nprint(a + b)\n```", CODE_TESTS,
             {"timeout": 2.0, "time_budget": 6.0}),
    "format": ("<think>a</think><answer>b</answer>", None, {}),
    "answer_format": ("<answer>b</answer>", None, {}),
    "cot_format": ("<think>" + "x" * 30 + "</think>\\boxed{1}", None, {}),
    "json_plan": ('{"visual_state_description": "", "reasoning_and_reflection": "", "language_plan": "", '
                  '"executable_plan": [{"action_id": 3, "action_name": "find apple"}]}', None, {}),
    "plan_prefix": (json.dumps(PLAN), PLAN, {}),
    "plan_success": (json.dumps([{"action_id": 0, "action_name": "find a apple"},
                                 {"action_id": 13, "action_name": "pick up the apple"},
                                 {"action_id": 7, "action_name": "find a counter"},
                                 {"action_id": 19, "action_name": "put down the object in hand"}]), None,
                     {"scene": {"task": "pick_place", "objects": {"apple": "table"}, "targets": ["apple"],
                                "destination": "counter", "open": {"fridge": False, "microwave": False, "cabinet": False},
                                "cells": {"table": 0, "counter": 1, "shelf": 2, "fridge": 3, "microwave": 4,
                                          "cabinet": 5, "sink": 6}}}),
    "overlong": ("x", None, {"max_length": 10, "cache_length": 5, "response_length": 3}),
    "critic": ("7", "7", {"judge": JudgeReward(FakeJudgeEngine())}),
    "syn_format": ("<think>t</think><diversity>0.5</diversity><description>grass</description><answer>b</answer>", None, {}),
}


def test_every_registered_reward_honours_the_contract():
    """f(response, answer, **meta) -> float | RewardOutput, finite, within its spec's range, on a correct
    answer and on garbage; a correct answer earns the top of the range (overlong: 0 = no penalty).
    Verifiers registered elsewhere (other tests, plug-ins) are held to the first part on garbage."""
    builtin = {name for name, fn in REWARDS.items() if fn.__module__.startswith("vlrl.rewards")}
    assert builtin == set(CONTRACT), "add the new verifier to CONTRACT"
    for name, fn in REWARDS.items():
        spec = spec_of(name)
        response, answer, meta = CONTRACT.get(name, ("<answer>1</answer>", "1", {}))
        for text in (response, "", "garbage " * 50):
            out = fn(text, answer, **meta)
            value = out.overall if isinstance(out, RewardOutput) else out
            assert isinstance(value, float) and math.isfinite(value), name
            assert spec.low <= value <= spec.high, (name, value)
        if name in CONTRACT:
            best = fn(response, answer, **meta)
            assert (best.overall if isinstance(best, RewardOutput) else best) == pytest.approx(spec.high), name


def test_specs_say_where_verifiers_run():
    assert spec_of("number").mode == "inline" and spec_of("math").mode == "pool" and spec_of("code").mode == "pool"
    assert spec_of("critic").mode == "judge" and (spec_of("overlong").low, spec_of("overlong").high) == (-1.0, 0.0)
    assert spec_of("tests.rewards.test_base:plain_user_reward") == RewardSpec()  # no spec: inline, 1 s


def plain_user_reward(response, answer, **meta):
    return 1.0


def test_duplicate_registration_is_rejected():
    with pytest.raises(RegistryError, match="already registered"):
        register_reward("number")(plain_user_reward)


def test_compose_weighted_sum_and_accuracy():
    # 0.8 · number + 0.2 · format
    out = compose("<think>t</think><answer>3</answer>", "3", {"number": 0.8, "format": 0.2}, {})
    assert out.overall == pytest.approx(1.0)
    assert out.parts == {"number": 1.0, "number/accuracy": 1.0, "format": 1.0, "accuracy": 1.0}
    out = compose("<answer>4</answer>", "3", {"number": 0.8, "format": 0.2}, {})
    assert out.overall == pytest.approx(0.0) and out.parts["accuracy"] == 0.0
    # accuracy = weight-normalised mean of the accuracies reported: (0.5·1 + 0.25·0) / 0.75
    out = compose("<answer>3</answer>", "3", {"number": 0.5, "multiple_choice": 0.25, "answer_format": 0.25}, {})
    assert out.parts["accuracy"] == pytest.approx(2 / 3)
