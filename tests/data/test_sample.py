import pytest
from PIL import Image

from vlrl.data.sample import Sample, SampleError, load_image, messages_from_prompt, sample_from_json


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


def test_validate_rejects_bad_role():
    sample = Sample(id="a", task="t", messages=[{"role": "robot", "content": "x"}], reward="number")
    with pytest.raises(SampleError, match=r"messages\[0\]"):
        sample.validate()
