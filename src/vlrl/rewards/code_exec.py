"""The ``code`` verifier: run the generated Python program against test cases in the sandbox.

Program: the last fenced block (```` ```python ```` / ```` ```py ```` / ```` ``` ````), else the whole
response. Test forms accepted as ``answer`` (or a JSON string of one of them):

* ``[{"input": "1 2\\n", "output": "3\\n"}, ...]`` — stdin/stdout (CodeContests/TACO style); outputs are
  compared line by line with trailing whitespace and trailing blank lines ignored;
* ``{"inputs": [...], "outputs": [...]}`` — the same as two lists (APPS ``input_output``);
* ``["assert add(1, 2) == 3", ...]`` — assert snippets run after the program in its namespace (MBPP);
* ``"def check(candidate): ..."`` with meta ``entry_point="add"`` — HumanEval, run as ``check(add)``;
* ``{"tests": [...]}`` — any of the above under ``tests``.

See `vlrl.rewards.sandbox` for the limits and the isolation (no network, throw-away tmpfs, CPU/memory/
output/process limits, wall clock).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from vlrl.rewards.base import RewardOutput, register_reward
from vlrl.rewards.extract import code_block, strip_special
from vlrl.rewards.sandbox import SandboxLimits, run_python

MAX_TESTS = 50


def parse_tests(answer: Any, entry_point: str | None = None) -> list[dict]:
    """Sandbox tests (``{"stdin", "expected"}`` or ``{"assert"}``) from any accepted ``answer`` form."""
    if isinstance(answer, str):
        try:
            answer = json.loads(answer)
        except ValueError:
            snippet = answer + (f"\ncheck({entry_point})\n" if entry_point and "def check(" in answer else "")
            return [{"assert": snippet}]
    if isinstance(answer, dict):
        if "tests" in answer:
            return parse_tests(answer["tests"], entry_point)
        if "inputs" in answer and "outputs" in answer:
            if len(answer["inputs"]) != len(answer["outputs"]):
                raise ValueError(f"code: {len(answer['inputs'])} inputs but {len(answer['outputs'])} outputs")
            pairs = zip(answer["inputs"], answer["outputs"], strict=True)
            return [{"stdin": str(i), "expected": str(o)} for i, o in pairs]
    if isinstance(answer, list):
        tests = []
        for i, case in enumerate(answer):
            if isinstance(case, str):
                tests.append({"assert": case})
            elif isinstance(case, dict) and "input" in case and "output" in case:
                tests.append({"stdin": str(case["input"]), "expected": str(case["output"])})
            else:
                raise ValueError(f"code: test [{i}] must be an assert string or {{'input', 'output'}}, got {case!r:.80}")
        if tests:
            return tests
    raise ValueError(f"code: cannot read test cases from the answer {answer!r:.120}")


def same_output(actual: str, expected: str) -> bool:
    """Line-wise equality, ignoring trailing whitespace on each line and trailing blank lines."""
    def lines(text: str) -> list[str]:
        out = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
        while out and not out[-1]:
            out.pop()
        return out

    return lines(actual) == lines(expected)


@register_reward("code", mode="pool", deadline=40.0)
def code(response: str, answer: Any, *, entry_point: str | None = None, timeout: float = 4.0,
         cpu_seconds: float = 2.0, memory_mb: int = 512, time_budget: float = 30.0, packages: Sequence[str] = (),
         **meta: Any) -> RewardOutput:
    """Fraction of test cases passed, in [0, 1]: R = (# tests passed) / (# tests).

    LLaVA-OV-1.5 ``reward/generalcode.py``. A test passes if the program (and the test's asserts) run to
    the end with exit status 0 within ``timeout`` s wall / ``cpu_seconds`` CPU / ``memory_mb`` — and, for
    stdin/stdout tests, prints the expected output. The whole run gets ``time_budget`` s; tests not
    reached fail. At most 50 tests are run. The program may import the standard library and the installed
    packages named in ``packages`` (e.g. ``["numpy"]``), nothing else. Parts: ``accuracy`` (all passed),
    ``timeouts`` (fraction of tests that hit a time limit).
    """
    tests = parse_tests(answer, entry_point)[:MAX_TESTS]
    program = code_block(response)
    program = program if program is not None else strip_special(response)
    if not program.strip():
        return RewardOutput(overall=0.0, parts={"accuracy": 0.0, "timeouts": 0.0})
    limits = SandboxLimits(cpu_seconds=cpu_seconds, wall_seconds=timeout, memory_mb=memory_mb,
                           total_seconds=time_budget)
    runs = run_python(program, [{k: v for k, v in t.items() if k != "expected"} for t in tests], limits,
                      packages=list(packages))
    passed = sum(run.ok and ("expected" not in t or same_output(run.stdout, t["expected"])) for t, run in zip(tests, runs, strict=True))
    timeouts = sum(run.status == "timeout" for run in runs)
    score = passed / len(tests)
    return RewardOutput(overall=score, parts={"accuracy": float(passed == len(tests)), "timeouts": timeouts / len(tests)})
