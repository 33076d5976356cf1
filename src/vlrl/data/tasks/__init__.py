"""Procedural, seeded task suites: the data vlrl ships with (no download).

A suite is a function ``generate(n, *, split, seed, tasks, **options) -> list[Sample]`` registered in
`TASK_SUITES` by its own module of this package (found at the first lookup: `vlrl.registry.Registry`'s ``discover``;
adding a suite is one file). Sample ``i`` of a split depends only on ``(seed, split, i)``, so the same call always
returns the same data and train/test never share a random stream.
"""

from __future__ import annotations

from vlrl.registry import Registry

TASK_SUITES = Registry("task suite", signature="generate(n, *, split, seed, tasks=None, **options) -> list[Sample]",
                       discover=__name__)

# Prompt suffixes of the LLaVA-OV-1.5 RL curriculum (stage 1: answer only; stage 2: chain of thought).
TEMPLATES = {
    "answer": "Put ONLY your final answer within <answer></answer>.",
    "think": (
        "Think and solve the following question step by step. Please put your thinking and analysis procedure "
        "within <think></think>. Put ONLY your final answer within <answer></answer>."
    ),
    "none": "",
}


def format_prompt(question: str, template: str) -> str:
    if template not in TEMPLATES:
        raise ValueError(f"unknown prompt template {template!r}; choose from {sorted(TEMPLATES)}")
    suffix = TEMPLATES[template]
    return f"{question} {suffix}" if suffix else question


def format_response(answer_text: str, template: str) -> str:
    """The reference response SFT trains on for a given template."""
    return answer_text if template == "none" else f"<answer>{answer_text}</answer>"


def generate(suite: str, n: int, *, split: str = "train", seed: int = 0, tasks: list[str] | None = None, **options):
    """Generate ``n`` samples of a registered suite (see `TASK_SUITES`)."""
    return TASK_SUITES.get(suite)(n, split=split, seed=seed, tasks=tasks, **options)
