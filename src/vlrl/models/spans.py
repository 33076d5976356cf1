"""Character spans of a response ↔ its token indices.

Step-level credit finds a plan step's ``action_id`` / ``action_name`` value as a character span of the
decoded response and needs the response tokens that carry it. `token_char_offsets` gives the character
range each token decodes to, two ways (as the embodied seed does):

- ``tokenizer``: re-tokenise the decoded text with ``return_offsets_mapping``; used when that gives back
  exactly the sampled ids (the round trip holds);
- ``prefix_decode``: otherwise (a sampled, non-canonical split such as ``app`` + ``le``; special tokens;
  clean-up of spaces) token t spans from the decoded length of ``ids[:t]`` to that of ``ids[:t + 1]``,
  each measured as the common prefix with the full text. A token that ends inside a multi-byte character
  (its prefix decodes to a trailing U+FFFD) shares the range of that character with the token completing it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class TokenOffsets:
    """The decoded text of a response and, per token, its character range ``[start, end)`` in that text."""

    text: str
    offsets: list[tuple[int, int]]
    path: str  # "tokenizer" | "prefix_decode"

    def tokens_in(self, span: tuple[int, int] | None) -> list[int]:
        """Indices of the tokens whose (non-empty) range overlaps the character span ``[start, end)``."""
        if span is None:
            return []
        start, end = span
        return [t for t, (a, b) in enumerate(self.offsets) if b > a and a < end and b > start]


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    """The text of ``ids`` with special tokens kept (so every token has a place in it)."""
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def token_char_offsets(tokenizer: Any, ids: Sequence[int]) -> TokenOffsets:
    """`TokenOffsets` of a response: the tokenizer's offsets when re-tokenisation round-trips, else prefix decoding."""
    ids = [int(i) for i in ids]
    text = decode(tokenizer, ids)
    if getattr(tokenizer, "is_fast", False):
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        if list(encoded["input_ids"]) == ids:
            return TokenOffsets(text, [(int(a), int(b)) for a, b in encoded["offset_mapping"]], "tokenizer")
    return TokenOffsets(text, prefix_decode_offsets(tokenizer, ids, text), "prefix_decode")


def prefix_decode_offsets(tokenizer: Any, ids: Sequence[int], text: str | None = None) -> list[tuple[int, int]]:
    """Per-token ranges from decoding growing prefixes (O(T²) characters; T is a response, not a corpus)."""
    text = decode(tokenizer, ids) if text is None else text
    offsets, partial, previous = [], [], 0
    for t in range(len(ids)):
        prefix = decode(tokenizer, ids[: t + 1])
        common = len(os.path.commonprefix([prefix, text]))
        end = max(previous, common)
        offsets.append((previous, end))
        partial.append(common < len(prefix) and prefix.endswith("\ufffd"))
        previous = end
    for t in range(len(ids) - 2, -1, -1):  # right to left: a run of byte pieces takes the completed character
        if partial[t] and offsets[t][0] == offsets[t][1] and offsets[t + 1][1] > offsets[t + 1][0]:
            start = offsets[t + 1][0]
            offsets[t] = (start, start + 1)
    return offsets
