import time

import pytest

from vlrl.rewards import get_reward

math_reward = get_reward("math")


@pytest.mark.parametrize("response,answer", [
    ("The answer is \\boxed{\\frac{1}{2}}", "0.5"),
    ("\\boxed{50\\%}", "1/2"),
    ("\\boxed{0.5}", "\\frac{1}{2}"),
    ("\\boxed{[1,2)}", "[1, 2)"),
    ("\\boxed{\\{1,2\\}}", "\\{2, 1\\}"),
    ("\\boxed{2, 1}", "1, 2"),
    ("\\boxed{x=3}", "3"),
    ("\\boxed{5 \\text{ cm}}", "5"),
    ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt 2}{2}"),
    ("<answer>$\\frac{3}{4}$</answer>", "0.75"),
    ("<think>...</think><answer>B</answer>", "B"),
    ("\\boxed{1.5708}", "\\pi/2"),  # math-verify says no; the SymPy fallback: |π/2 − 1.5708| / 1.5708 ≈ 2e-6 ≤ 1e-4
])
def test_equivalent_forms_agree(response, answer):
    out = math_reward(response, answer)
    assert out.overall == 1.0 and out.parts["accuracy"] == 1.0


@pytest.mark.parametrize("response,answer", [
    ("\\boxed{0.333}", "1/3"),  # 1e-3 relative error > rel_tol
    ("\\boxed{1}\\boxed{2}\\boxed{3}", "3"),  # boxed spam
    ("\\boxed{1, 2, 3, 4}", "3"),  # a set is not its member
    ("\\boxed{3 \\text{ or } 4}", "3"),
    ("\\boxed{\\pm 3}", "3"),
    ("The answer is 3", "3"),  # strict: the answer must be tagged or boxed
    ("\\boxed{10^{10^{10}}}", "1"),  # an exponent tower is compared as text, instantly
])
def test_wrong_or_hedged_answers_score_zero(response, answer):
    assert math_reward(response, answer).overall == 0.0


def test_non_strict_reads_prose():
    assert math_reward("x = 3 so the answer is 4", "4", strict=False).overall == 1.0


def test_tower_is_not_evaluated():
    start = time.perf_counter()
    assert math_reward("<answer>10**10**10</answer>", "10**10**10").overall == 1.0  # same text
    assert time.perf_counter() - start < 1.0


def test_without_its_extra_the_math_verifier_names_the_install_command(monkeypatch):
    """Issue 22: a bare ``ModuleNotFoundError: math_verify``. ``sys.modules[name] = None`` makes the module
    unimportable (find_spec answers None, import raises) as if it were not installed."""
    import sys

    from vlrl.rewards import MissingDependencyError, deps, missing_dependency

    assert missing_dependency("math") is None and missing_dependency("number") is None
    monkeypatch.setattr(deps, "_FOUND", set())
    monkeypatch.setitem(sys.modules, "math_verify", None)
    message = missing_dependency("math")
    assert message == "the 'math' verifier needs math_verify, which is not installed: pip install 'vlrl[rewards]'"
    with pytest.raises(MissingDependencyError, match=r"pip install 'vlrl\[rewards\]'"):
        math_reward("\\boxed{3}", "3")
    monkeypatch.setitem(sys.modules, "cairosvg", None)
    assert "pip install 'vlrl[rewards]'" in missing_dependency("svg")
    with pytest.raises(MissingDependencyError, match="cairosvg"):
        get_reward("svg")("<svg></svg>", "<svg></svg>")
