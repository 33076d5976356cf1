import pytest

from vlrl.rewards.extract import (
    boxed_contents,
    code_block,
    extract_answer,
    extract_json,
    final_answer,
    numbers,
    strip_special,
    tag_blocks,
)


@pytest.mark.parametrize("response,expected", [
    ("<answer> 7 </answer><|im_end|>", "7"),
    ("so \\boxed{\\frac{1}{2}} and \\boxed{3}", "3"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("<answer>1</answer> then <answer>2</answer>", "2"),
    ("plain", "plain"),
])
def test_extract_answer_takes_the_last_candidate(response, expected):
    assert extract_answer(response) == expected


@pytest.mark.parametrize("response,expected", [
    ("<answer> 7 </answer><|im_end|>", "7"),
    ("<answer>\\boxed{ 3 }</answer>", "3"),  # a box inside the tag is unwrapped
    ("\\boxed{3} so \\boxed{3}", "3"),  # repeating the same answer is not a hedge
    ("\\boxed{A}\\boxed{B}\\boxed{C}", None),  # boxed spam
    ("<answer>1</answer> then <answer>2</answer>", None),
    ("<answer>\\boxed{1}\\boxed{2}</answer>", None),
    ("<think>\\boxed{2}</think><answer>3</answer>", "3"),  # the tag wins over a box in the reasoning
    ("the   answer\n is 4", "the answer is 4"),  # whole response, whitespace collapsed
])
def test_final_answer_refuses_hedges(response, expected):
    assert final_answer(response) == expected


def test_boxed_contents_nested_and_unbalanced():
    assert boxed_contents("x \\boxed{\\frac{1}{2}} y \\boxed{\\boxed{3}}") == ["\\frac{1}{2}", "\\boxed{3}"]
    assert boxed_contents("\\boxed{a \\boxed{b}") == ["b"]  # the outer box never closes
    assert boxed_contents("\\fbox{4}") == ["4"]
    assert boxed_contents("no box {}") == []


def test_tag_blocks_and_strip_special():
    assert tag_blocks("<answer>a</answer>x<answer>b</answer><answer>c", "answer") == ["a", "b"]
    assert strip_special("x <|im_end|> <|endoftext|>\n") == "x"
    assert strip_special("</s>") == ""


def test_numbers():
    # thousands separators go, decimals/exponents/signs stay; "1,2" is two numbers
    assert numbers("1,000 apples, -2.5e3 and .5; 1,2") == ["1000", "-2.5e3", ".5", "1", "2"]


@pytest.mark.parametrize("text,expected", [
    ('```json\n{"a": 1}\n```', {"a": 1}),
    ('Here is the plan: {"a": [1, 2]} hope it helps<|im_end|>', {"a": [1, 2]}),
    ("[1, 2]", [1, 2]),
    ('```\nnot json\n```\n```json\n{"b": 2}\n```', {"b": 2}),
    ("{broken", None),
    ("[" * 50_000, None),  # too deep for the parser: no value, no crash
])
def test_extract_json(text, expected):
    assert extract_json(text) == expected


def test_code_block_takes_the_last_python_block():
    text = "```python\nprint(1)\n```\ntext\n```py\nprint(2)\n```\n```text\nno\n```"
    assert code_block(text) == "print(2)\n"
    assert code_block("no fences") is None
