"""`unscorable_answer`: a reference answer its own verifier scores as wrong is found before training."""

import pytest

from vlrl.data import generate
from vlrl.rewards.reference import unscorable_answer


@pytest.mark.parametrize("answer, reward, meta", [
    ("seven", "number", {}),                                       # not a number
    ("green", "multiple_choice", {"options": {"A": "red", "B": "green"}}),  # the option text, not its letter
    ("maybe", "bool", {}),                                         # no polarity
    ([1, 2, 3], "bbox_iou", {}),                                   # three coordinates
    ("seven", {"number": 0.8, "answer_format": 0.2}, {}),          # inside a weighted reward
])
def test_unscorable_answers_are_named(answer, reward, meta):
    message = unscorable_answer(answer, reward, meta)
    assert message and "can never score on verifier" in message and "accuracy 0" in message


@pytest.mark.parametrize("answer, reward, meta", [
    ("7", "number", {}), (7, "number", {}), ("1,000", "number", {}), ("B", "multiple_choice", {}),
    ("yes", "bool", {}), (True, "bool", {}), ([1, 2, 30, 40], "bbox_iou", {}), (["cat", "kitten"], "string_match", {}),
    ("hello", "ocr", {}),
    ("anything", "answer_format", {}),  # checks the format, not the answer: nothing to verify
    ("x^2", "math", {}),  # a pool verifier (SymPy): not run by the check
    ("seven", "pkg.mod:fn", {}),  # a user's verifier: its answer format is its own
])
def test_scorable_or_unchecked_answers_pass(answer, reward, meta):
    assert unscorable_answer(answer, reward, meta) is None


def test_the_reference_response_counts():
    # "seven" cannot score on `number` as an answer, but a reference response of 7 does not make it scorable:
    # the check is about the ground truth, whichever candidate is tried
    assert unscorable_answer("seven", "number", {}, "<answer>7</answer>") is not None
    # a plan verifier reads JSON from the whole response: an RL sample without a reference response passes
    # on the bare plan; one whose gold plan does not reach the goal in its scene is caught
    sample = generate("embodied", 1, split="test", tasks=["pick_place"])[0]
    assert unscorable_answer(sample.answer, sample.reward, sample.metadata, None) is None
    assert unscorable_answer(sample.answer[:-1], sample.reward, sample.metadata, None) is not None


@pytest.mark.parametrize("suite, tasks", [("shapes", ["count", "color", "locate", "ocr"]), ("arith", None),
                                          ("embodied", ["pick_place", "clean", "cool", "heat", "pick_two"])])
def test_no_procedural_sample_is_flagged(suite, tasks):
    for sample in generate(suite, 40, split="train", tasks=tasks):
        assert unscorable_answer(sample.answer, sample.reward, sample.metadata, sample.response) is None, sample.id
        assert unscorable_answer(sample.answer, sample.reward, sample.metadata, None) is None, sample.id  # RL data
