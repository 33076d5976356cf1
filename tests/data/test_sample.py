import pytest
from PIL import Image

from vlrl.data.sample import (
    Sample,
    SampleError,
    image_size,
    load_image,
    messages_from_prompt,
    sample_from_json,
)


def test_prompt_shorthand_becomes_image_parts():
    messages = messages_from_prompt("<image>How many?")
    assert messages == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}]


def test_image_count_must_match_placeholders(tmp_path):
    with pytest.raises(SampleError, match="field 'images': 0 image"):
        sample_from_json({"id": "a", "task": "t", "prompt": "<image>x", "answer": "1", "reward": "number"}, tmp_path)


def test_final_assistant_turn_becomes_response(tmp_path):
    record = {
        "id": "a", "task": "t", "answer": "4", "reward": "number",
        "messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<answer>4</answer>"}],
    }
    sample = sample_from_json(record, tmp_path)
    assert sample.response == "<answer>4</answer>"
    assert [m["role"] for m in sample.messages] == ["user"]


def test_unknown_field_and_bad_reward_are_named(tmp_path):
    with pytest.raises(SampleError, match=r"unknown field\(s\) \['answr'\]"):
        sample_from_json({"id": "a", "task": "t", "prompt": "x", "answr": 1}, tmp_path)
    with pytest.raises(SampleError, match="field 'reward'"):
        sample_from_json({"id": "a", "task": "t", "prompt": "x", "reward": {"number": "heavy"}}, tmp_path)


def test_load_image_reports_missing_and_corrupt(tmp_path):
    with pytest.raises(SampleError, match="not found"):
        load_image(str(tmp_path / "nope.png"))
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not a png")
    with pytest.raises(SampleError, match="cannot decode"):
        load_image(str(bad))
    assert load_image(Image.new("L", (4, 4))).mode == "RGB"


@pytest.mark.parametrize("fmt", ["EPS", "PPM", "TIFF", "ICO"])
def test_only_allow_listed_image_formats_are_decoded(tmp_path, fmt):
    """PNG, JPEG, WEBP, BMP, GIF load; any other format Pillow knows is refused by name before decoding, from a
    data file's path, bytes or a data URL alike (issue 22: EPS, which Pillow decodes with Ghostscript, was read)."""
    import base64
    import io

    for ok in ("PNG", "JPEG", "WEBP", "BMP", "GIF"):
        buffer = io.BytesIO()
        Image.new("RGB", (8, 6)).save(buffer, format=ok)
        assert load_image(buffer.getvalue()).size == (8, 6) and image_size(buffer.getvalue()) == (8, 6)
    buffer = io.BytesIO()
    # ICO: name the icon's size, or Pillow < 13 writes an empty icon (no size of its default list fits 8×8)
    Image.new("RGB", (8, 8)).save(buffer, format=fmt, **({"sizes": [(8, 8)]} if fmt == "ICO" else {}))
    path = tmp_path / f"image.{fmt.lower()}"
    path.write_bytes(buffer.getvalue())
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    for source in (str(path), buffer.getvalue(), url):
        with pytest.raises(SampleError, match=f"format {fmt} is not accepted"):
            load_image(source)
        with pytest.raises(SampleError, match=f"format {fmt} is not accepted"):
            image_size(source)


def test_max_pixels_refuses_from_the_header():
    import io

    buffer = io.BytesIO()
    Image.new("L", (300, 200)).save(buffer, format="PNG")
    assert load_image(buffer.getvalue(), max_pixels=60_000).size == (300, 200)
    with pytest.raises(SampleError, match="300x200 has more than 59999 pixels"):
        load_image(buffer.getvalue(), max_pixels=59_999)


def test_validate_rejects_bad_role():
    sample = Sample(id="a", task="t", messages=[{"role": "robot", "content": "x"}], reward="number")
    with pytest.raises(SampleError, match=r"messages\[0\]"):
        sample.validate()


def test_a_sample_declares_its_answer_form_or_its_prompt_does(tmp_path):
    """Issue 52: the form strict scoring requires — a jsonl row's ``format``, else the one the prompt asks for."""
    from vlrl.data.sample import SampleError, sample_from_json, sample_to_json

    def declared(prompt, **record):
        return sample_from_json({"id": "a", "task": "t", "prompt": prompt, "answer": "3", "reward": "number",
                                 **record}, tmp_path).declared_format()

    assert declared("How many? Put ONLY your final answer within <answer></answer>.") == "answer"
    assert declared("Think within <think></think>. Put ONLY your final answer within <answer></answer>.") == "think"
    assert declared("How many shapes?") == "none"
    assert declared("Write <description></description> then <answer></answer>.") == "none"  # another template's
    assert declared("How many shapes?", format="answer") == "answer"
    with pytest.raises(SampleError, match="field 'format': 'json' is not an answer format"):
        declared("How many?", format="json")
    sample = sample_from_json({"id": "a", "task": "t", "prompt": "q", "answer": "3", "reward": "number",
                               "format": "think"}, tmp_path)
    assert sample_to_json(sample, [])["format"] == "think"
