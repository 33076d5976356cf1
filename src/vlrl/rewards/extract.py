"""Answer extraction shared by the verifiers.

`extract_answer` returns, in order of preference: the content of the last ``<answer>…</answer>``, else of
the last ``\\boxed{…}`` (nested braces handled), else the whole response — stripped of surrounding space
and of trailing special tokens such as ``<|im_end|>``.
"""

from __future__ import annotations

import re

_SPECIAL = re.compile(r"(<\|[a-z_]+\|>|</s>|<eos>)+\s*$")
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def strip_special(text: str) -> str:
    return _SPECIAL.sub("", text).strip()


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces, or None."""
    start = text.rfind("\\boxed{")
    while start != -1:
        depth, i = 0, start + len("\\boxed")
        for j in range(i, len(text)):
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
                if depth == 0:
                    return text[i + 1 : j]
        start = text.rfind("\\boxed{", 0, start)  # unbalanced: try an earlier one
    return None


def extract_answer(response: str) -> str:
    text = strip_special(response)
    tagged = _ANSWER.findall(text)
    if tagged:
        return tagged[-1].strip()
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    return text.strip()
