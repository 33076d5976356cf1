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


def test_a_file_named_by_a_relative_path_finds_its_images_once(tmp_path, monkeypatch):
    """Image paths are relative to the jsonl file; read through a relative path (``data/shapes/test.jsonl``, as the
    README's commands do) they are joined to its folder once (before: ``data/shapes/data/shapes/images/...``)."""
    write_samples(generate("shapes", 2, tasks=["color"]), tmp_path / "data" / "shapes" / "test.jsonl")
    monkeypatch.chdir(tmp_path)
    back = read_samples("data/shapes/test.jsonl").samples
    assert [str(i) for s in back for i in s.images] == ["data/shapes/images/shapes-train-0-000000_0.png",
                                                         "data/shapes/images/shapes-train-0-000001_0.png"]
    assert all((tmp_path / i).is_file() for s in back for i in s.images)


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
    from vlrl.data.splits import reward_names_check

    path = tmp_path / "d.jsonl"
    path.write_text(_line(id="a") + "\n" + _line(id="b", reward="no_such_reward") + "\n")
    with pytest.raises(DataError, match=r"d\.jsonl:2: unknown reward 'no_such_reward'"):
        read_samples(path, check=reward_names_check)


def test_missing_path_is_an_error(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        read_samples(tmp_path / "nothing.jsonl")


# ----------------------------------------------------------------------------------------------- issue 38, finding 7
def _record(k, text="2+2?"):
    return json.dumps({"id": f"r{k}", "task": "t", "prompt": text, "answer": "4", "reward": "number"})


def test_a_record_over_the_bound_is_refused_while_reading_never_held(tmp_path):
    """A 40 MB line with a 1 MB bound: skipped through in pieces (peak memory of the read stays ~1 MB, not 40),
    reported with its exact size; the lines around it are read."""
    import tracemalloc

    from vlrl.data import MediaLimits

    path = tmp_path / "big.jsonl"
    with open(path, "w") as f:
        f.write(_record(0) + "\n")
        f.write(_record(1, "x" * (40 << 20)) + "\n")
        f.write(_record(2) + "\n")
    size = len(_record(1, "x" * (40 << 20)))
    tracemalloc.start()
    read = read_samples(path, on_error="skip", media=MediaLimits(max_record_bytes=1 << 20))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert [s.id for s in read.samples] == ["r0", "r2"]
    assert read.skipped == [(f"{path}:2", f"a record of {size:,} bytes, more than data.max_record_bytes (1,048,576)")]
    assert peak < 4 << 20, peak
    with pytest.raises(DataError, match=r"big.jsonl:2: a record of 41,943,114 bytes, more than data.max_record_bytes"):
        read_samples(path, media=MediaLimits(max_record_bytes=1 << 20))
    assert MediaLimits().max_record_bytes == 64 << 20  # the default bound (data.max_record_bytes)
    assert len(read_samples(path, media=MediaLimits()).samples) == 3


def test_a_parquet_row_over_the_bound_is_a_bad_record(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vlrl.data import MediaLimits

    rows = [json.loads(_record(k, "x" * (3000 if k == 1 else 3))) for k in range(4)]
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, tmp_path / "one.parquet", row_group_size=2)  # rows 0-1, 2-3
    read = read_samples(tmp_path / "one.parquet", on_error="skip", media=MediaLimits(max_record_bytes=2000))
    assert [s.id for s in read.samples] == ["r2", "r3"]  # rows 0-1: their group's mean is over the bound, not read
    assert read.skipped[0][0] == f"{tmp_path / 'one.parquet'}:rows 0-1"
    assert "bytes, more than data.max_record_bytes (2,000)" in read.skipped[0][1]
    pq.write_table(table, tmp_path / "two.parquet", row_group_size=4)  # one group: row 1 measured once read
    read = read_samples(tmp_path / "two.parquet", on_error="skip", media=MediaLimits(max_record_bytes=2000))
    assert [s.id for s in read.samples] == ["r0", "r2", "r3"]
    assert read.skipped == [(f"{tmp_path / 'two.parquet'}:row 1",
                             "a record of 3,010 bytes, more than data.max_record_bytes (2,000)")]  # 3000 + r1, t, 4, number
