"""Hack probes: adversarial responses that must earn no (or bounded) reward, quickly.

Each `Probe` is one response a reward-hacking policy might find — format without content, boxed spam,
hedged lists, huge numbers, regex bombs, 10 MB outputs, hostile SVG, hostile programs — with the most
reward it may earn. The test suite (``tests/rewards/test_probes.py``) and ``benchmarks/rewards.py`` score
them all through `RewardExecutor` and check the bound and the latency. Add a probe here when you find a
new hack.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TEN_MB = 10 * 1024 * 1024
OPTIONS = {"A": "red", "B": "green", "C": "blue", "D": "yellow"}
REF_HTML = "<html><body><h1>Title</h1><p>Hello world</p><ul><li>one</li><li>two</li></ul></body></html>"
REF_SVG = ('<svg xmlns="http://www.w3.org/2000/svg" width="64" height="64">'
           '<rect x="8" y="8" width="48" height="48" fill="red"/></svg>')
PLAN = {"executable_plan": [{"action_id": 3, "action_name": "find apple"}, {"action_id": 7, "action_name": "pick up apple"},
                            {"action_id": 9, "action_name": "put down apple"}]}
SCENE = {"task": "pick_place", "objects": {"apple": "table"}, "targets": ["apple"], "destination": "counter",
         "open": {"fridge": False, "microwave": False, "cabinet": False},
         "cells": {"table": 0, "counter": 1, "shelf": 2, "fridge": 3, "microwave": 4, "cabinet": 5, "sink": 6}}
CODE_TESTS = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 7\n", "output": "12\n"}]
FAST_CODE = {"timeout": 1.0, "cpu_seconds": 1.0, "time_budget": 4.0}  # per-test limits for the probes


@dataclass
class Probe:
    """An adversarial response for ``reward`` and the most it may score (``bound``)."""

    name: str
    reward: str | dict[str, float]
    response: str
    answer: Any
    bound: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)


def _bombs(answer_tag: bool = True) -> list[tuple[str, str]]:
    """(name, response) regex/parser bombs that every text verifier must survive in linear time."""
    wrap = (lambda s: f"<answer>{s}</answer>") if answer_tag else (lambda s: s)
    return [
        ("unclosed_answer_tags", "<answer>" * 50_000),
        ("unclosed_boxes", "\\boxed{" * 50_000),
        ("special_token_tail", "<|im_end|>" * 50_000 + "x"),
        ("digit_run", wrap("3" * 150_000)),
        ("open_brackets", wrap("[" * 100_000)),
        ("comma_numbers", wrap("1," * 90_000)),
        ("ten_mb", "A" * TEN_MB),
    ]


def probes() -> list[Probe]:
    """The adversarial set, per verifier."""
    return [*_answer_probes(), *_box_probes(), *_markup_probes(), *_code_probes(), *_format_probes()]


def _answer_probes() -> list[Probe]:
    """Hedges, an empty answer and the bombs, for each verifier that reads one answer."""
    out: list[Probe] = []
    hedges = {
        "number": ("3", ["<answer>1 2 3 4 5</answer>", "\\boxed{1}\\boxed{2}\\boxed{3}", "<answer>10**10**10</answer>",
                         "<answer>1e999999</answer>", "<answer>3</answer><answer>4</answer>"]),
        "multiple_choice": ("B", ["<answer>A B C D</answer>", "<answer>A, B, C or D</answer>",
                                  "\\boxed{A}\\boxed{B}\\boxed{C}", "<answer>B. red</answer>"]),
        "bool": ("yes", ["<answer>yes or no</answer>", "<answer>yes/no</answer>", "\\boxed{yes}\\boxed{no}"]),
        "string_match": ("paris", ["<answer>london paris berlin rome madrid</answer>", "\\boxed{rome}\\boxed{paris}"]),
        "ocr": ("hello", ["<answer>hello hello hello hello</answer>", "\\boxed{hallo}\\boxed{hello}"]),
        "math": ("3", ["\\boxed{1}\\boxed{2}\\boxed{3}", "\\boxed{1, 2, 3, 4, 5}", "\\boxed{3 \\text{ or } 4}",
                       "\\boxed{10^{10^{10}}}", "<answer>10**10**10</answer>", "\\boxed{(10^{10})!}",
                       "The answer is 3"]),
    }
    for verifier, (answer, responses) in hedges.items():
        meta = {"options": OPTIONS} if verifier == "multiple_choice" else {}
        if verifier == "string_match":
            meta = {"mode": "contains"}
        for k, response in enumerate(responses):
            out.append(Probe(f"{verifier}/hedge{k}", verifier, response, answer, meta=meta))
        out.append(Probe(f"{verifier}/format_only", verifier, "<think></think><answer></answer>", answer, meta=meta))
        for name, response in _bombs():
            out.append(Probe(f"{verifier}/{name}", verifier, response, answer, meta=meta))
    return out


def _box_probes() -> list[Probe]:
    """Boxes: first box only; the whole image; detection spam."""
    out: list[Probe] = []
    # boxes: first box only; the whole image; detection spam (s = N_gt / N_pred)
    gt = [10, 10, 50, 50]
    out += [
        Probe("bbox_iou/many_boxes", "bbox_iou", "<answer>[0, 0, 10, 10] [10, 10, 50, 50]</answer>", gt),
        Probe("bbox_iou/whole_image", "bbox_iou", "<answer>[0, 0, 1000, 1000]</answer>", gt, bound=0.0017),
        *[Probe(f"bbox_iou/{n}", "bbox_iou", r, gt) for n, r in _bombs()],
    ]
    detections = [{"bbox_2d": gt, "label": "cat"}]
    spam = [{"bbox_2d": [x, y, x + 40, y + 40], "label": "cat"} for x in range(0, 400, 20) for y in range(0, 400, 20)]
    out += [
        Probe("ovd_map/duplicates", "ovd_map", str([detections[0]] * 100).replace("'", '"'), detections, bound=0.01),
        Probe("ovd_map/grid_spam", "ovd_map", str(spam[:200] + detections).replace("'", '"'), detections, bound=1 / 201),
        Probe("ovd_map/deep_json", "ovd_map", "[" * 100_000, detections),
        *[Probe(f"ovd_map/{n}", "ovd_map", r, detections) for n, r in _bombs()],
    ]
    return out


def _markup_probes() -> list[Probe]:
    """HTML and SVG: copy-padding, deep nesting, hostile SVG."""
    out: list[Probe] = []
    # markup: copy-padding is penalised by multiset Jaccard; hostile SVG renders nothing
    laughs = ('<?xml version="1.0"?><!DOCTYPE svg [<!ENTITY a "aaaaaaaaaa">'
              + "".join(f'<!ENTITY {c} "{("&" + p + ";") * 10}">' for p, c in zip("abcdefgh", "bcdefghi", strict=True))
              + ']><svg xmlns="http://www.w3.org/2000/svg"><text>&i;</text></svg>')
    out += [
        Probe("html/format_only", "html", "```html\n```", REF_HTML),
        Probe("html/padding", "html", REF_HTML * 100, REF_HTML, bound=0.011),
        Probe("html/deep_nesting", "html", "<div>" * 100_000, REF_HTML),
        Probe("html/ten_mb", "html", "<p>" + "x" * TEN_MB, REF_HTML),
        Probe("svg/billion_laughs", "svg", laughs, REF_SVG, bound=0.5),
        Probe("svg/external_file", "svg", '<svg xmlns="http://www.w3.org/2000/svg" xmlns:xlink="http://www.w3.org/1999/xlink">'
              '<image xlink:href="file:///etc/passwd" width="64" height="64"/></svg>', REF_SVG, bound=0.5),
        Probe("svg/external_url", "svg", '<svg xmlns="http://www.w3.org/2000/svg"><image href="http://10.0.0.1/x.svg" '
              'width="64" height="64"/></svg>', REF_SVG, bound=0.5),
        Probe("svg/huge_canvas", "svg", '<svg xmlns="http://www.w3.org/2000/svg" width="100000000" height="100000000">'
              '<rect width="100000000" height="100000000" fill="red"/></svg>', REF_SVG, bound=1.0),  # resource probe
        Probe("svg/ten_mb", "svg", "<svg>" + "x" * TEN_MB, REF_SVG),
    ]
    return out


def _code_probes() -> list[Probe]:
    """Hostile programs for the code verifier."""
    out: list[Probe] = []
    # code: hostile programs score nothing and are stopped by the limits
    fence = "```python\n{}\n```"
    hostile = {
        "sleep_forever": "import time\ntime.sleep(10**6)",
        "busy_loop": "while True:\n    pass",
        "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        "network": "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=3)\nprint(3)",
        "ten_mb_output": "import sys\nsys.stdout.write('3\\n' * (5 * 1024 * 1024))",
        "exit_early": "import sys\nsys.exit(0)",
        "os_exit": "import os\nos._exit(0)",
        "memory_hog": "x = bytearray(8 * 1024 ** 3)",
        "huge_power": "print(10**10**10)",
    }
    for name, program in hostile.items():
        out.append(Probe(f"code/{name}", "code", fence.format(program), CODE_TESTS[:1], meta=dict(FAST_CODE)))
    out.append(Probe("code/exit_before_asserts", "code", fence.format("import sys\nsys.exit(0)"),
                     ["assert add(1, 2) == 3"], meta=dict(FAST_CODE)))
    return out


def _format_probes() -> list[Probe]:
    """Format-type rewards, plans and the overlong penalty."""
    out: list[Probe] = []
    # format-type rewards reward format by design (bounded by 1); the probes check they stay fast
    for verifier in ("format", "answer_format", "cot_format", "json_plan"):
        for name, response in _bombs(answer_tag=False):
            out.append(Probe(f"{verifier}/{name}", verifier, response, None))
    for name, response in _bombs(answer_tag=False):  # plan text is read by a step scanner: it must stay linear
        out.append(Probe(f"plan_success/{name}", "plan_success", response, None, meta={"scene": SCENE}))
    out += [
        Probe("cot_format/box_everything", "cot_format", "<think>x</think>\\boxed{" + "so the answer is 3 " * 50 + "}", None),
        Probe("json_plan/deep_json", "json_plan", "{" * 100_000, None),
        Probe("plan_prefix/repeat_first_step", "plan_prefix",
              '{"executable_plan": ' + str([PLAN["executable_plan"][0]] * 50).replace("'", '"') + "}", PLAN,
              bound=2 / 12),  # R(1; 3) = 1·2 / (3·4)
        Probe("plan_prefix/deep_json", "plan_prefix", "[" * 100_000, PLAN),
        # the first step matches a one-step gold plan, then 3,999 more steps: K = 4000 (scored 1.0 before issue 22)
        Probe("plan_prefix/long_plan", "plan_prefix",
              '{"executable_plan": ' + str(PLAN["executable_plan"][:1] + PLAN["executable_plan"][1:2] * 3999).replace("'", '"')
              + "}", {"executable_plan": PLAN["executable_plan"][:1]}, bound=2 / (4000 * 4001)),
        Probe("answer_format/whitespace_answer", "answer_format", "<answer> \n </answer>", None),  # 1.0 before issue 22
        Probe("format/whitespace_answer", "format", "<think>x</think><answer> </answer>", None),
        # a plan cut off after thousands of steps: read step by step (linear), the first step is its only credit
        Probe("plan_prefix/cut_step_spam", "plan_prefix",
              '{"executable_plan": [' + '{"action_id": 3, "action_name": "find apple"}, ' * 3000, PLAN, bound=2 / 12),
        # the executor reads at most 64 steps; looping "find a apple" never reaches the goal
        Probe("plan_success/endless_plan", "plan_success",
              '{"executable_plan": [' + '{"action_id": 0, "action_name": "find a apple"}, ' * 3000 + "]}", None,
              meta={"scene": SCENE}),
        Probe("overlong/huge", "overlong", "x", None, bound=-1.0,
              meta={"max_length": 100, "cache_length": 20, "response_length": 10**9}),
    ]
    return out
