import json

import pytest

from vlrl.data import generate
from vlrl.data.tasks.embodied import (
    ACTION_IDS,
    ACTIONS,
    HAND_CELL,
    OPENABLE,
    RECEPTACLE_COLORS,
    TASKS,
    Scene,
    World,
    draw_state,
    execute_plan,
    gold_plan,
    parse_action,
    with_reference,
)
from vlrl.rewards import compose


def _samples(n=150, **options):
    return generate("embodied", n, split="test", seed=11, **options)


def test_action_table_is_fixed_and_parsed():
    assert len(ACTIONS) == 30 and ACTIONS[0] == "find a apple" and ACTIONS[19] == "put down the object in hand"
    assert parse_action(ACTION_IDS["pick up the mug"]) == ("pick up", "mug")
    assert parse_action(ACTION_IDS["turn off the faucet"]) == ("turn off", "faucet")
    assert parse_action(19) == ("put", "")
    for bad in (-1, 30, "3", True, None):
        with pytest.raises(KeyError):
            parse_action(bad)


def test_every_gold_plan_succeeds_and_horizons_grow():
    lengths = {task: set() for task in TASKS}
    for sample in _samples(history_prob=0.5):
        meta = sample.metadata
        result = execute_plan(meta["scene"], [s["action_id"] for s in sample.answer], history=meta["history"])
        assert result.success and result.first_error is None, (sample.id, result)
        assert meta["gold_steps"] == len(sample.answer)
        if not meta["history"]:
            lengths[sample.task.split("/")[1]].add(len(sample.answer))
    # pick_place 4 or 6 (a closed destination adds open + close); the treated tasks are longer
    assert lengths["pick_place"] <= {4, 6} and max(lengths["pick_place"]) < min(lengths["heat"])
    assert all(lengths[t] for t in TASKS)


def _insert(plan, at, action):
    return plan[:at] + [action] + plan[at:]


def test_perturbed_plans_fail_at_the_right_step():
    for sample in _samples(60, history_prob=0.0):
        scene = Scene.from_json(sample.metadata["scene"])
        plan = gold_plan(scene)
        # a second "pick up" right after one: the hand is full → fails exactly there
        for k, action in enumerate(plan):
            if ACTIONS[action].startswith("pick up"):
                result = execute_plan(scene, _insert(plan, k + 1, action))
                assert (result.success, result.first_error, result.valid_steps) == (False, k + 1, k + 1)
                assert "already holds" in result.error
        # opening what was just opened: "already open"
        for k, action in enumerate(plan):
            if ACTIONS[action].startswith("open"):
                result = execute_plan(scene, _insert(plan, k + 1, action))
                assert result.first_error == k + 1 and "already open" in result.error
        # an unknown id anywhere
        for k in (0, len(plan) // 2, len(plan) - 1):
            assert execute_plan(scene, _insert(plan, k, 99)).first_error == k
        # the last "put down" missing: every step valid, the goal not reached
        last_put = max(k for k, a in enumerate(plan) if ACTIONS[a].startswith("put down"))
        result = execute_plan(scene, plan[:last_put] + plan[last_put + 1:])
        assert not result.success and result.first_error is None and result.error == "goal not reached"


def test_world_rules_by_hand():
    scene = Scene(task="heat", objects={"egg": "table"}, targets=["egg"], destination="counter",
                  open={"fridge": False, "microwave": False, "cabinet": True},
                  cells={"table": 0, "counter": 1, "shelf": 2, "fridge": 3, "microwave": 4, "cabinet": 5, "sink": 6})
    world = World.start(scene)
    step = lambda name: world.step(ACTION_IDS[name])  # noqa: E731
    assert step("pick up the egg") == "the robot is not at the egg"
    assert step("find a egg") is None and step("pick up the egg") is None
    assert step("find a microwave") is None
    assert step("put down the object in hand") == "the microwave is closed"
    assert step("turn on the faucet") == "the robot is not at the sink"
    assert step("open the microwave") is None and step("put down the object in hand") is None
    assert step("turn on the microwave") == "close the microwave before turning it on"
    assert step("close the microwave") is None and step("turn on the microwave") is None
    assert "egg" in world.hot
    assert step("open the microwave") == "turn off the microwave before opening it"
    assert step("find a egg") == "the egg is not visible (inside the closed microwave)"


def test_image_shows_doors_hand_and_objects():
    for sample in _samples(20, history_prob=0.5):
        scene = Scene.from_json(sample.metadata["scene"])
        world = World.start(scene)
        for action_id in sample.metadata["history"]:
            world.step(action_id)
        image = sample.images[0]
        assert image.size == (112, 112) and image.tobytes() == draw_state(world).tobytes()
        for receptacle in OPENABLE:
            index = scene.cells[receptacle]
            x, y = (index % 4) * 28, (index // 4) * 28
            centre = image.getpixel((x + 14, y + 14))
            # closed: filled with the receptacle's colour; open: hollow (white inside, unless an object sits there)
            if world.opened[receptacle]:
                assert centre != RECEPTACLE_COLORS[receptacle]
            else:
                assert centre == RECEPTACLE_COLORS[receptacle]
        hx, hy = (HAND_CELL % 4) * 28, (HAND_CELL // 4) * 28
        held = image.getpixel((hx + 9, hy + 9))  # the first object slot of the hand cell
        assert (held == (255, 255, 255)) == (world.holding is None)


def test_prompt_lists_valid_actions_and_history():
    sample = next(s for s in _samples(40, history_prob=1.0) if s.metadata["history"])
    text = sample.prompt_text()
    assert "Instruction: " in text and "History: " + ACTIONS[sample.metadata["history"][0]] in text
    for action_id, name in sample.metadata["actions"].items():
        assert f"{action_id} {name}" in text
    plain = _samples(5, list_actions=False)[0]
    assert "Actions:" not in plain.prompt_text()
    response = json.loads(sample.response)
    assert list(response) == ["visual_state_description", "reasoning_and_reflection", "language_plan", "executable_plan"]
    assert compose(sample.response, sample.answer, {"plan_prefix": 0.8, "json_plan": 0.2}, sample.metadata).overall == 1.0


def test_reference_context():
    sample = _samples(1)[0]
    messages = with_reference(sample.messages, sample.answer)
    assert messages[0]["content"][-1]["text"].startswith("\nHere is a reference successful plan: [{")
    assert len(sample.messages[0]["content"]) == 2  # the input is not modified
    with_ref = generate("embodied", 40, seed=3, reference_prob=0.5)
    assert 5 < sum("reference successful plan" in s.prompt_text() for s in with_ref) < 35
    held_out = generate("embodied", 40, split="test", seed=3, reference_prob=0.5)
    assert not any("reference successful plan" in s.prompt_text() for s in held_out)


def test_bad_options_name_the_option():
    with pytest.raises(ValueError, match="unknown task"):
        generate("embodied", 1, tasks=["juggle"])
    with pytest.raises(ValueError, match="history_prob"):
        generate("embodied", 1, history_prob=2.0)
    with pytest.raises(ValueError, match="max_distractors"):
        generate("embodied", 1, max_distractors=5)
    with pytest.raises(ValueError, match="unknown task"):
        Scene.from_json({"task": "fly", "objects": {}, "targets": [], "destination": "", "open": {}, "cells": {}})
    with pytest.raises(ValueError, match="history step 0"):
        execute_plan(_samples(1)[0].metadata["scene"], [], history=[ACTION_IDS["put down the object in hand"]])
