"""Prompt templates of an RL curriculum (LLaVA-OneVision-1.5-RL's two stages).

Stage 1 (answer-only) ends every prompt with "Put ONLY your final answer within <answer></answer>."; stage 2
(chain of thought) with "Think and solve the following question step by step. Please put your thinking and
analysis procedure within <think></think>. Put ONLY your final answer within <answer></answer>."
`with_template` rewrites a dataset's prompts for a stage: the instruction goes at the end of the last user
turn, replacing one of the known instructions (`vlrl.data.tasks.TEMPLATES`) if the prompt already ends with it.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from vlrl.data.sample import Sample
from vlrl.data.tasks import TEMPLATES


def template_text(template: str) -> str:
    """The instruction of a named template (answer, think, none), or ``template`` itself as literal text."""
    return TEMPLATES.get(template, template)


def with_template(samples: Sequence[Sample], template: str) -> list[Sample]:
    """Copies of ``samples`` whose last user turn ends with the template's instruction (and no other known one); their
    answer form is then the one the instruction asks for."""
    instruction = template_text(template)
    known = sorted((t for t in TEMPLATES.values() if t), key=len, reverse=True)
    out = []
    for sample in samples:
        sample = copy.copy(sample)
        sample.messages = copy.deepcopy(sample.messages)
        sample.answer_format = None  # the form the new instruction asks for (`Sample.declared_format`)
        users = [m for m in sample.messages if m.get("role") == "user"]
        if not users:
            raise ValueError(f"sample {sample.id} ({sample.source or 'generated'}): no user turn to put the "
                             "prompt template in")
        message = users[-1]
        if isinstance(message["content"], str):
            message["content"] = _retemplate(message["content"], known, instruction)
        else:
            texts = [p for p in message["content"] if p.get("type") == "text"]
            if texts:
                texts[-1]["text"] = _retemplate(texts[-1]["text"], known, instruction)
            elif instruction:
                message["content"].append({"type": "text", "text": instruction})
        out.append(sample)
    return out


def _retemplate(text: str, known: Sequence[str], instruction: str) -> str:
    body = text.rstrip()
    for suffix in known:
        if body.endswith(suffix):
            body = body[: -len(suffix)].rstrip()
            break
    if not instruction:
        return body
    return f"{body} {instruction}" if body else instruction
