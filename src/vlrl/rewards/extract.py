"""Answer extraction shared by the verifiers.

Every function here runs in time linear in the length of the text (no regular expression that can
backtrack over the whole input), so a 10 MB response or a regex bomb costs milliseconds, not hours.

The forms a response may give its answer in, in order of preference:

* ``<answer>…</answer>`` — the content of the tag (a ``\\boxed{…}`` inside it is unwrapped);
* ``\\boxed{…}`` — with nested braces, e.g. ``\\boxed{\\frac{1}{2}}``;
* the whole response;

always after stripping trailing special tokens such as ``<|im_end|>``, and read from the last
``WINDOW`` (200,000) characters of the response. `extract_answer` takes the last
candidate (the behaviour of the seed's ``extract_boxed_content(...)[-1]``); `final_answer` returns None
when the response offers several *different* final answers (``\\boxed{A}\\boxed{B}\\boxed{C}``,
two ``<answer>`` tags that disagree) — a hedge, which the verifiers score 0.

JSON (`extract_json`) is taken from a fenced code block, the whole response, or the outermost
``{…}`` / ``[…]`` inside prose; code (`code_block`) from the last fenced block.
"""

from __future__ import annotations

import json
import re
from typing import Any

_SPECIAL_TAIL = re.compile(r"(?:<\|[A-Za-z0-9_]{1,40}\|>|</s>|<eos>|<\|endoftext\|>)\s*\Z")
WINDOW = 200_000  # answers are read from the last WINDOW characters of a response
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def strip_special(text: str) -> str:
    """``text`` without trailing special tokens (``<|im_end|>``, ``</s>``, ``<eos>``) and outer space."""
    text = text.strip()
    end = len(text)
    while True:
        tail = text[max(0, end - 64) : end]  # a special token is short: match only the tail (linear)
        match = _SPECIAL_TAIL.search(tail)
        if not match:
            return text[:end]
        end -= len(tail) - match.start()
        while end > 0 and text[end - 1].isspace():
            end -= 1


def tag_blocks(text: str, tag: str) -> list[str]:
    """Contents of every ``<tag>…</tag>`` (not nested), in order. Unclosed tags are ignored."""
    open_tag, close_tag = f"<{tag}>", f"</{tag}>"
    blocks, pos = [], 0
    while True:
        start = text.find(open_tag, pos)
        if start < 0:
            return blocks
        end = text.find(close_tag, start + len(open_tag))
        if end < 0:
            return blocks  # no later close tag exists either
        blocks.append(text[start + len(open_tag) : end])
        pos = end + len(close_tag)


_BRACE_OR_BOXED = re.compile(r"\\boxed\s*\{|\\fbox\s*\{|[{}]")


def boxed_contents(text: str) -> list[str]:
    """Contents of every outermost closed ``\\boxed{…}`` (or ``\\fbox{…}``) with balanced braces, in order.

    One left-to-right pass over the braces with a stack of open braces, each remembering whether it
    opened a box; then boxes nested in another closed box are dropped. A box never closed is ignored
    (so ``\\boxed{a \\boxed{b}`` gives ``["b"]``).
    """
    if "\\boxed" not in text and "\\fbox" not in text:
        return []
    spans: list[tuple[int, int]] = []
    stack: list[tuple[int, bool]] = []  # (content start, opens a box)
    for match in _BRACE_OR_BOXED.finditer(text):
        token = match.group()
        if token == "}":
            if stack:
                start, is_box = stack.pop()
                if is_box:
                    spans.append((start, match.start()))
        else:
            stack.append((match.end(), token != "{"))
    found, last_end = [], -1
    for start, end in sorted(spans):
        if start > last_end:  # not inside the previous outermost box
            found.append(text[start:end])
            last_end = end
    return found


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{…}`` with balanced braces, or None."""
    boxes = boxed_contents(text)
    return boxes[-1] if boxes else None


def extract_answer(response: str) -> str:
    """The last ``<answer>`` content, else the last ``\\boxed{}`` content, else the whole response."""
    text = strip_special(response[-WINDOW:])
    tagged = tag_blocks(text, "answer")
    if tagged:
        return tagged[-1].strip()
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    return text


def _single(candidates: list[str]) -> str | None:
    distinct = {" ".join(c.split()) for c in candidates}
    return " ".join(candidates[-1].split()) if len(distinct) == 1 else None


def final_answer(response: str) -> str | None:
    """The response's one final answer, or None if it gives several different ones (a hedge).

    ``<answer>`` tags win over ``\\boxed{}``; a box inside the answer tag is unwrapped; without either,
    the whole response (stripped of trailing special tokens) is the answer. Whitespace is collapsed.
    """
    text = strip_special(response[-WINDOW:])
    tagged = tag_blocks(text, "answer")
    if tagged:
        inner = _single(tagged)
        if inner is None:
            return None
        boxed = boxed_contents(inner)
        return _single(boxed) if boxed else inner
    boxed = boxed_contents(text)
    if boxed:
        return _single(boxed)
    return " ".join(text.split())


def numbers(text: str) -> list[str]:
    """Every number token in ``text`` (``-3``, ``2.5``, ``.5``, ``1e-3``), thousands commas removed."""
    return _NUMBER.findall(re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", text))


def code_block(text: str, languages: tuple[str, ...] = ("python", "py", "python3", "")) -> str | None:
    """Body of the last fenced code block (```` ```lang ````) whose language is in ``languages``."""
    blocks = fenced_blocks(text)
    chosen = [body for lang, body in blocks if lang.lower() in languages]
    return chosen[-1] if chosen else None


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every closed ```` ``` ```` fenced block, in order."""
    blocks, pos = [], 0
    while True:
        start = text.find("```", pos)
        if start < 0:
            return blocks
        newline = text.find("\n", start + 3)
        end = text.find("```", newline + 1) if newline >= 0 else -1
        if newline < 0 or end < 0:
            return blocks
        language = text[start + 3 : newline].strip()
        blocks.append((language if len(language) < 20 else "", text[newline + 1 : end]))
        pos = end + 3


def extract_json(text: str) -> Any | None:
    """The JSON value a response holds, or None.

    Tried in order: the last fenced block that parses (```` ```json ```` or plain), the whole response,
    then the outermost ``{…}`` and ``[…]`` spans (first opening to last closing bracket) — a bounded
    number of parse attempts, each linear.
    """
    text = strip_special(text)
    for _, body in reversed(fenced_blocks(text)):
        value = _loads(body)
        if value is not None:
            return value
    value = _loads(text)
    if value is not None:
        return value
    for opening, closing in (("{", "}"), ("[", "]")):
        start, end = text.find(opening), text.rfind(closing)
        if 0 <= start < end:
            value = _loads(text[start : end + 1])
            if value is not None:
                return value
    return None


def _loads(text: str) -> Any | None:
    text = text.strip()
    if not text or text[0] not in "{[":
        return None
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None
