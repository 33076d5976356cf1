import json

import pytest

from vlrl.rewards import get_reward
from vlrl.rewards.code_exec import parse_tests, same_output

FAST = {"timeout": 1.0, "cpu_seconds": 1.0, "time_budget": 6.0}
ADD = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
TESTS = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 7\n", "output": "12"}]


def test_parse_tests_forms():
    assert parse_tests(TESTS) == [{"stdin": "1 2\n", "expected": "3\n"}, {"stdin": "5 7\n", "expected": "12"}]
    assert parse_tests({"inputs": ["1"], "outputs": ["2"]}) == [{"stdin": "1", "expected": "2"}]
    assert parse_tests(json.dumps({"tests": ["assert f() == 1"]})) == [{"assert": "assert f() == 1"}]
    assert parse_tests("def check(candidate):\n    assert candidate(1) == 2", entry_point="inc") == [
        {"assert": "def check(candidate):\n    assert candidate(1) == 2\ncheck(inc)\n"}]
    with pytest.raises(ValueError, match="test cases"):
        parse_tests(7)


def test_same_output_ignores_trailing_space_only():
    assert same_output("3 \n\n", "3")
    assert not same_output("3\n4", "3")
    assert not same_output(" 3", "3")


def test_code_scores_fraction_of_tests():
    code = get_reward("code")
    out = code(ADD, TESTS, **FAST)
    assert out.overall == 1.0 and out.parts["accuracy"] == 1.0
    # prints a+b+1 when a == 5: one of two tests passes → 1/2
    half = "```python\na, b = map(int, input().split())\nprint(a + b + (a == 5))\n```"
    out = code(half, TESTS, **FAST)
    assert out.overall == 0.5 and out.parts["accuracy"] == 0.0


def test_code_assert_and_humaneval_styles():
    code = get_reward("code")
    program = "```python\ndef inc(x):\n    return x + 1\n```"
    assert code(program, ["assert inc(1) == 2", "assert inc(2) == 4"], **FAST).overall == 0.5
    check = "def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(-1) == 0"
    assert code(program, check, entry_point="inc", **FAST).overall == 1.0


def test_code_timeouts_are_reported():
    out = get_reward("code")("```python\nwhile True:\n    pass\n```", TESTS[:1], **FAST)
    assert out.overall == 0.0 and out.parts["timeouts"] == 1.0


def test_a_program_imports_only_the_packages_its_sample_allows():
    from vlrl.rewards.sandbox import isolation

    program = "```python\nimport numpy\nprint(int(numpy.array([1, 2]).sum()))\n```"
    tests = [{"input": "", "output": "3\n"}]
    limits = {**FAST, "memory_mb": 2048, "timeout": 4.0, "time_budget": 10.0}
    allowed = get_reward("code")(program, tests, packages=["numpy"], **limits)
    assert allowed.overall == 1.0
    if isolation() != "none":  # (without namespaces the interpreter's site-packages stay visible)
        assert get_reward("code")(program, tests, **limits).overall == 0.0
