"""Character spans of a response ↔ its token indices.

Step-level credit finds a plan step's ``action_id`` / ``action_name`` value as a character span of the
decoded response and needs the response tokens that carry it. `token_char_offsets` gives the character
range each token decodes to, two ways (as the embodied seed does):

- ``tokenizer``: re-tokenise the decoded text with ``return_offsets_mapping``; used when that gives back
  exactly the sampled ids (the round trip holds);
- ``prefix_decode``: otherwise (a sampled, non-canonical split such as ``app`` + ``le``; special tokens;
  clean-up of spaces) token t spans from the decoded length of ``ids[:t]`` to that of ``ids[:t + 1]``,
  each measured as the common prefix with the full text (computed from short windows, linear in T; see
  `prefix_decode_offsets`). A token that ends inside a multi-byte character (its prefix decodes to a
  trailing U+FFFD) shares the range of that character with the token completing it.
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


WINDOW = 8  # tokens decoded before token t to find its characters (a character spans at most 4 byte tokens)


def prefix_decode_offsets(tokenizer: Any, ids: Sequence[int], text: str | None = None) -> list[tuple[int, int]]:
    """Per-token ranges by prefix decoding.

    Token t ends where the decoded ``ids[:t + 1]`` stops agreeing with the full text. Decoding every prefix
    costs O(T²); instead each token's end is found by decoding a window of at most `WINDOW` tokens that starts
    on a character boundary whose position is already known — linear. When the window's text disagrees with
    the full text (a decoder that treats the first token of a sequence specially, e.g. SentencePiece dropping
    a leading space), the exact O(T²) prefix decoding is used instead.
    """
    text = decode(tokenizer, ids) if text is None else text
    ids = [int(i) for i in ids]
    decoder = _decoder(tokenizer)
    offsets = _windowed_offsets(decoder, ids, text)
    if offsets is None:
        offsets = _full_prefix_offsets(decoder, ids, text)
    return offsets


def _decoder(tokenizer: Any):
    """ids → text with special tokens kept: the Rust backend of a fast tokenizer (no Python overhead per call),
    else the tokenizer's own decode."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=False)
    return lambda ids: decode(tokenizer, ids)


def _windowed_offsets(decoder, ids: list[int], text: str) -> list[tuple[int, int]] | None:
    offsets: list[tuple[int, int]] = []
    partial: list[bool] = []
    previous = 0
    for t in range(len(ids)):
        s = max(0, t - WINDOW)
        while s > 0 and partial[s - 1]:  # start the window on a character boundary
            s -= 1
        start = offsets[s - 1][1] if s > 0 else 0
        piece = decoder(ids[s : t + 1])
        common = len(os.path.commonprefix([piece, text[start : start + len(piece)]]))
        cut = common < len(piece)
        if cut and not piece.endswith("\ufffd"):
            return None  # the window's text is not the full text's: let the exact method decide
        end = max(previous, start + common)
        offsets.append((previous, end))
        partial.append(cut)
        previous = end
    if previous != len(text):
        return None
    return _share_partial_characters(offsets, partial)


def _full_prefix_offsets(decoder, ids: list[int], text: str) -> list[tuple[int, int]]:
    offsets: list[tuple[int, int]] = []
    partial: list[bool] = []
    previous = 0
    for t in range(len(ids)):
        prefix = decoder(ids[: t + 1])
        common = len(os.path.commonprefix([prefix, text]))
        end = max(previous, common)
        offsets.append((previous, end))
        partial.append(common < len(prefix) and prefix.endswith("\ufffd"))
        previous = end
    return _share_partial_characters(offsets, partial)


def _share_partial_characters(offsets: list[tuple[int, int]], partial: list[bool]) -> list[tuple[int, int]]:
    """A token ending inside a multi-byte character (empty range) gets the range of that character, which the
    token completing it carries (right to left, so a run of byte pieces all get it)."""
    for t in range(len(offsets) - 2, -1, -1):
        if partial[t] and offsets[t][0] == offsets[t][1] and offsets[t + 1][1] > offsets[t + 1][0]:
            start = offsets[t + 1][0]
            offsets[t] = (start, start + 1)
    return offsets
