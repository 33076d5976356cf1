"""The `arith` suite: text-only integer word problems, so plain LLMs use the same path as VLMs.

Tasks: ``add`` ("Tom has 3 apples and gets 5 more ..."), ``sub`` ("... gives away 2 ..."), ``mul``
("3 boxes with 4 pens each ..."), and ``two_step`` (add then subtract). Answers are integers verified by
``number``.
"""

from __future__ import annotations

import random

from vlrl.data.sample import Sample
from vlrl.data.tasks import TASK_SUITES, format_prompt, format_response

NAMES = ("Tom", "Ana", "Li", "Sam", "Mia", "Omar", "Eva", "Raj")
THINGS = ("apples", "pens", "coins", "books", "cards", "eggs", "shells", "stamps")
TASKS = ("add", "sub", "mul", "two_step")


@TASK_SUITES.register("arith")
def generate_arith(
    n: int,
    *,
    split: str = "train",
    seed: int = 0,
    tasks: list[str] | None = None,
    max_operand: int = 9,
    template: str = "answer",
) -> list[Sample]:
    """Generate ``n`` arithmetic word problems with operands in 1..max_operand."""
    tasks = list(tasks or TASKS)
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown:
        raise ValueError(f"arith: unknown task(s) {unknown}; choose from {list(TASKS)}")
    samples = []
    for i in range(n):
        task = tasks[i % len(tasks)]
        rng = random.Random(f"arith/{split}/{seed}/{i}")
        name, thing = rng.choice(NAMES), rng.choice(THINGS)
        a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
        if task == "add":
            question, answer = f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have?", a + b
        elif task == "sub":
            a, b = max(a, b), min(a, b)
            question, answer = f"{name} has {a} {thing} and gives away {b}. How many {thing} are left?", a - b
        elif task == "mul":
            question, answer = f"{name} has {a} boxes with {b} {thing} in each. How many {thing} in total?", a * b
        else:
            c = rng.randint(1, a + b)
            question = f"{name} has {a} {thing}, gets {b} more, then gives away {c}. How many {thing} are left?"
            answer = a + b - c
        prompt = format_prompt(question, template)
        samples.append(
            Sample(
                id=f"arith-{split}-{seed}-{i:06d}",
                task=f"arith/{task}",
                messages=[{"role": "user", "content": prompt}],
                answer=str(answer),
                reward="number",
                response=format_response(str(answer), template),
            )
        )
    return samples
