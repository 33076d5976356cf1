import pytest

from vlrl.rewards import REWARDS, RewardOutput, compose, extract_answer, get_reward
from vlrl.rewards.basic import box_iou


@pytest.mark.parametrize("response,expected", [
    ("<answer> 7 </answer><|im_end|>", "7"),
    ("so \\boxed{\\frac{1}{2}} and \\boxed{3}", "3"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("<answer>1</answer> then <answer>2</answer>", "2"),
    ("plain", "plain"),
])
def test_extract_answer(response, expected):
    assert extract_answer(response) == expected


@pytest.mark.parametrize("response,answer,score", [
    ("<answer>3</answer>", "3", 1.0),
    ("<answer>3.0</answer>", "3", 1.0),
    ("<answer>4</answer>", "3", 0.0),
    ("<answer>3 or 4</answer>", "3", 0.0),  # hedging
    ("<answer>1,000</answer>", "1000", 1.0),
    ("<answer></answer>", "3", 0.0),
])
def test_number(response, answer, score):
    assert get_reward("number")(response, answer).overall == score


def test_number_tolerance():
    assert get_reward("number")("<answer>3.04</answer>", "3", tolerance=0.05).overall == 1.0


OPTIONS = {"A": "red", "B": "green", "C": "blue", "D": "yellow"}


@pytest.mark.parametrize("response,score", [
    ("<answer>B</answer>", 1.0), ("<answer>(b).</answer>", 1.0), ("<answer>B. green</answer>", 1.0),
    ("<answer>green</answer>", 1.0), ("<answer>B. red</answer>", 0.0), ("<answer>A</answer>", 0.0),
    ("<answer>A B C D</answer>", 0.0), ("<answer>Blue</answer>", 0.0),
])
def test_multiple_choice(response, score):
    assert get_reward("multiple_choice")(response, "B", options=OPTIONS).overall == score


def test_box_iou_by_hand():
    # [0,0,10,10] vs [5,5,15,15]: intersection 5*5 = 25, union 100 + 100 - 25 = 175
    assert box_iou([0, 0, 10, 10], [5, 5, 15, 15]) == pytest.approx(25 / 175)
    assert box_iou([0, 0, 10, 10], [20, 20, 30, 30]) == 0.0
    assert box_iou([5, 5, 5, 9], [0, 0, 10, 10]) == 0.0  # degenerate


def test_bbox_iou_reward():
    out = get_reward("bbox_iou")("<answer>[0, 0, 10, 10]</answer>", [0, 0, 10, 20])
    assert out.overall == pytest.approx(0.5) and out.parts["accuracy"] == 1.0
    assert get_reward("bbox_iou")("<answer>(0,0,10,10)</answer>", "[5, 5, 15, 15]").parts["accuracy"] == 0.0
    assert get_reward("bbox_iou")("no box here", [0, 0, 1, 1]).overall == 0.0


def test_ocr_reward_by_hand():
    ocr = get_reward("ocr")
    assert ocr("<answer>wolf</answer>", "wolf").overall == 1.0
    # one substitution in 4 characters: 1 - 1/4 = 0.75, not exact
    out = ocr("<answer>woif</answer>", "wolf")
    assert out.overall == pytest.approx(0.75) and out.parts["accuracy"] == 0.0
    assert ocr("<answer>cat</answer>", "wolf").overall == 0.0  # 1 - 4/4 = 0 < 0.5


def test_format_rewards():
    fmt, answer_only = get_reward("format"), get_reward("answer_format")
    assert fmt("<think>a</think><answer>b</answer>") == 1.0
    assert fmt("<answer>b</answer>") == 0.0
    assert fmt("<think>a</think><think>c</think><answer>b</answer>") == 0.0
    assert answer_only("<answer>b</answer><|im_end|>") == 1.0
    assert answer_only("x <answer>b</answer>") == 0.0


def test_compose_weighted_sum_and_accuracy():
    out = compose("<think>t</think><answer>3</answer>", "3", {"number": 0.8, "format": 0.2}, {})
    assert out.overall == pytest.approx(1.0)
    assert out.parts == {"number": 1.0, "number/accuracy": 1.0, "format": 0.0 + 1.0, "accuracy": 1.0}
    out = compose("<answer>4</answer>", "3", {"number": 0.8, "format": 0.2}, {})
    assert out.overall == pytest.approx(0.0) and out.parts["accuracy"] == 0.0


def test_every_registered_reward_honours_the_contract():
    """Contract: f(response, answer, **meta) -> float | RewardOutput, finite, on arbitrary input."""
    for name, fn in REWARDS.items():
        for response in ("", "<answer>1</answer>", "garbage " * 50):
            out = fn(response, "1", options=OPTIONS)
            value = out.overall if isinstance(out, RewardOutput) else out
            assert isinstance(value, float) and 0.0 <= value <= 1.0, name
