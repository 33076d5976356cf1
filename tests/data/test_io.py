import json

import pytest

from vlrl.data import DataError, generate, read_samples, write_samples


def _line(**fields):
    record = {"id": "x", "task": "t", "prompt": "2+2?", "answer": "4", "reward": "number"}
    record.update(fields)
    return json.dumps(record)


def test_jsonl_round_trip_with_images(tmp_path):
    samples = generate("shapes", 6, tasks=["count", "locate"])
    path = write_samples(samples, tmp_path / "train.jsonl")
    back = read_samples(path).samples
    assert [s.id for s in back] == [s.id for s in samples]
    assert back[1].answer == samples[1].answer  # a box survives as a list
    assert (tmp_path / back[0].images[0]).exists() or back[0].images[0].startswith(str(tmp_path))
    first = json.loads(path.read_text().splitlines()[0])
    assert first["images"] == ["images/shapes-train-0-000000_0.png"]  # relative to the jsonl file


def test_parquet_round_trip(tmp_path):
    samples = generate("shapes", 4, tasks=["color"])
    back = read_samples(write_samples(samples, tmp_path / "d.parquet")).samples
    assert [s.answer for s in back] == [s.answer for s in samples]
    assert back[0].metadata["options"]["A"] == "red"


def test_malformed_line_names_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(_line(id="a") + "\n{not json\n" + _line(id="c") + "\n")
    with pytest.raises(DataError, match=r"d\.jsonl:2: malformed JSON"):
        read_samples(path)


def test_skip_mode_counts_every_bad_record(tmp_path):
    path = tmp_path / "d.jsonl"
    lines = [_line(id="a"), "{oops", _line(id="b", images=["missing.png"], prompt="<image>?"), _line(id="a"), _line(id="d")]
    path.write_text("\n".join(lines) + "\n")
    report = read_samples(path, on_error="skip")
    assert [s.id for s in report.samples] == ["a", "d"]
    where = [w for w, _ in report.skipped]
    assert where == [f"{path}:2", f"{path}:3", f"{path}:4"]
    assert "not found" in report.skipped[1][1] and "duplicate id" in report.skipped[2][1]


def test_check_hook_reports_unknown_reward_with_line(tmp_path):
    from vlrl.train.common import reward_names_check

    path = tmp_path / "d.jsonl"
    path.write_text(_line(id="a") + "\n" + _line(id="b", reward="no_such_reward") + "\n")
    with pytest.raises(DataError, match=r"d\.jsonl:2: unknown reward 'no_such_reward'"):
        read_samples(path, check=reward_names_check)


def test_missing_path_is_an_error(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        read_samples(tmp_path / "nothing.jsonl")
