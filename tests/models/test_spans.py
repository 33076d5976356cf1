import pytest

from vlrl.data import generate
from vlrl.models.spans import prefix_decode_offsets, token_char_offsets
from vlrl.models.tokenizer import train_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    samples = generate("embodied", 30, split="spans", image_size=56)
    return train_tokenizer([s.response for s in samples] + [s.prompt_text() for s in samples], vocab_size=600)


TEXT = '{"executable_plan": [{"action_id": 3, "action_name": "find a mug"}]}'


def _split_encoding(tokenizer, text, cuts):
    """Token ids of ``text`` encoded piece by piece (cut at character positions): the same text, other ids."""
    ids, start = [], 0
    for cut in [*cuts, len(text)]:
        ids += tokenizer(text[start:cut], add_special_tokens=False)["input_ids"]
        start = cut
    return ids


def test_round_trip_uses_the_tokenizers_offsets(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    offsets = token_char_offsets(tokenizer, ids)
    assert offsets.path == "tokenizer" and offsets.text == TEXT
    start = TEXT.index("find a mug")
    tokens = offsets.tokens_in((start, start + len("find a mug")))
    assert tokenizer.decode([ids[t] for t in tokens]).strip() == "find a mug"
    assert offsets.offsets == prefix_decode_offsets(tokenizer, ids)  # both paths agree when both apply


def test_non_canonical_ids_fall_back_to_prefix_decoding(tokenizer):
    start = TEXT.index("find a mug")
    ids = _split_encoding(tokenizer, TEXT, [start + 2, start + 8])  # "fi" | "nd a m" | "ug..." : not BPE's split
    assert ids != tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    offsets = token_char_offsets(tokenizer, ids)
    assert offsets.path == "prefix_decode" and offsets.text == TEXT
    tokens = offsets.tokens_in((start, start + len("find a mug")))
    assert "".join(tokenizer.decode([ids[t]]) for t in tokens).strip() == "find a mug"
    # the ranges tile the text: contiguous, non-overlapping, ending at its length
    assert offsets.offsets[0][0] == 0 and offsets.offsets[-1][1] == len(TEXT)
    assert all(a[1] == b[0] for a, b in zip(offsets.offsets, offsets.offsets[1:], strict=False))


def test_special_tokens_and_multibyte_characters(tokenizer):
    text = '[{"action_id": 5, "action_name": "put the café"}]'
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    offsets = token_char_offsets(tokenizer, ids)
    assert offsets.text == text + "<|im_end|>"
    start = text.index("café")
    tokens = offsets.tokens_in((start, start + 4))  # " c", "a", "f" and the two byte pieces of "é"
    assert tokenizer.decode([ids[t] for t in tokens]).strip() == "café"
    # alone, a byte piece of "é" decodes to U+FFFD: prefix decoding gives both pieces the range of "é", so the
    # same tokens cover the word
    prefix = prefix_decode_offsets(tokenizer, ids)
    assert all(b >= a for a, b in prefix) and prefix[-1][1] == len(offsets.text)
    pieces = [t for t in range(len(ids)) if tokenizer.decode([ids[t]]) == "\ufffd"]
    assert len(pieces) == 2 and [offsets.text[slice(*prefix[t])] for t in pieces] == ["é", "é"]
    fallback = type(offsets)(offsets.text, prefix, "prefix_decode")
    assert tokenizer.decode([ids[t] for t in fallback.tokens_in((start, start + 4))]).strip() == "café"
    assert offsets.tokens_in(None) == []


def test_windowed_prefix_decoding_equals_the_exact_one(tokenizer):
    from vlrl.models.spans import _decoder, _full_prefix_offsets, _windowed_offsets

    decoder = _decoder(tokenizer)
    for text in (TEXT * 3, '[{"action_id": 5, "action_name": "put the café ü ñ"}]' * 2):
        for ids in (tokenizer(text, add_special_tokens=False)["input_ids"], _split_encoding(tokenizer, text, range(1, len(text), 2))):
            windowed = _windowed_offsets(decoder, ids, text)
            assert windowed is not None and windowed == _full_prefix_offsets(decoder, ids, text)


def test_a_decoder_that_drops_a_leading_space_falls_back_to_exact_prefix_decoding(tokenizer):
    from vlrl.models.spans import _full_prefix_offsets, _windowed_offsets

    plain = tokenizer(" find a mug, pick up the mug, find a fridge, open the fridge", add_special_tokens=False)["input_ids"]
    assert len(plain) > 8  # so that some window starts after the first token
    lstrip = lambda ids: tokenizer.decode(ids).lstrip(" ")  # noqa: E731  (SentencePiece-like: no leading space)
    text = lstrip(plain)
    assert _windowed_offsets(lstrip, plain, text) is None  # a window starting at " pick" decodes to "pick"
    exact = _full_prefix_offsets(lstrip, plain, text)
    assert exact[-1][1] == len(text) and all(b >= a for a, b in exact)
