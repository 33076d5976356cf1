import pytest

from vlrl.data import Sample, generate
from vlrl.data.curriculum import with_template
from vlrl.data.tasks import TEMPLATES


def test_templates_replace_a_known_instruction():
    sample = generate("shapes", 1, tasks=["count"], template="answer")[0]
    assert sample.messages[0]["content"][-1]["text"].endswith(TEMPLATES["answer"])
    (think,) = with_template([sample], "think")
    text = think.messages[0]["content"][-1]["text"]
    assert text == "How many shapes are there? " + TEMPLATES["think"]
    assert sample.messages[0]["content"][-1]["text"].endswith(TEMPLATES["answer"])  # the input is not modified
    (bare,) = with_template([think], "none")
    assert bare.messages[0]["content"][-1]["text"] == "How many shapes are there?"
    (custom,) = with_template([bare], "Answer in one word.")
    assert custom.messages[0]["content"][-1]["text"] == "How many shapes are there? Answer in one word."


def test_string_content_and_image_only_turns():
    text_only = Sample(id="a", task="t", messages=[{"role": "system", "content": "Be brief."},
                                                   {"role": "user", "content": "2 + 2?"}], reward="number")
    (out,) = with_template([text_only], "answer")
    assert out.messages[1]["content"] == "2 + 2? " + TEMPLATES["answer"] and out.messages[0]["content"] == "Be brief."
    image_only = Sample(id="b", task="t", messages=[{"role": "user", "content": [{"type": "image"}]}],
                        images=["x.png"], reward="number")
    (out,) = with_template([image_only], "answer")
    assert out.messages[0]["content"] == [{"type": "image"}, {"type": "text", "text": TEMPLATES["answer"]}]
    with pytest.raises(ValueError, match="no user turn"):
        with_template([Sample(id="c", task="t", messages=[{"role": "system", "content": "x"}], reward="number")], "answer")
