import pytest

from vlrl.rewards import get_reward

OPTIONS = {"A": "red", "B": "green", "C": "blue", "D": "yellow"}


@pytest.mark.parametrize("response,answer,score", [
    ("<answer>3</answer>", "3", 1.0),
    ("<answer>3.0</answer>", "3", 1.0),
    ("<answer>3 apples</answer>", 3, 1.0),
    ("<answer>4</answer>", "3", 0.0),
    ("<answer>3 or 4</answer>", "3", 0.0),  # hedging
    ("<answer>1,000</answer>", "1000", 1.0),
    ("<answer>1e3</answer>", "1000", 1.0),
    ("<answer></answer>", "3", 0.0),
    ("\\boxed{3}\\boxed{4}", "3", 0.0),  # boxed hedge
    ("<answer>1e999</answer>", "3", 0.0),  # overflows to inf: not a number we accept
])
def test_number(response, answer, score):
    out = get_reward("number")(response, answer)
    assert out.overall == score and out.parts["accuracy"] == score


def test_number_tolerance():
    # |3.04 - 3| = 0.04 ≤ 0.05, but > 0.03
    assert get_reward("number")("<answer>3.04</answer>", "3", tolerance=0.05).overall == 1.0
    assert get_reward("number")("<answer>3.04</answer>", "3", tolerance=0.03).overall == 0.0


@pytest.mark.parametrize("response,score", [
    ("<answer>B</answer>", 1.0), ("<answer>(b).</answer>", 1.0), ("<answer>B. green</answer>", 1.0),
    ("<answer>green</answer>", 1.0), ("<answer>Answer: B</answer>", 1.0), ("<answer>B. red</answer>", 0.0),
    ("<answer>A</answer>", 0.0), ("<answer>A B C D</answer>", 0.0), ("<answer>Blue</answer>", 0.0),
    ("\\boxed{B}\\boxed{C}", 0.0),
])
def test_multiple_choice(response, score):
    assert get_reward("multiple_choice")(response, "B", options=OPTIONS).overall == score


def test_multiple_choice_without_options_takes_only_a_bare_letter():
    mc = get_reward("multiple_choice")
    assert mc("\\boxed{c}", "C").overall == 1.0
    assert mc("<answer>C because it is blue</answer>", "C").overall == 0.0


@pytest.mark.parametrize("response,answer,score", [
    ("<answer>Yes</answer>", "yes", 1.0), ("<answer>yes, it is</answer>", True, 1.0),
    ("<answer>False.</answer>", "no", 1.0), ("<answer>no</answer>", "1", 0.0),
    ("<answer>yes or no</answer>", "yes", 0.0), ("<answer>No, it is not true</answer>", "no", 0.0),
    ("<answer>maybe</answer>", "yes", 0.0),
])
def test_bool(response, answer, score):
    assert get_reward("bool")(response, answer).overall == score


def test_string_match():
    sm = get_reward("string_match")
    assert sm("<answer>The Eiffel Tower!</answer>", "eiffel tower").overall == 1.0  # articles, case, punctuation
    assert sm("<answer>Paris</answer>", ["London", "paris"]).overall == 1.0  # any accepted answer
    assert sm("<answer>it is paris</answer>", "paris").overall == 0.0  # exact mode
    assert sm("<answer>it is paris</answer>", "paris", mode="contains").overall == 1.0  # 2 extra words ≤ 3
    assert sm("<answer>london paris berlin rome madrid</answer>", "paris", mode="contains").overall == 0.0
    with pytest.raises(ValueError, match="mode"):
        sm("x", "x", mode="fuzzy")


def test_ocr_by_hand():
    ocr = get_reward("ocr")
    assert ocr("<answer>Wolf</answer>", "wolf").overall == 1.0
    # one substitution in 4 characters: 1 - 1/4 = 0.75, not exact
    out = ocr("<answer>woif</answer>", "wolf")
    assert out.overall == pytest.approx(0.75) and out.parts["accuracy"] == 0.0
    assert ocr("<answer>cat</answer>", "wolf").overall == 0.0  # 1 - 4/4 = 0 < 0.5
    # best of several accepted answers: "wolves" vs "wolf": 3 edits / 6 → 0.5 (kept); vs "wolve": 1/6 → 0.8333
    assert ocr("<answer>wolves</answer>", ["wolf", "wolve"]).overall == pytest.approx(1 - 1 / 6)
