import pytest

from vlrl.rewards import get_reward


def test_think_answer_format():
    fmt = get_reward("format")
    assert fmt("<think>a</think><answer>b</answer>") == 1.0
    assert fmt("<think>a</think>\n<answer>b</answer><|im_end|>") == 1.0
    assert fmt("<answer>b</answer>") == 0.0
    assert fmt("<think>a</think><think>c</think><answer>b</answer>") == 0.0
    assert fmt("<think>a</think>x<answer>b</answer>") == 0.0  # text between the blocks
    assert fmt("<answer>b</answer><think>a</think>") == 0.0  # wrong order
    assert fmt("<think>a</think><answer> \n</answer>") == 0.0  # an empty answer is no answer
    assert fmt("<think></think><answer>b</answer>") == 1.0  # (an empty think block is still a think block)


def test_answer_format():
    answer_only = get_reward("answer_format")
    assert answer_only("<answer>b</answer><|im_end|>") == 1.0
    assert answer_only("x <answer>b</answer>") == 0.0
    assert answer_only("<answer>b</answer><answer>c</answer>") == 0.0
    # issue 22: whitespace only earned 1.0
    for empty in ("<answer> </answer>", "<answer></answer>", "<answer>\n\t </answer><|im_end|>"):
        assert answer_only(empty) == 0.0, empty


def test_cot_format_boxed_fraction_by_hand():
    cot = get_reward("cot_format")
    # "<think>abcdefghijklmnopqrstuvwxyz</think>\boxed{12}": 7 + 26 + 8 + 11 = 52 chars, boxed 2 ≤ 0.2·52
    assert cot("<think>abcdefghijklmnopqrstuvwxyz</think>\\boxed{12}") == 1.0
    # "<think>ab</think>\boxed{123456}": 7 + 2 + 8 + 15 = 32 chars, boxed 6 ≤ 6.4 → 1; 7 digits: 7 > 6.6 → 0
    assert cot("<think>ab</think>\\boxed{123456}") == 1.0
    assert cot("<think>ab</think>\\boxed{1234567}") == 0.0
    assert cot("<think>abcdefghijklmnopqrstuvwxyz</think> 12") == 0.0  # no box
    assert cot("<think>a</think><think>b</think>\\boxed{1}" + "x" * 50) == 0.0  # two think blocks


@pytest.mark.parametrize("length,expected", [
    (80, 0.0),  # ≤ L_max − L_cache = 80
    (90, -0.5),  # (80 − 90) / 20
    (100, -1.0),  # (80 − 100) / 20
    (101, -1.0),  # > L_max
])
def test_overlong_is_dapo_eq13(length, expected):
    assert get_reward("overlong")("x", None, max_length=100, cache_length=20, response_length=length) == expected


def test_overlong_needs_a_length():
    overlong = get_reward("overlong")
    assert overlong("x" * 90, None, max_length=100, cache_length=20, unit="chars") == -0.5
    with pytest.raises(ValueError, match="response_length"):
        overlong("x", None, max_length=100, cache_length=20)
    with pytest.raises(ValueError, match="cache_length"):
        overlong("x", None, max_length=10, cache_length=20, response_length=1)


def test_answer_forms_accept_one_block_and_nothing_after_it():
    """`has_answer_form` — what strict scoring requires (issue 52): one non-empty answer block and nothing else
    (answer); the same after at most one leading think block (think); anything (none)."""
    from vlrl.rewards.format import has_answer_form

    assert has_answer_form("<answer>3</answer><|im_end|>", "answer")
    for broken in ("<answer>3</answer>3</answer>3", "<answer>1</answer>1</answer>1</answer>1", "<answer>3",
                   "3", "<answer> </answer>", "<answer>3</answer><answer>3</answer>", "so <answer>3</answer>"):
        assert not has_answer_form(broken, "answer"), broken
    assert has_answer_form("<think>two and one</think>\n<answer>3</answer>", "think")
    assert has_answer_form("<answer>3</answer>", "think")  # the think block is the `format` reward's to require
    for broken in ("<answer>3</answer><think>x</think>", "<think>x</think><think>y</think><answer>3</answer>",
                   "x<think>y</think><answer>3</answer>", "<think>x<answer>3</answer>"):
        assert not has_answer_form(broken, "think"), broken
    assert has_answer_form("anything at all", "none")
    with pytest.raises(ValueError, match="unknown answer format 'json'"):
        has_answer_form("{}", "json")
